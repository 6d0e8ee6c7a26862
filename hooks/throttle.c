/*
 * Compute limit: a token bucket in front of every kernel launch.
 *
 * A background thread refills the bucket every REFILL_NS at `rate` launches
 * per second and, every CONTROL_NS, reads the SM utilisation of the
 * container's processes from NVML and corrects the rate:
 *     rate <- min(rate, observed launch rate) * clamp(limit / utilisation, 1/2, 2)
 * Until utilisation first exceeds the limit the bucket is not engaged at all
 * (launches pay one atomic increment); it disengages again when the rate it
 * allows is far above what the program launches.  Without NVML the limit
 * cannot be measured: one log line, and launches are never delayed.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <string.h>
#include <time.h>

#include "nvml_types.h"
#include "vgpu.h"
#include "vgpu_shared.h"

#define NVML_LIBRARY "libnvidia-ml.so.1"
#define REFILL_NS 5000000ll    /* 5 ms */
#define CONTROL_EVERY 10       /* refills: control period 50 ms */
#define MIN_RATE 10.0          /* launches/s: never starve a process entirely */
#define BURST_SECONDS 0.02     /* the bucket holds 20 ms worth of launches */
#define MAX_SAMPLES 512
#define MAX_PIDS 256

enum { OFF_UNKNOWN, OFF, RUNNING };

static struct {
    nvmlDeviceGetProcessUtilization_fn get_util;
    nvmlDevice_t devices[VGPU_MAX_DEVICES];
    unsigned long long last_seen[VGPU_MAX_DEVICES];
    unsigned int device_count;
} nvml;

static int state = OFF_UNKNOWN;
static int engaged;            /* the bucket is in force */
static long long tokens;
static unsigned long long launches;
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;

static void sleep_ns(long long ns)
{
    struct timespec ts = {ns / 1000000000ll, ns % 1000000000ll};
    nanosleep(&ts, NULL);
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static int nvml_load(void)
{
    static int logged;
    void *h = dlopen(NVML_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    nvmlInit_v2_fn init = h ? (nvmlInit_v2_fn)vgpu_dlsym_real(h, "nvmlInit_v2") : NULL;
    nvmlDeviceGetCount_v2_fn count =
        h ? (nvmlDeviceGetCount_v2_fn)vgpu_dlsym_real(h, "nvmlDeviceGetCount_v2") : NULL;
    nvmlDeviceGetHandleByIndex_v2_fn by_index =
        h ? (nvmlDeviceGetHandleByIndex_v2_fn)vgpu_dlsym_real(h, "nvmlDeviceGetHandleByIndex_v2")
          : NULL;
    nvml.get_util = h ? (nvmlDeviceGetProcessUtilization_fn)vgpu_dlsym_real(
                            h, "nvmlDeviceGetProcessUtilization")
                      : NULL;
    unsigned int n = 0;
    if (!init || !count || !by_index || !nvml.get_util || init() != NVML_SUCCESS ||
        count(&n) != NVML_SUCCESS || n == 0) {
        vgpu_log(&logged, "NVML (%s) unavailable: compute limit of %d%% not enforced",
                 NVML_LIBRARY, vgpu_cfg.core_percent);
        return -1;
    }
    for (unsigned int i = 0; i < n && nvml.device_count < VGPU_MAX_DEVICES; i++)
        if (by_index(i, &nvml.devices[nvml.device_count]) == NVML_SUCCESS)
            nvml.device_count++;
    return nvml.device_count ? 0 : -1;
}

static int is_ours(unsigned int pid, const int *pids, int npids)
{
    for (int i = 0; i < npids; i++)
        if ((unsigned int)pids[i] == pid)
            return 1;
    return 0;
}

/*
 * SM utilisation (percent) of one device's new samples: per process the mean
 * of its samples, summed over the container's processes.  If no sample is
 * from one of our pids (NVML reports host pids when the container has its own
 * PID namespace), the whole device's figure stands in, once logged.
 * Returns -1 when NVML has no new sample.
 */
static double device_util(unsigned int d, const int *pids, int npids)
{
    static int logged;
    static nvmlProcessUtilizationSample_t samples[MAX_SAMPLES]; /* controller thread only */
    unsigned int n = MAX_SAMPLES;
    if (nvml.get_util(nvml.devices[d], samples, &n, nvml.last_seen[d]) != NVML_SUCCESS || n == 0)
        return -1;
    double ours = 0, all = 0;
    int matched = 0;
    for (unsigned int i = 0; i < n && i < MAX_SAMPLES; i++) {
        if (samples[i].timeStamp > nvml.last_seen[d])
            nvml.last_seen[d] = samples[i].timeStamp;
        unsigned int sum = 0, count = 0, first = 1;
        for (unsigned int j = 0; j < n && j < MAX_SAMPLES; j++) {
            if (samples[j].pid != samples[i].pid)
                continue;
            first &= j >= i; /* count each pid once, at its first sample */
            sum += samples[j].smUtil;
            count++;
        }
        if (!first)
            continue;
        all += (double)sum / count;
        if (is_ours(samples[i].pid, pids, npids)) {
            ours += (double)sum / count;
            matched = 1;
        }
    }
    if (!matched)
        vgpu_log(&logged, "NVML reports none of this container's pids; throttling on the whole "
                 "device's utilisation");
    return matched ? ours : all;
}

static double container_util(void)
{
    int pids[MAX_PIDS];
    int npids = vgpu_budget_pids(pids, MAX_PIDS);
    double util = -1;
    for (unsigned int d = 0; d < nvml.device_count; d++) {
        double u = device_util(d, pids, npids);
        if (u > util)
            util = u;
    }
    return util;
}

static double clamp(double v, double lo, double hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

/* One control step; returns the new rate (launches per second). */
static double control(double rate, double observed, double util)
{
    double limit = vgpu_cfg.core_percent;
    if (!__atomic_load_n(&engaged, __ATOMIC_RELAXED)) {
        if (util <= limit)
            return rate;
        __atomic_store_n(&tokens, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&engaged, 1, __ATOMIC_RELEASE);
        return clamp(observed * limit / util, MIN_RATE, 1e12);
    }
    double base = observed < rate ? observed : rate;
    double next = clamp(base * clamp(util > 0 ? limit / util : 2, 0.5, 2), MIN_RATE, 1e12);
    if (util < limit && next > 4 * observed + MIN_RATE) /* the bucket no longer binds */
        __atomic_store_n(&engaged, 0, __ATOMIC_RELEASE);
    return next;
}

static void *controller(void *arg)
{
    (void)arg;
    double rate = 0, carry = 0;
    unsigned long long seen = __atomic_load_n(&launches, __ATOMIC_RELAXED);
    long long since = now_ns();
    for (unsigned long tick = 1;; tick++) {
        sleep_ns(REFILL_NS);
        if (tick % CONTROL_EVERY == 0) {
            long long t = now_ns();
            unsigned long long count = __atomic_load_n(&launches, __ATOMIC_RELAXED);
            double observed = (double)(count - seen) * 1e9 / (double)(t - since);
            seen = count;
            since = t;
            double util = container_util();
            if (util >= 0)
                rate = control(rate, observed, util);
        }
        if (!__atomic_load_n(&engaged, __ATOMIC_ACQUIRE))
            continue;
        carry += rate * REFILL_NS / 1e9;
        long long add = (long long)carry, cap = (long long)(rate * BURST_SECONDS) + 1;
        carry -= (double)add;
        long long cur = __atomic_load_n(&tokens, __ATOMIC_RELAXED);
        if (cur + add > cap)
            add = cap > cur ? cap - cur : 0;
        __atomic_fetch_add(&tokens, add, __ATOMIC_RELEASE);
    }
    return NULL;
}

static void start(void)
{
    pthread_mutex_lock(&start_lock);
    if (__atomic_load_n(&state, __ATOMIC_ACQUIRE) == OFF_UNKNOWN) {
        int next = OFF;
        if (nvml.device_count || nvml_load() == 0) {
            sigset_t all, old;
            pthread_t thread;
            pthread_attr_t attr;
            sigfillset(&all);
            pthread_sigmask(SIG_SETMASK, &all, &old); /* no program signal lands on our thread */
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            if (pthread_create(&thread, &attr, controller, NULL) == 0)
                next = RUNNING;
            pthread_attr_destroy(&attr);
            pthread_sigmask(SIG_SETMASK, &old, NULL);
        }
        __atomic_store_n(&state, next, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&start_lock);
}

void vgpu_throttle_wait(void)
{
    vgpu_init();
    if (!vgpu_cfg.core_percent)
        return;
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (__builtin_expect(s == OFF_UNKNOWN, 0)) {
        start();
        s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    }
    if (s != RUNNING)
        return;
    __atomic_fetch_add(&launches, 1, __ATOMIC_RELAXED);
    while (__atomic_load_n(&engaged, __ATOMIC_ACQUIRE)) {
        if (__atomic_sub_fetch(&tokens, 1, __ATOMIC_ACQUIRE) >= 0)
            return;
        __atomic_fetch_add(&tokens, 1, __ATOMIC_RELAXED);
        sleep_ns(REFILL_NS / 2);
    }
}

void vgpu_throttle_after_fork(void)
{
    /* The controller thread did not survive the fork; start it again lazily. */
    pthread_mutex_init(&start_lock, NULL);
    if (state == RUNNING)
        state = OFF_UNKNOWN;
    engaged = 0;
}

/* ---- launch wrappers ---- */

#define THROTTLED(call)                                                                          \
    do {                                                                                         \
        vgpu_throttle_wait();                                                                    \
        return (call);                                                                           \
    } while (0)

VGPU_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                    unsigned int bx, unsigned int by, unsigned int bz,
                                    unsigned int shmem, CUstream s, void **params, void **extra)
{
    THROTTLED(VGPU_REAL(cuLaunchKernel, f, gx, gy, gz, bx, by, bz, shmem, s, params, extra));
}

VGPU_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                         unsigned int gz, unsigned int bx, unsigned int by,
                                         unsigned int bz, unsigned int shmem, CUstream s,
                                         void **params, void **extra)
{
    THROTTLED(VGPU_REAL(cuLaunchKernel_ptsz, f, gx, gy, gz, bx, by, bz, shmem, s, params, extra));
}

VGPU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params,
                                      void **extra)
{
    THROTTLED(VGPU_REAL(cuLaunchKernelEx, config, f, params, extra));
}

VGPU_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                           void **params, void **extra)
{
    THROTTLED(VGPU_REAL(cuLaunchKernelEx_ptsz, config, f, params, extra));
}

VGPU_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                               unsigned int gz, unsigned int bx, unsigned int by,
                                               unsigned int bz, unsigned int shmem, CUstream s,
                                               void **params)
{
    THROTTLED(VGPU_REAL(cuLaunchCooperativeKernel, f, gx, gy, gz, bx, by, bz, shmem, s, params));
}

VGPU_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                                    unsigned int gz, unsigned int bx,
                                                    unsigned int by, unsigned int bz,
                                                    unsigned int shmem, CUstream s, void **params)
{
    THROTTLED(
        VGPU_REAL(cuLaunchCooperativeKernel_ptsz, f, gx, gy, gz, bx, by, bz, shmem, s, params));
}

VGPU_EXPORT CUresult cuGraphLaunch(CUgraphExec exec, CUstream s)
{
    THROTTLED(VGPU_REAL(cuGraphLaunch, exec, s));
}

VGPU_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec exec, CUstream s)
{
    THROTTLED(VGPU_REAL(cuGraphLaunch_ptsz, exec, s));
}
