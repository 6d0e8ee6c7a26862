#!/bin/sh
# Prints {"alloc_free_pair_ns": ..., "launch_ns": ...}: what libvgpu adds per
# alloc/free pair and per kernel launch (under a memory limit and a compute
# limit that is not binding), against the bare stand-in driver.
set -eu
build=${1:-build}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export LD_LIBRARY_PATH="$build/fake:$build/fake-nvml"
bare=$("$build/vgpu_bench")
hooked=$(LD_PRELOAD="$build/libvgpu.so" VGPU_MEMORY_LIMIT_MIB=65536 VGPU_CORE_LIMIT=50 \
    VGPU_SHARED_DIR="$dir" FAKE_NVML_SM_UTIL=0 "$build/vgpu_bench")
echo "$bare $hooked" | awk '{printf "{\"alloc_free_pair_ns\": %.1f, \"launch_ns\": %.1f, \"bare_alloc_free_pair_ns\": %.1f, \"bare_launch_ns\": %.1f}\n", $3 - $1, $4 - $2, $1, $2}'
