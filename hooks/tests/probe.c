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
 *   launchall        each launch entry point once
 *   next | forward   dlsym forwarding checks
 *   forkchild MIB    a forked child allocates MIB, reports, exits without freeing
 *   ready | wait | sleep MS   synchronisation with the test
 */
#define _GNU_SOURCE
#include <dlfcn.h>
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

#define DECL(sym, base, since, ptsz, params) CUresult sym params;
VGPU_HOOK_LIST(DECL)
int next_value(void);
/* Not hooked; looked up in the driver so that a probe built without
 * -lcuda (PROBE_NO_LINK: it can only dlopen the driver, RTLD_LOCAL, as the
 * CUDA runtime does) works the same. */
static CUresult (*ctx_set_current)(CUcontext);
static unsigned long long (*fake_cuda_used_bytes)(int dev);

#define FIELD(sym, base, since, ptsz, params) sym##_fn sym;
static struct {
    VGPU_HOOK_LIST(FIELD)
} api;

#define NAME_ENTRY(sym, base, since, ptsz, params) {#sym, #base, since, ptsz},
static const struct vgpu_proc_name names[] = {VGPU_HOOK_LIST(NAME_ENTRY)};

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
    if (!path || strcmp(path, "direct") == 0) {
#ifdef PROBE_NO_LINK
        fprintf(stderr, "built without -lcuda: no direct calls\n");
        exit(3);
#else
#define DIRECT(sym, base, since, ptsz, params) api.sym = sym;
        VGPU_HOOK_LIST(DIRECT)
        return;
#endif
    }
    void **slots = (void **)&api;
    if (strcmp(path, "dlsym") == 0) {
        for (int i = 0; i < VGPU_HOOK_COUNT; i++)
            slots[i] = dlsym(h, names[i].symbol);
        return;
    }
    int v2 = strcmp(path, "proc2") == 0;
    cuGetProcAddress_fn gpa = (cuGetProcAddress_fn)dlsym(h, "cuGetProcAddress");
    cuGetProcAddress_v2_fn gpa2 = (cuGetProcAddress_v2_fn)dlsym(h, "cuGetProcAddress_v2");
    for (int i = 0; i < VGPU_HOOK_COUNT; i++) {
        /* Ask as a runtime would: base name, a version, per-thread flag. */
        int legacy = names[i].since == 0 && strcmp(names[i].symbol, names[i].base) == 0 &&
                     vgpu_proc_pick(names, VGPU_HOOK_COUNT, names[i].base, 12000, 0) != i;
        int version = legacy ? 3000 : names[i].since ? names[i].since : 12000;
        cuuint64_t flags = names[i].ptsz ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0;
        CUdriverProcAddressQueryResult status;
        CUresult rc = v2 ? gpa2(names[i].base, &slots[i], version, flags, &status)
                         : gpa(names[i].base, &slots[i], version, flags);
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
        rc = api.cuMemAllocAsync(&p, bytes, NULL);
    } else if (!strcmp(kind, "async_ptsz")) {
        rc = api.cuMemAllocAsync_ptsz(&p, bytes, NULL);
    } else if (!strcmp(kind, "pool")) {
        rc = api.cuMemAllocFromPoolAsync(&p, bytes, NULL, NULL);
    } else if (!strcmp(kind, "pool_ptsz")) {
        rc = api.cuMemAllocFromPoolAsync_ptsz(&p, bytes, NULL, NULL);
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
        return api.cuMemFreeAsync(a->handle, NULL);
    if (!strcmp(k, "async_ptsz") || !strcmp(k, "pool_ptsz"))
        return api.cuMemFreeAsync_ptsz(a->handle, NULL);
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

static void launch_loop(double seconds)
{
    double start = now(), window = start + seconds * 2 / 3;
    unsigned long long total = 0, late = 0;
    for (double t = start; t < start + seconds; t = now()) {
        api.cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        total++;
        late += t >= window;
    }
    printf("{\"op\":\"launch\",\"total\":%llu,\"late\":%llu,\"late_per_s\":%.1f}\n", total, late,
           late / (seconds / 3));
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
            ctx_set_current((CUcontext)(uintptr_t)(atoi(a1) + 1));
            i++;
        } else if (!strcmp(op, "launch")) {
            launch_loop(atof(a1));
            i++;
        } else if (!strcmp(op, "launchall")) {
            int rcs = api.cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) |
                      api.cuLaunchKernel_ptsz(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) |
                      api.cuLaunchKernelEx(NULL, NULL, NULL, NULL) |
                      api.cuLaunchKernelEx_ptsz(NULL, NULL, NULL, NULL) |
                      api.cuLaunchCooperativeKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL) |
                      api.cuLaunchCooperativeKernel_ptsz(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL) |
                      api.cuGraphLaunch(NULL, NULL) | api.cuGraphLaunch_ptsz(NULL, NULL);
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
