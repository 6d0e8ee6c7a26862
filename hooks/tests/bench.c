/*
 * Micro-benchmark: ns per cuMemAlloc_v2 + cuMemFree_v2 pair and per
 * cuLaunchKernel, best of several rounds.  Run once bare and once with
 * libvgpu preloaded (bench.sh) to get the cost the hook adds.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../vgpu_hooks.h"

CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuLaunchKernel(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                        unsigned int, unsigned int, unsigned int, CUstream, void **, void **);

#define ROUNDS 7
#define N 200000

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(void)
{
    double best_pair = 1e18, best_launch = 1e18;
    for (int r = 0; r < ROUNDS; r++) {
        double t0 = now_ns();
        for (int i = 0; i < N; i++) {
            CUdeviceptr p;
            if (cuMemAlloc_v2(&p, 1 << 20) != CUDA_SUCCESS || cuMemFree_v2(p) != CUDA_SUCCESS) {
                fprintf(stderr, "alloc/free failed\n");
                return 1;
            }
        }
        double t1 = now_ns();
        for (int i = 0; i < N; i++)
            cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        double t2 = now_ns();
        if ((t1 - t0) / N < best_pair)
            best_pair = (t1 - t0) / N;
        if ((t2 - t1) / N < best_launch)
            best_launch = (t2 - t1) / N;
    }
    printf("%.1f %.1f\n", best_pair, best_launch);
    return 0;
}
