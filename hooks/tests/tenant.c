/*
 * A tenant for the compute-isolation and start-up benchmarks (bench/arbiter.py,
 * bench/storm.py), on the stand-in driver or a real one.
 *
 *   vgpu_tenant load PHASES    PHASES = DEMAND:SECONDS[,DEMAND:SECONDS...]: for
 *                              each phase, launches kernels of TENANT_KERNEL_US
 *                              (default FAKE_CUDA_LAUNCH_US, else 200) so as to
 *                              use DEMAND % of the card if it were alone (100 =
 *                              greedy), in windows of 20 ms; prints one JSON
 *                              line per phase: launches and the GPU time its
 *                              kernels got (stand-in only, else -1); with
 *                              TENANT_LAUNCH_LOG set, also a line per launch
 *                              with the CLOCK_MONOTONIC ns it returned at
 *   vgpu_tenant storm MIB SECS init, context, a first allocation of MIB and one
 *                              launch; prints how long that took (ns, from the
 *                              process's start of main), then keeps launching
 *                              for SECS so that the hook identifies its host
 *                              pid, and prints the host pid the hook settled on
 *                              (from its budget file slot, via the probe hook)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../vgpu_hooks.h"

#define DECL(sym, base, since, until, ptsz, params) CUresult sym params;
VGPU_HOOK_LIST(DECL)
CUresult cuInit(unsigned int flags);
CUresult cuCtxSetCurrent(CUcontext ctx);

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static void sleep_ns(long long ns)
{
    if (ns <= 0)
        return;
    struct timespec ts = {ns / 1000000000ll, ns % 1000000000ll};
    nanosleep(&ts, NULL);
}

static long long (*busy_ns)(void);

static int setup(void)
{
    CUdevice dev = 0; /* ordinal 0 (what cuDeviceGet(&dev, 0) gives) */
    CUcontext ctx;
    if (cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
        return -1;
    busy_ns = (long long (*)(void))dlsym(RTLD_DEFAULT, "fake_cuda_busy_ns");
    return 0;
}

static CUresult launch(void)
{
    return cuLaunchKernel((CUfunction)1, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
}

static int load(const char *phases)
{
    const char *k = getenv("TENANT_KERNEL_US");
    if (!k)
        k = getenv("FAKE_CUDA_LAUNCH_US");
    long long kernel_ns = (k ? atoll(k) : 200) * 1000ll, window_ns = 20000000ll;
    int log_launches = getenv("TENANT_LAUNCH_LOG") != NULL;
    if (kernel_ns <= 0 || setup() != 0)
        return 1;
    char *copy = strdup(phases), *save = NULL;
    for (char *ph = strtok_r(copy, ",", &save); ph; ph = strtok_r(NULL, ",", &save)) {
        double demand = atof(ph), seconds = strchr(ph, ':') ? atof(strchr(ph, ':') + 1) : 0;
        long long start = now_ns(), end = start + (long long)(seconds * 1e9);
        long long busy0 = busy_ns ? busy_ns() : -1;
        unsigned long long launches = 0;
        while (now_ns() < end) {
            long long w0 = now_ns();
            long long per_window = (long long)(demand / 100.0 * (double)window_ns / (double)kernel_ns);
            if (demand >= 100)
                per_window = window_ns / kernel_ns + 1;
            for (long long i = 0; i < per_window && now_ns() < end; i++, launches++) {
                launch();
                if (log_launches) { /* when each launch returned (CLOCK_MONOTONIC) */
                    printf("{\"launched_ns\":%lld}\n", now_ns());
                    fflush(stdout);
                }
            }
            if (demand < 100)
                sleep_ns(w0 + window_ns - now_ns());
        }
        long long busy = busy_ns ? busy_ns() - busy0 : -1;
        printf("{\"demand\":%.1f,\"seconds\":%.3f,\"launches\":%llu,\"busy_ns\":%lld,\"pid\":%d}\n",
               demand, (double)(now_ns() - start) / 1e9, launches, busy, getpid());
        fflush(stdout);
    }
    free(copy);
    return 0;
}

static int storm(long long t0, size_t mib, double seconds)
{
    CUdeviceptr p;
    if (setup() != 0 || cuMemAlloc_v2(&p, mib << 20) != CUDA_SUCCESS || launch() != CUDA_SUCCESS)
        return 1;
    long long ready = now_ns() - t0;
    struct timespec cpu; /* this process's CPU time so far, every thread (the hook's too) */
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu);
    printf("{\"op\":\"ready\",\"init_ns\":%lld,\"cpu_ns\":%lld,\"pid\":%d}\n", ready,
           cpu.tv_sec * 1000000000ll + cpu.tv_nsec, getpid());
    fflush(stdout);
    long long end = now_ns() + (long long)(seconds * 1e9);
    while (now_ns() < end) {
        launch();
        sleep_ns(1000000);
    }
    printf("{\"op\":\"done\",\"pid\":%d}\n", getpid());
    return 0;
}

int main(int argc, char **argv)
{
    long long t0 = now_ns();
    if (argc >= 3 && !strcmp(argv[1], "load"))
        return load(argv[2]);
    if (argc >= 4 && !strcmp(argv[1], "storm"))
        return storm(t0, (size_t)atoll(argv[2]), atof(argv[3]));
    fprintf(stderr, "usage: %s load DEMAND:SECONDS[,...] | storm MIB SECONDS\n", argv[0]);
    return 2;
}
