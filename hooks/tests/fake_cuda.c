/*
 * A stand-in libcuda.so.1 for tests: the hooked entry points with
 * bookkeeping only (fake device memory, 80 GiB per device unless
 * FAKE_CUDA_TOTAL_MIB says otherwise).  Built with -Bsymbolic-functions like
 * the real driver, so its own cuGetProcAddress hands out its own functions
 * and internal calls never reach an interposer.
 *   FAKE_CUDA_LAUNCH_US  busy time of each kernel launch (default 0)
 *   FAKE_CUDA_PROC_ALIAS cuGetProcAddress("cuMemAlloc") returns an internal
 *                        alias, not the exported symbol (like a driver may)
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../alloc_map.h"
#include "../vgpu_hooks.h"

#define MAX_DEV 16
#define FAKE_VERSION 12040

#define DECL(sym, base, since, ptsz, params) CUresult sym params;
VGPU_HOOK_LIST(DECL)

static struct vgpu_map blocks = VGPU_MAP_INITIALIZER;
static uint64_t used[MAX_DEV];
static uint64_t next_address = 0x700000000000ull;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int current_dev;

static uint64_t total_bytes(void)
{
    const char *s = getenv("FAKE_CUDA_TOTAL_MIB");
    return (s ? strtoull(s, NULL, 10) : 80 * 1024ull) << 20;
}

/* Outside the CUDA namespace: what the fake device really holds. */
unsigned long long fake_cuda_used_bytes(int dev)
{
    return __atomic_load_n(&used[dev], __ATOMIC_SEQ_CST);
}

static CUresult take(int kind, uint64_t bytes, int dev, unsigned long long *out)
{
    struct vgpu_map_entry old;
    if (bytes == 0 || !out)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    if (used[dev] + bytes > total_bytes()) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    used[dev] += bytes;
    *out = next_address;
    next_address += (bytes + 255) & ~255ull;
    pthread_mutex_unlock(&lock);
    struct vgpu_map_entry e = {.key = *out, .size = bytes, .dev = dev, .kind = (uint8_t)kind};
    vgpu_map_put(&blocks, e, &old);
    return CUDA_SUCCESS;
}

static CUresult give(int kind, uint64_t key)
{
    struct vgpu_map_entry e;
    if (!vgpu_map_take(&blocks, kind, key, &e))
        return CUDA_ERROR_INVALID_VALUE;
    __atomic_fetch_sub(&used[e.dev], e.size, __ATOMIC_SEQ_CST);
    return CUDA_SUCCESS;
}

static CUresult take_ptr(uint64_t bytes, CUdeviceptr *out)
{
    return take(VGPU_KEY_PTR, bytes, current_dev, out);
}

/* ---- non-hooked entry points ---- */
CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int *v) { *v = FAKE_VERSION; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *n) { *n = 2; return CUDA_SUCCESS; }
CUresult cuCtxGetDevice(CUdevice *d) { *d = current_dev; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext c)
{
    current_dev = c ? (int)((uintptr_t)c - 1) % MAX_DEV : 0;
    return CUDA_SUCCESS;
}

/* ---- allocations ---- */
CUresult cuMemAlloc(CUdeviceptr_v1 *p, unsigned int n)
{
    CUdeviceptr v = 0;
    CUresult rc = take(VGPU_KEY_PTR, n, current_dev, &v);
    *p = (CUdeviceptr_v1)(v >> 12); /* a 32-bit value that stays unique */
    if (rc == CUDA_SUCCESS) {
        struct vgpu_map_entry e, old;
        vgpu_map_take(&blocks, VGPU_KEY_PTR, v, &e);
        e.key = *p;
        vgpu_map_put(&blocks, e, &old);
    }
    return rc;
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return take_ptr(n, p); }
CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned int f) { (void)f; return take_ptr(n, p); }
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) { (void)s; return take_ptr(n, p); }
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { return cuMemAllocAsync(p, n, s); }
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)
{
    (void)pool;
    (void)s;
    return take_ptr(n, p);
}
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)
{
    return cuMemAllocFromPoolAsync(p, n, pool, s);
}

static size_t pitch_of(size_t width) { return (width + 1023) & ~(size_t)1023; }

CUresult cuMemAllocPitch(CUdeviceptr_v1 *p, unsigned int *pitch, unsigned int w, unsigned int h,
                         unsigned int elem)
{
    (void)elem;
    *pitch = (unsigned int)pitch_of(w);
    return cuMemAlloc(p, *pitch * h);
}
CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned int elem)
{
    (void)elem;
    *pitch = pitch_of(w);
    return take_ptr(*pitch * h, p);
}
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop,
                     unsigned long long flags)
{
    (void)flags;
    return take(VGPU_KEY_HANDLE, n, prop ? prop->location.id % MAX_DEV : 0, h);
}

/* Arrays: the fake charges width*height*depth*4*channels. */
static CUresult take_array(int kind, uint64_t w, uint64_t h, uint64_t d, unsigned int ch, void *out)
{
    unsigned long long v = 0;
    CUresult rc = take(kind, (w ? w : 1) * (h ? h : 1) * (d ? d : 1) * 4 * (ch ? ch : 1),
                       current_dev, &v);
    memcpy(out, &(void *){(void *)(uintptr_t)v}, sizeof(void *));
    return rc;
}
CUresult cuArrayCreate(CUarray *a, const CUDA_ARRAY_DESCRIPTOR_v1 *d)
{
    return take_array(VGPU_KEY_ARRAY, d->Width, d->Height, 0, d->NumChannels, a);
}
CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d)
{
    return take_array(VGPU_KEY_ARRAY, d->Width, d->Height, 0, d->NumChannels, a);
}
CUresult cuArray3DCreate(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)
{
    return take_array(VGPU_KEY_ARRAY, d->Width, d->Height, d->Depth, d->NumChannels, a);
}
CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    return take_array(VGPU_KEY_ARRAY, d->Width, d->Height, d->Depth, d->NumChannels, a);
}
CUresult cuMipmappedArrayCreate(CUmipmappedArray *a, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                unsigned int levels)
{
    (void)levels; /* level 0 only: the fake's own figure need not match the hook's */
    return take_array(VGPU_KEY_MIPMAP, d->Width, d->Height, d->Depth, d->NumChannels, a);
}

/* ---- frees ---- */
CUresult cuMemFree(CUdeviceptr_v1 p) { return give(VGPU_KEY_PTR, p); }
CUresult cuMemFree_v2(CUdeviceptr p) { return give(VGPU_KEY_PTR, p); }
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { (void)s; return give(VGPU_KEY_PTR, p); }
CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return cuMemFreeAsync(p, s); }
CUresult cuMemRelease(CUmemGenericAllocationHandle h) { return give(VGPU_KEY_HANDLE, h); }
CUresult cuArrayDestroy(CUarray a) { return give(VGPU_KEY_ARRAY, (uintptr_t)a); }
CUresult cuMipmappedArrayDestroy(CUmipmappedArray a) { return give(VGPU_KEY_MIPMAP, (uintptr_t)a); }

/* ---- information ---- */
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    if (!free_bytes || !total)
        return CUDA_ERROR_INVALID_VALUE;
    *total = total_bytes();
    *free_bytes = *total - fake_cuda_used_bytes(current_dev);
    return CUDA_SUCCESS;
}
CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total)
{
    size_t f, t;
    cuMemGetInfo_v2(&f, &t);
    *free_bytes = f > 0xffffffffu ? 0xffffffffu : (unsigned int)f;
    *total = t > 0xffffffffu ? 0xffffffffu : (unsigned int)t;
    return CUDA_SUCCESS;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    (void)dev;
    *bytes = total_bytes();
    return CUDA_SUCCESS;
}
CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    (void)dev;
    *bytes = total_bytes() > 0xffffffffu ? 0xffffffffu : (unsigned int)total_bytes();
    return CUDA_SUCCESS;
}

/* ---- launches ---- */
static unsigned long long launched;

static CUresult run_kernel(void)
{
    static long us = -1;
    if (us < 0) {
        const char *s = getenv("FAKE_CUDA_LAUNCH_US");
        us = s ? atol(s) : 0;
    }
    if (us > 0) { /* the "kernel" keeps the launching thread busy */
        struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        do
            clock_gettime(CLOCK_MONOTONIC, &t);
        while ((t.tv_sec - t0.tv_sec) * 1000000l + (t.tv_nsec - t0.tv_nsec) / 1000 < us);
    }
    __atomic_fetch_add(&launched, 1, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

#define LAUNCH_ARGS                                                                              \
    CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,            \
        unsigned int by, unsigned int bz, unsigned int shmem, CUstream s
#define UNUSED_LAUNCH_ARGS (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)s

CUresult cuLaunchKernel(LAUNCH_ARGS, void **params, void **extra)
{
    UNUSED_LAUNCH_ARGS, (void)params, (void)extra;
    return run_kernel();
}
CUresult cuLaunchKernel_ptsz(LAUNCH_ARGS, void **params, void **extra)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
}
CUresult cuLaunchCooperativeKernel(LAUNCH_ARGS, void **params)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, NULL);
}
CUresult cuLaunchCooperativeKernel_ptsz(LAUNCH_ARGS, void **params)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, NULL);
}
CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra)
{
    (void)c, (void)f, (void)params, (void)extra;
    return run_kernel();
}
CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **params, void **extra)
{
    return cuLaunchKernelEx(c, f, params, extra);
}
CUresult cuGraphLaunch(CUgraphExec g, CUstream s) { (void)g, (void)s; return run_kernel(); }
CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) { return cuGraphLaunch(g, s); }

unsigned long long fake_cuda_launches(void) { return __atomic_load_n(&launched, __ATOMIC_RELAXED); }

/* ---- cuGetProcAddress ---- */
#define NAME_ENTRY(sym, base, since, ptsz, params) {#sym, #base, since, ptsz},
static const struct vgpu_proc_name names[] = {VGPU_HOOK_LIST(NAME_ENTRY)};
#define FN_ENTRY(sym, base, since, ptsz, params) (void *)&sym,
static void *const functions[] = {VGPU_HOOK_LIST(FN_ENTRY)};

static const struct {
    const char *name;
    void *fn;
} others[] = {
    {"cuInit", (void *)&cuInit},
    {"cuDriverGetVersion", (void *)&cuDriverGetVersion},
    {"cuDeviceGetCount", (void *)&cuDeviceGetCount},
    {"cuCtxGetDevice", (void *)&cuCtxGetDevice},
    {"cuCtxSetCurrent", (void *)&cuCtxSetCurrent},
};

static CUresult alias_cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return take_ptr(n, p); }

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *status)
{
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    int i = vgpu_proc_pick(names, VGPU_HOOK_COUNT, symbol, version, flags);
    if (i >= 0)
        *pfn = functions[i];
    for (size_t j = 0; !*pfn && j < sizeof(others) / sizeof(others[0]); j++)
        if (strcmp(others[j].name, symbol) == 0)
            *pfn = others[j].fn;
    if (*pfn == (void *)&cuMemAlloc_v2 && getenv("FAKE_CUDA_PROC_ALIAS"))
        *pfn = (void *)&alias_cuMemAlloc_v2;
    if (status)
        *status = *pfn ? 0 : 1; /* CU_GET_PROC_ADDRESS_SUCCESS / SYMBOL_NOT_FOUND */
    return *pfn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
