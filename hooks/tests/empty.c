/* An empty shared library: the least any /etc/ld.so.preload entry costs (preload_bench.sh). */
int vgpu_bench_empty_library;
