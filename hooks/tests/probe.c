/*
 * Test probe: runs the operations named on its command line against the
 * driver and prints one JSON line each.  PROBE_PATH picks how it reaches the
 * driver: direct (linked, default), dlsym (dlopen + dlsym), proc
 * (cuGetProcAddress) or proc2 (cuGetProcAddress_v2).
 *
 *   alloc KIND MIB   allocate (KIND: mem mem1 pitch pitch1 managed async
 *                    async_ptsz pool pool_ptsz create array array1 array3d
 *                    array3d1 mipmap); prints rc and an id for `free`
 *   free ID          free allocation ID with its matching free
 *   freeptr HEX      cuMemFree_v2 of an arbitrary pointer
 *   fill KIND MIB    allocate MIB chunks until refused; prints how many
 *   threads N MIB    N threads fill at once; prints chunks held and what the
 *                    driver really holds, then frees everything
 *   info | info1 | total | total1   cuMemGetInfo(_v2) / cuDeviceTotalMem(_v2)
 *   dev N            make device N current
 *   launch SECONDS   cuLaunchKernel in a loop; prints launches in the last third
 *                    and the GPU share its kernels had then
 *   graph SECONDS US launches of a stand-in graph of US microseconds, likewise
 *   launchall        each launch entry point once
 *   ctx N            cuDevicePrimaryCtxRetain on device N (first context)
 *   stream N         later async allocations go to a new stream of device N
 *   poolkeep MIB     the current device's pool keeps MIB (-1: everything) when synchronised
 *   sync             cuCtxSynchronize
 *   poolcreate N     later "pool" allocations come from a new pool on device N
 *   forksleep MS     forks a child that sleeps MS and exits; the parent goes on
 *   vmm MIB          cuMemCreate + cuMemMap + cuMemRelease, still mapped; prints an id
 *   unmap ID         cuMemUnmap of a vmm mapping
 *   procnew          cuGetProcAddress("cuMemAlloc", 14000): a newer ABI, called as such
 *   procinfo V       cuGetProcAddress("cuMemGetInfo", V), called
 *   driver           what the stand-in driver really holds on the current device
 *   nvml             NVML memory info and compute processes, as pynvml reads them
 *   closeother       opens and closes the budget file again (drops POSIX locks)
 *   next | forward   dlsym forwarding checks
 *   forkchild MIB    a forked child allocates MIB, reports, exits without freeing
 *   ready | wait | sleep MS   synchronisation with the test
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../vgpu_hooks.h"

#define MIB (1024ull * 1024ull)
#define MAX_IDS 4096

#define DECL(sym, base, since, until, ptsz, params) CUresult sym params;
VGPU_HOOK_LIST(DECL)
int next_value(void);
/* Not hooked; looked up in the driver so that a probe built without
 * -lcuda (PROBE_NO_LINK: it can only dlopen the driver, RTLD_LOCAL, as the
 * CUDA runtime does) works the same. */
static CUresult (*ctx_set_current)(CUcontext);
static unsigned long long (*fake_cuda_used_bytes)(int dev);
static long long (*fake_cuda_busy_ns)(void);
static CUgraphExec (*fake_cuda_graph)(unsigned int us);
static unsigned long long (*fake_cuda_v3_flags)(void);
static CUresult (*stream_create)(CUstream *, unsigned int);
static CUresult (*device_get_mem_pool)(CUmemoryPool *, CUdevice);
static CUresult (*pool_set_attribute)(CUmemoryPool, int, void *);
static CUresult (*ctx_synchronize)(void);
static CUresult (*address_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
static CUstream probe_stream;
static CUmemoryPool probe_pool; /* "pool" allocations use it when set */
static int current;

#define FIELD(sym, base, since, until, ptsz, params) sym##_fn sym;
static struct {
    VGPU_HOOK_LIST(FIELD)
} api;

#define NAME_ENTRY(sym, base, since, until, ptsz, params) #sym,
static const char *const names[] = {VGPU_HOOK_LIST(NAME_ENTRY)};

/* How a CUDA runtime asks cuGetProcAddress for each entry point: base name,
 * cudaVersion, per-thread stream.  Written from cudaTypedefs.h, not from
 * the hook's table. */
static const struct {
    const char *symbol, *base;
    int version, ptsz;
} asks[] = {
    {"cuMemAlloc", "cuMemAlloc", 3000, 0}, {"cuMemAlloc_v2", "cuMemAlloc", 12000, 0},
    {"cuMemAllocPitch", "cuMemAllocPitch", 3000, 0},
    {"cuMemAllocPitch_v2", "cuMemAllocPitch", 12000, 0},
    {"cuMemAllocManaged", "cuMemAllocManaged", 12000, 0},
    {"cuMemAllocAsync", "cuMemAllocAsync", 12000, 0},
    {"cuMemAllocAsync_ptsz", "cuMemAllocAsync", 12000, 1},
    {"cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", 12000, 0},
    {"cuMemAllocFromPoolAsync_ptsz", "cuMemAllocFromPoolAsync", 12000, 1},
    {"cuMemCreate", "cuMemCreate", 12000, 0}, {"cuMemMap", "cuMemMap", 12000, 0},
    {"cuMemUnmap", "cuMemUnmap", 12000, 0}, {"cuMemPoolCreate", "cuMemPoolCreate", 12000, 0},
    {"cuMemPoolDestroy", "cuMemPoolDestroy", 12000, 0},
    {"cuMemPoolTrimTo", "cuMemPoolTrimTo", 12000, 0},
    {"cuArrayCreate", "cuArrayCreate", 3000, 0}, {"cuArrayCreate_v2", "cuArrayCreate", 12000, 0},
    {"cuArray3DCreate", "cuArray3DCreate", 3000, 0},
    {"cuArray3DCreate_v2", "cuArray3DCreate", 12000, 0},
    {"cuMipmappedArrayCreate", "cuMipmappedArrayCreate", 12000, 0},
    {"cuMemFree", "cuMemFree", 3000, 0}, {"cuMemFree_v2", "cuMemFree", 12000, 0},
    {"cuMemFreeAsync", "cuMemFreeAsync", 12000, 0},
    {"cuMemFreeAsync_ptsz", "cuMemFreeAsync", 12000, 1},
    {"cuMemRelease", "cuMemRelease", 12000, 0}, {"cuArrayDestroy", "cuArrayDestroy", 12000, 0},
    {"cuMipmappedArrayDestroy", "cuMipmappedArrayDestroy", 12000, 0},
    {"cuMemGetInfo", "cuMemGetInfo", 3000, 0}, {"cuMemGetInfo_v2", "cuMemGetInfo", 12000, 0},
    {"cuDeviceTotalMem", "cuDeviceTotalMem", 3000, 0},
    {"cuDeviceTotalMem_v2", "cuDeviceTotalMem", 12000, 0},
    {"cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", 12000, 0},
    {"cuCtxCreate", "cuCtxCreate", 3000, 0}, {"cuCtxCreate_v2", "cuCtxCreate", 11000, 0},
    {"cuCtxCreate_v3", "cuCtxCreate", 12000, 0}, {"cuCtxCreate_v4", "cuCtxCreate", 12080, 0},
    {"cuLaunchKernel", "cuLaunchKernel", 12000, 0},
    {"cuLaunchKernel_ptsz", "cuLaunchKernel", 12000, 1},
    {"cuLaunchKernelEx", "cuLaunchKernelEx", 12000, 0},
    {"cuLaunchKernelEx_ptsz", "cuLaunchKernelEx", 12000, 1},
    {"cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel", 12000, 0},
    {"cuLaunchCooperativeKernel_ptsz", "cuLaunchCooperativeKernel", 12000, 1},
    {"cuLaunch", "cuLaunch", 12000, 0}, {"cuLaunchGrid", "cuLaunchGrid", 12000, 0},
    {"cuLaunchGridAsync", "cuLaunchGridAsync", 12000, 0},
    {"cuGraphLaunch", "cuGraphLaunch", 12000, 0}, {"cuGraphLaunch_ptsz", "cuGraphLaunch", 12000, 1},
    {"cuGetProcAddress", "cuGetProcAddress", 11030, 0},
    {"cuGetProcAddress_v2", "cuGetProcAddress", 12000, 0},
};

static void bind_api(void)
{
    const char *path = getenv("PROBE_PATH");
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        exit(3);
    }
    ctx_set_current = (CUresult(*)(CUcontext))dlsym(h, "cuCtxSetCurrent");
    fake_cuda_used_bytes = (unsigned long long (*)(int))dlsym(h, "fake_cuda_used_bytes");
    fake_cuda_busy_ns = (long long (*)(void))dlsym(h, "fake_cuda_busy_ns");
    fake_cuda_graph = (CUgraphExec(*)(unsigned int))dlsym(h, "fake_cuda_graph");
    fake_cuda_v3_flags = (unsigned long long (*)(void))dlsym(h, "fake_cuda_v3_flags");
    stream_create = (CUresult(*)(CUstream *, unsigned int))dlsym(h, "cuStreamCreate");
    device_get_mem_pool = (CUresult(*)(CUmemoryPool *, CUdevice))dlsym(h, "cuDeviceGetMemPool");
    pool_set_attribute = (CUresult(*)(CUmemoryPool, int, void *))dlsym(h, "cuMemPoolSetAttribute");
    ctx_synchronize = (CUresult(*)(void))dlsym(h, "cuCtxSynchronize");
    address_reserve = (CUresult(*)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))
        dlsym(h, "cuMemAddressReserve");
    if (!path || strcmp(path, "direct") == 0) {
#ifdef PROBE_NO_LINK
        fprintf(stderr, "built without -lcuda: no direct calls\n");
        exit(3);
#else
#define DIRECT(sym, base, since, until, ptsz, params) api.sym = sym;
        VGPU_HOOK_LIST(DIRECT)
        return;
#endif
    }
    void **slots = (void **)&api;
    if (strcmp(path, "dlsym") == 0) {
        for (int i = 0; i < VGPU_HOOK_COUNT; i++)
            slots[i] = dlsym(h, names[i]);
        return;
    }
    int v2 = strcmp(path, "proc2") == 0;
    cuGetProcAddress_fn gpa = (cuGetProcAddress_fn)dlsym(h, "cuGetProcAddress");
    cuGetProcAddress_v2_fn gpa2 = (cuGetProcAddress_v2_fn)dlsym(h, "cuGetProcAddress_v2");
    for (int i = 0; i < VGPU_HOOK_COUNT; i++) {
        size_t a = 0;
        while (a < sizeof(asks) / sizeof(asks[0]) && strcmp(asks[a].symbol, names[i]) != 0)
            a++;
        if (a == sizeof(asks) / sizeof(asks[0])) {
            fprintf(stderr, "probe: no way to ask for %s\n", names[i]);
            exit(3);
        }
        cuuint64_t flags = asks[a].ptsz ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0;
        CUdriverProcAddressQueryResult status;
        CUresult rc = v2 ? gpa2(asks[a].base, &slots[i], asks[a].version, flags, &status)
                         : gpa(asks[a].base, &slots[i], asks[a].version, flags);
        if (rc != CUDA_SUCCESS)
            slots[i] = NULL;
    }
}

struct alloc {
    char kind[16];
    uint64_t handle;
};
static struct alloc ids[MAX_IDS];
static int nids;
static pthread_mutex_t ids_lock = PTHREAD_MUTEX_INITIALIZER;

static CUresult do_alloc(const char *kind, uint64_t mib, uint64_t *out)
{
    uint64_t bytes = mib * MIB;
    CUdeviceptr p = 0;
    CUresult rc;
    *out = 0;
    if (!strcmp(kind, "mem")) {
        rc = api.cuMemAlloc_v2(&p, bytes);
    } else if (!strcmp(kind, "mem1")) {
        CUdeviceptr_v1 p1 = 0;
        rc = api.cuMemAlloc(&p1, (unsigned int)bytes);
        p = p1;
    } else if (!strcmp(kind, "pitch")) { /* the driver picks a 2048 pitch for 1500 bytes */
        size_t pitch;
        rc = api.cuMemAllocPitch_v2(&p, &pitch, 1500, mib * 512, 4);
    } else if (!strcmp(kind, "pitch1")) {
        CUdeviceptr_v1 p1 = 0;
        unsigned int pitch;
        rc = api.cuMemAllocPitch(&p1, &pitch, 1500, (unsigned int)mib * 512, 4);
        p = p1;
    } else if (!strcmp(kind, "managed")) {
        rc = api.cuMemAllocManaged(&p, bytes, 1);
    } else if (!strcmp(kind, "async")) {
        rc = api.cuMemAllocAsync(&p, bytes, probe_stream);
    } else if (!strcmp(kind, "async_ptsz")) {
        rc = api.cuMemAllocAsync_ptsz(&p, bytes, probe_stream);
    } else if (!strcmp(kind, "pool") || !strcmp(kind, "pool_ptsz")) {
        CUmemoryPool pool = probe_pool;
        if (!pool)
            device_get_mem_pool(&pool, current);
        rc = kind[4] ? api.cuMemAllocFromPoolAsync_ptsz(&p, bytes, pool, probe_stream)
                     : api.cuMemAllocFromPoolAsync(&p, bytes, pool, probe_stream);
    } else if (!strcmp(kind, "create")) {
        CUmemAllocationProp prop = {.type = 1, .location = {CU_MEM_LOCATION_TYPE_DEVICE, 0}};
        rc = api.cuMemCreate(&p, bytes, &prop, 0);
    } else if (!strcmp(kind, "array") || !strcmp(kind, "array1")) {
        /* FLOAT x 1 channel, 1024 wide: 4 KiB a row, 256 rows a MiB */
        CUarray a = NULL;
        if (kind[5]) {
            CUDA_ARRAY_DESCRIPTOR_v1 d = {1024, (unsigned int)mib * 256, CU_AD_FORMAT_FLOAT, 1};
            rc = api.cuArrayCreate(&a, &d);
        } else {
            CUDA_ARRAY_DESCRIPTOR d = {1024, mib * 256, CU_AD_FORMAT_FLOAT, 1};
            rc = api.cuArrayCreate_v2(&a, &d);
        }
        p = (uintptr_t)a;
    } else if (!strcmp(kind, "array3d") || !strcmp(kind, "array3d1")) {
        CUarray a = NULL;
        if (kind[7]) {
            CUDA_ARRAY3D_DESCRIPTOR_v1 d = {1024, 256, (unsigned int)mib, CU_AD_FORMAT_FLOAT, 1, 0};
            rc = api.cuArray3DCreate(&a, &d);
        } else {
            CUDA_ARRAY3D_DESCRIPTOR d = {1024, 256, mib, CU_AD_FORMAT_FLOAT, 1, 0};
            rc = api.cuArray3DCreate_v2(&a, &d);
        }
        p = (uintptr_t)a;
    } else if (!strcmp(kind, "mipmap")) { /* 2 levels: MIB + MIB/4 */
        CUmipmappedArray a = NULL;
        CUDA_ARRAY3D_DESCRIPTOR d = {1024, mib * 256, 0, CU_AD_FORMAT_FLOAT, 1, 0};
        rc = api.cuMipmappedArrayCreate(&a, &d, 2);
        p = (uintptr_t)a;
    } else {
        fprintf(stderr, "unknown kind %s\n", kind);
        exit(2);
    }
    *out = p;
    return rc;
}

static CUresult do_free(const struct alloc *a)
{
    const char *k = a->kind;
    if (!strcmp(k, "mem") || !strcmp(k, "pitch") || !strcmp(k, "managed"))
        return api.cuMemFree_v2(a->handle);
    if (!strcmp(k, "mem1") || !strcmp(k, "pitch1"))
        return api.cuMemFree((CUdeviceptr_v1)a->handle);
    if (!strcmp(k, "async") || !strcmp(k, "pool"))
        return api.cuMemFreeAsync(a->handle, probe_stream);
    if (!strcmp(k, "async_ptsz") || !strcmp(k, "pool_ptsz"))
        return api.cuMemFreeAsync_ptsz(a->handle, probe_stream);
    if (!strcmp(k, "create"))
        return api.cuMemRelease(a->handle);
    if (!strcmp(k, "mipmap"))
        return api.cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)a->handle);
    return api.cuArrayDestroy((CUarray)(uintptr_t)a->handle);
}

static int remember(const char *kind, uint64_t handle)
{
    pthread_mutex_lock(&ids_lock);
    int id = nids < MAX_IDS ? nids++ : -1;
    if (id >= 0) {
        snprintf(ids[id].kind, sizeof(ids[id].kind), "%s", kind);
        ids[id].handle = handle;
    }
    pthread_mutex_unlock(&ids_lock);
    return id;
}

/* Allocates MIB chunks until refused; returns how many it got. */
static int fill(const char *kind, uint64_t mib)
{
    int n = 0;
    uint64_t h;
    while (n < MAX_IDS / 2 && do_alloc(kind, mib, &h) == CUDA_SUCCESS && remember(kind, h) >= 0)
        n++;
    return n;
}

struct fill_job {
    uint64_t mib;
    int got;
};

static void *fill_thread(void *arg)
{
    struct fill_job *job = arg;
    job->got = fill("mem", job->mib);
    return NULL;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Launches (a kernel, or a graph of `graph_us`) for `seconds`; reports the
 * last third: launches per second, and the share of the GPU they got. */
static void launch_loop(const char *op, double seconds, unsigned int graph_us)
{
    double start = now(), window = start + seconds * 2 / 3, window_at = 0;
    unsigned long long total = 0, late = 0;
    long long busy0 = 0;
    CUgraphExec graph = graph_us ? fake_cuda_graph(graph_us) : NULL;
    for (double t = start; t < start + seconds; t = now()) {
        if (t >= window && !window_at) {
            window_at = t;
            busy0 = fake_cuda_busy_ns();
        }
        if (graph)
            api.cuGraphLaunch(graph, NULL);
        else
            api.cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        total++;
        late += t >= window;
    }
    double share = window_at ? (fake_cuda_busy_ns() - busy0) / ((now() - window_at) * 1e9) : 0;
    printf("{\"op\":\"%s\",\"total\":%llu,\"late\":%llu,\"late_per_s\":%.1f,\"share\":%.3f}\n",
           op, total, late, late / (seconds / 3), share);
}

typedef int (*nvml_fn)();

/* What pynvml shows: dlopen the library, dlsym the entry points. */
static void nvml_report(void)
{
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        printf("{\"op\":\"nvml\",\"error\":\"no NVML\"}\n");
        return;
    }
    int (*init)(void) = (int (*)(void))dlsym(h, "nvmlInit_v2");
    int (*by_index)(unsigned int, void **) = (int (*)(unsigned int, void **))dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    int (*mem)(void *, unsigned long long *) = (int (*)(void *, unsigned long long *))dlsym(h, "nvmlDeviceGetMemoryInfo");
    int (*mem_default)(void *, unsigned long long *) =
        (int (*)(void *, unsigned long long *))dlsym(RTLD_DEFAULT, "nvmlDeviceGetMemoryInfo");
    int (*procs)(void *, unsigned int *, void *) = (int (*)(void *, unsigned int *, void *))dlsym(h, "nvmlDeviceGetComputeRunningProcesses_v3");
    int (*procs1)(void *, unsigned int *, void *) = (int (*)(void *, unsigned int *, void *))dlsym(h, "nvmlDeviceGetComputeRunningProcesses");
    void *dev = NULL;
    unsigned long long m[3] = {0, 0, 0}, m2[3] = {0, 0, 0};
    init();
    by_index((unsigned int)current, &dev);
    mem(dev, m);
    if (mem_default)
        mem_default(dev, m2);
    struct { unsigned int pid; unsigned long long used; unsigned int gi, ci; } list[64];
    struct { unsigned int pid; unsigned long long used; } list1[64];
    unsigned int n = 0, n1 = 64;
    int rc0 = procs(dev, &n, NULL); /* asks for the count first, as pynvml does */
    unsigned int asked = n;
    n = 64;
    procs(dev, &n, list);
    procs1(dev, &n1, list1);
    printf("{\"op\":\"nvml\",\"total\":%llu,\"free\":%llu,\"used\":%llu,\"default_total\":%llu,"
           "\"count_rc\":%d,\"count\":%u,\"pids\":[", m[0], m[1], m[2], m2[0], rc0, asked);
    for (unsigned int i = 0; i < n; i++)
        printf("%s%u", i ? "," : "", list[i].pid);
    printf("],\"pids_v1\":[");
    for (unsigned int i = 0; i < n1; i++)
        printf("%s%u", i ? "," : "", list1[i].pid);
    printf("]}\n");
}

static void forward_checks(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    CUresult (*ver)(int *) = (CUresult(*)(int *))dlsym(h, "cuDriverGetVersion");
    int v = 0;
    if (ver)
        ver(&v);
    printf("{\"op\":\"forward\",\"strlen\":%d,\"malloc_next\":%d,\"driver_version\":%d,"
           "\"missing\":%d,\"hooked_differs\":%d}\n",
           dlsym(RTLD_DEFAULT, "strlen") == (void *)&strlen, dlsym(RTLD_NEXT, "malloc") != NULL, v,
           dlsym(h, "cuNoSuchEntryPoint") != NULL,
           dlsym(h, "cuMemAlloc_v2") != dlsym(h, "cuDriverGetVersion"));
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    bind_api();
    for (int i = 1; i < argc; i++) {
        const char *op = argv[i];
        const char *a1 = i + 1 < argc ? argv[i + 1] : "0", *a2 = i + 2 < argc ? argv[i + 2] : "0";
        if (!strcmp(op, "alloc")) {
            uint64_t h;
            CUresult rc = do_alloc(a1, strtoull(a2, NULL, 10), &h);
            int id = rc == CUDA_SUCCESS ? remember(a1, h) : -1;
            printf("{\"op\":\"alloc\",\"kind\":\"%s\",\"rc\":%d,\"id\":%d}\n", a1, rc, id);
            i += 2;
        } else if (!strcmp(op, "free")) {
            printf("{\"op\":\"free\",\"rc\":%d}\n", do_free(&ids[atoi(a1)]));
            i++;
        } else if (!strcmp(op, "freeptr")) {
            printf("{\"op\":\"freeptr\",\"rc\":%d}\n", api.cuMemFree_v2(strtoull(a1, NULL, 16)));
            i++;
        } else if (!strcmp(op, "fill")) {
            printf("{\"op\":\"fill\",\"chunks\":%d}\n", fill(a1, strtoull(a2, NULL, 10)));
            i += 2;
        } else if (!strcmp(op, "threads")) {
            int n = atoi(a1), chunks = 0;
            pthread_t t[64];
            struct fill_job jobs[64];
            for (int j = 0; j < n && j < 64; j++) {
                jobs[j] = (struct fill_job){strtoull(a2, NULL, 10), 0};
                pthread_create(&t[j], NULL, fill_thread, &jobs[j]);
            }
            for (int j = 0; j < n && j < 64; j++) {
                pthread_join(t[j], NULL);
                chunks += jobs[j].got;
            }
            printf("{\"op\":\"threads\",\"chunks\":%d,\"driver_bytes\":%llu}\n", chunks,
                   fake_cuda_used_bytes(0));
            for (int j = 0; j < nids; j++)
                do_free(&ids[j]);
            nids = 0;
            i += 2;
        } else if (!strcmp(op, "info") || !strcmp(op, "info1")) {
            size_t f = 0, t = 0;
            unsigned int f1 = 0, t1 = 0;
            CUresult rc = op[4] ? api.cuMemGetInfo(&f1, &t1) : api.cuMemGetInfo_v2(&f, &t);
            if (op[4])
                f = f1, t = t1;
            printf("{\"op\":\"%s\",\"rc\":%d,\"free\":%zu,\"total\":%zu}\n", op, rc, f, t);
        } else if (!strcmp(op, "total") || !strcmp(op, "total1")) {
            size_t b = 0;
            unsigned int b1 = 0;
            CUresult rc = op[5] ? api.cuDeviceTotalMem(&b1, 0) : api.cuDeviceTotalMem_v2(&b, 0);
            printf("{\"op\":\"%s\",\"rc\":%d,\"bytes\":%zu}\n", op, rc, op[5] ? (size_t)b1 : b);
        } else if (!strcmp(op, "dev")) {
            current = atoi(a1);
            ctx_set_current((CUcontext)(uintptr_t)(atoi(a1) + 1));
            i++;
        } else if (!strcmp(op, "launch")) {
            launch_loop(op, atof(a1), 0);
            i++;
        } else if (!strcmp(op, "graph")) {
            launch_loop(op, atof(a1), (unsigned int)atoi(a2));
            i += 2;
        } else if (!strcmp(op, "ctx")) {
            CUcontext ctx;
            current = atoi(a1);
            printf("{\"op\":\"ctx\",\"rc\":%d}\n", api.cuDevicePrimaryCtxRetain(&ctx, current));
            ctx_set_current(ctx);
            i++;
        } else if (!strcmp(op, "stream")) {
            int keep = current;
            ctx_set_current((CUcontext)(uintptr_t)(atoi(a1) + 1));
            stream_create(&probe_stream, 0);
            ctx_set_current((CUcontext)(uintptr_t)(keep + 1));
            i++;
        } else if (!strcmp(op, "poolkeep")) {
            CUmemoryPool pool = NULL;
            long long mib = atoll(a1);
            cuuint64_t keep = mib < 0 ? ~0ull : (cuuint64_t)mib * MIB;
            device_get_mem_pool(&pool, current);
            pool_set_attribute(pool, 4 /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */, &keep);
            i++;
        } else if (!strcmp(op, "poolcreate")) {
            CUmemPoolProps props = {.allocType = 1, .location = {CU_MEM_LOCATION_TYPE_DEVICE, atoi(a1)}};
            printf("{\"op\":\"poolcreate\",\"rc\":%d}\n", api.cuMemPoolCreate(&probe_pool, &props));
            i++;
        } else if (!strcmp(op, "forksleep")) {
            if (fork() == 0) { /* a child that outlives its parent, CUDA untouched */
                close(STDOUT_FILENO);
                close(STDERR_FILENO);
                usleep((useconds_t)atoi(a1) * 1000);
                _exit(0);
            }
            i++;
        } else if (!strcmp(op, "sync")) {
            printf("{\"op\":\"sync\",\"rc\":%d}\n", ctx_synchronize());
        } else if (!strcmp(op, "vmm")) {
            uint64_t bytes = strtoull(a1, NULL, 10) * MIB;
            CUmemAllocationProp prop = {.type = 1, .location = {CU_MEM_LOCATION_TYPE_DEVICE, current}};
            CUmemGenericAllocationHandle h = 0;
            CUdeviceptr va = 0;
            CUresult rc = api.cuMemCreate(&h, bytes, &prop, 0);
            if (rc == CUDA_SUCCESS) {
                address_reserve(&va, bytes, 0, 0, 0);
                rc = api.cuMemMap(va, bytes, 0, h, 0);
                if (rc == CUDA_SUCCESS)
                    rc = api.cuMemRelease(h); /* still mapped: its memory stays */
            }
            int id = rc == CUDA_SUCCESS ? remember("vmm", va) : -1;
            if (id >= 0)
                ids[id].handle = va, snprintf(ids[id].kind, sizeof(ids[id].kind), "%llu",
                                              (unsigned long long)bytes);
            printf("{\"op\":\"vmm\",\"rc\":%d,\"id\":%d}\n", rc, id);
            i++;
        } else if (!strcmp(op, "unmap")) {
            struct alloc *a = &ids[atoi(a1)];
            printf("{\"op\":\"unmap\",\"rc\":%d}\n",
                   api.cuMemUnmap(a->handle, strtoull(a->kind, NULL, 10)));
            i++;
        } else if (!strcmp(op, "procnew") || !strcmp(op, "procinfo")) {
            void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
            cuGetProcAddress_fn gpa = (cuGetProcAddress_fn)dlsym(h, "cuGetProcAddress");
            void *fn = NULL;
            if (op[4] == 'n') {
                CUdeviceptr p = 0;
                CUresult rc = gpa("cuMemAlloc", &fn, 14000, 0);
                if (rc == CUDA_SUCCESS)
                    rc = ((CUresult(*)(CUdeviceptr *, size_t, unsigned long long))fn)(&p, MIB, 0xabc);
                printf("{\"op\":\"procnew\",\"rc\":%d,\"v3_flags\":%llu}\n", rc,
                       fake_cuda_v3_flags());
            } else {
                size_t f = 0, t = 0;
                CUresult rc = gpa("cuMemGetInfo", &fn, atoi(a1), 0);
                if (rc == CUDA_SUCCESS)
                    rc = ((CUresult(*)(size_t *, size_t *))fn)(&f, &t);
                printf("{\"op\":\"procinfo\",\"rc\":%d,\"total\":%zu}\n", rc, t);
                i++;
            }
        } else if (!strcmp(op, "driver")) {
            printf("{\"op\":\"driver\",\"bytes\":%llu}\n", fake_cuda_used_bytes(current));
        } else if (!strcmp(op, "nvml")) {
            nvml_report();
        } else if (!strcmp(op, "closeother")) {
            char path[4096];
            snprintf(path, sizeof(path), "%s/vgpu.shm", getenv("VGPU_SHARED_DIR"));
            int fd = open(path, O_RDONLY);
            if (fd >= 0)
                close(fd);
            printf("{\"op\":\"closeother\",\"opened\":%d}\n", fd >= 0);
        } else if (!strcmp(op, "launchall")) {
            int rcs = api.cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) |
                      api.cuLaunchKernel_ptsz(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) |
                      api.cuLaunchKernelEx(NULL, NULL, NULL, NULL) |
                      api.cuLaunchKernelEx_ptsz(NULL, NULL, NULL, NULL) |
                      api.cuLaunchCooperativeKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL) |
                      api.cuLaunchCooperativeKernel_ptsz(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL) |
                      api.cuGraphLaunch(NULL, NULL) | api.cuGraphLaunch_ptsz(NULL, NULL) |
                      api.cuLaunch(NULL) | api.cuLaunchGrid(NULL, 1, 1) |
                      api.cuLaunchGridAsync(NULL, 1, 1, NULL);
            printf("{\"op\":\"launchall\",\"rc\":%d}\n", rcs);
        } else if (!strcmp(op, "next")) {
            printf("{\"op\":\"next\",\"value\":%d}\n", next_value());
        } else if (!strcmp(op, "forward")) {
            forward_checks();
        } else if (!strcmp(op, "forkchild")) {
            pid_t child = fork();
            if (child == 0) {
                uint64_t h;
                printf("{\"op\":\"child\",\"rc\":%d}\n", do_alloc("mem", strtoull(a1, NULL, 10), &h));
                _exit(0);
            }
            waitpid(child, NULL, 0);
            i++;
        } else if (!strcmp(op, "ready")) {
            printf("{\"op\":\"ready\",\"pid\":%d}\n", getpid());
        } else if (!strcmp(op, "wait")) {
            char line[64];
            if (!fgets(line, sizeof(line), stdin))
                line[0] = 0;
        } else if (!strcmp(op, "sleep")) {
            usleep((useconds_t)atoi(a1) * 1000);
            i++;
        } else {
            fprintf(stderr, "unknown op %s\n", op);
            return 2;
        }
    }
    return 0;
}
