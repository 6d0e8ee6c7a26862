/*
 * A stand-in libcuda.so.1 for tests: the driver entry points the hook
 * touches, with bookkeeping only (fake device memory, 80 GiB per card unless
 * FAKE_CUDA_TOTAL_MIB says otherwise; kernels on the timeline of fake_gpu.h).
 * Built with -Bsymbolic-functions like the real driver, so its own
 * cuGetProcAddress hands out its own functions and internal calls never
 * reach an interposer.  Its cuGetProcAddress table is its own, written from
 * the CUDA headers' PFN_<name>_v<version> list, never the hook's.
 *   FAKE_CUDA_DEVICES       ordinal -> card, e.g. "1" (as CUDA_VISIBLE_DEVICES)
 *   FAKE_CUDA_LAUNCH_US     GPU time of each kernel (default 0: none)
 *   FAKE_CUDA_CTX_OVERHEAD_MIB  memory a context takes on its card
 *   FAKE_CTX_BARRIER        see fake_gpu.h
 *   FAKE_CUDA_PROC_ALIAS    cuGetProcAddress returns internal aliases, not the
 *                           exported symbols (as a driver may)
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../alloc_map.h"
#include "../cuda_types.h"
#include "fake_gpu.h"

#define MAX_DEV 16
#define FAKE_VERSION 12040
#define QUEUE_NS 1000000ll /* a launch returns while its stream's queue is under 1 ms */
#define POOL_CHUNK (2ull << 20)
#define MAX_POOL_BLOCKS 1024
#define MAX_HANDLES 4096

static struct vgpu_map blocks = VGPU_MAP_INITIALIZER;
static uint64_t next_address = 0x700000000000ull;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int current_dev;
static __thread int pushed[8], npushed;

static uint64_t total_bytes(void)
{
    const char *s = getenv("FAKE_CUDA_TOTAL_MIB");
    return (s ? strtoull(s, NULL, 10) : 80 * 1024ull) << 20;
}

/* The card behind a device ordinal. */
static int card_of(int ordinal)
{
    const char *map = getenv("FAKE_CUDA_DEVICES");
    if (!map || !*map)
        return ordinal % MAX_DEV;
    for (int i = 0; *map; i++) {
        if (i == ordinal)
            return atoi(map) % MAX_DEV;
        map = strchr(map, ',');
        if (!map)
            break;
        map++;
    }
    return ordinal % MAX_DEV;
}

/* Device memory this process holds on a card (changes under the fake's lock). */
static void card_add(int card, int64_t delta)
{
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    struct fake_proc *p = fake_me(g);
    p->used[card] += (uint64_t)delta;
    fake_unlock(g);
}

static uint64_t card_used(int card)
{
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    uint64_t used = fake_me(g)->used[card];
    fake_unlock(g);
    return used;
}

/* Outside the CUDA namespace: what the fake device really holds. */
unsigned long long fake_cuda_used_bytes(int ordinal)
{
    return card_used(card_of(ordinal));
}

static CUresult take(int kind, uint64_t bytes, int ordinal, unsigned long long *out)
{
    struct vgpu_map_entry old;
    if (bytes == 0 || !out)
        return CUDA_ERROR_INVALID_VALUE;
    int card = card_of(ordinal);
    pthread_mutex_lock(&lock);
    if (card_used(card) + bytes > total_bytes()) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    card_add(card, (int64_t)bytes);
    *out = next_address;
    next_address += (bytes + 255) & ~255ull;
    pthread_mutex_unlock(&lock);
    struct vgpu_map_entry e = {.key = *out, .size = bytes, .dev = card, .kind = (uint8_t)kind};
    vgpu_map_put(&blocks, e, &old);
    return CUDA_SUCCESS;
}

static CUresult give(int kind, uint64_t key)
{
    struct vgpu_map_entry e;
    if (!vgpu_map_take(&blocks, kind, key, &e))
        return CUDA_ERROR_INVALID_VALUE;
    card_add(e.dev, -(int64_t)e.size);
    return CUDA_SUCCESS;
}

static CUresult take_ptr(uint64_t bytes, CUdeviceptr *out)
{
    return take(VGPU_KEY_PTR, bytes, current_dev, out);
}

/* ---- devices, contexts, streams ---- */
/* A new process image has no contexts: a dead process's record under this
 * (recycled) pid is freed before anyone lists the card again.  Read without the
 * card lock; only a hit takes it. */
CUresult cuInit(unsigned int flags)
{
    (void)flags;
    struct fake_gpu *g = fake_gpu();
    int32_t pid = getpid();
    for (int i = 0; i < FAKE_MAX_PROCS && !fake_mine; i++)
        if (__atomic_load_n(&g->procs[i].pid, __ATOMIC_RELAXED) == pid) {
            fake_lock(g);
            if (!fake_mine && g->procs[i].pid == pid)
                g->procs[i].pid = 0;
            fake_unlock(g);
        }
    return CUDA_SUCCESS;
}
CUresult cuDriverGetVersion(int *v) { *v = FAKE_VERSION; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *n) { *n = FAKE_CARDS; return CUDA_SUCCESS; }
CUresult cuCtxGetDevice(CUdevice *d) { *d = current_dev; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext c)
{
    current_dev = c ? (int)((uintptr_t)c - 1) % MAX_DEV : 0;
    return CUDA_SUCCESS;
}
CUresult cuCtxPushCurrent_v2(CUcontext c)
{
    if (npushed >= 8)
        return CUDA_ERROR_INVALID_VALUE;
    pushed[npushed++] = current_dev;
    return cuCtxSetCurrent(c);
}
CUresult cuCtxPopCurrent_v2(CUcontext *c)
{
    if (npushed == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (c)
        *c = (CUcontext)(uintptr_t)(current_dev + 1);
    current_dev = pushed[--npushed];
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d)
{
    if (!u || d < 0 || d >= FAKE_CARDS)
        return CUDA_ERROR_INVALID_VALUE;
    fake_uuid_bytes(card_of(d), (unsigned char *)u->bytes);
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) { return cuDeviceGetUuid(u, d); }

/* Live processes with a context on `card`. */
static int holders(struct fake_gpu *g, int card)
{
    int n = 0;
    fake_lock(g);
    for (int i = 0; i < FAKE_MAX_PROCS; i++)
        n += fake_alive(g->procs[i].pid) && (g->procs[i].ctx_mask & (1u << card));
    fake_unlock(g);
    return n;
}

/* FAKE_CTX_BARRIER=N: wait (10 s at most) until N processes have entered
 * context creation (`arrivals`), or hold a context on `card`. */
static void ctx_barrier(struct fake_gpu *g, int card, int arrivals)
{
    const char *env = getenv("FAKE_CTX_BARRIER");
    int want = env ? atoi(env) : 0;
    if (want <= 1)
        return;
    for (int64_t until = fake_now() + 10000000000ll; fake_now() < until;) {
        int n = arrivals ? (int)__atomic_load_n(&g->ctx_arrived, __ATOMIC_ACQUIRE)
                         : holders(g, card);
        if (n >= want)
            return;
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
}

/* A context registers the process on its card (what NVML then lists) and
 * takes FAKE_CUDA_CTX_OVERHEAD_MIB there.  Under FAKE_CTX_BARRIER every
 * process enters (after the hook's "before" look at NVML) before any
 * registers, and none returns (to the hook's "after" look) before all have. */
static CUresult new_context(CUcontext *pctx, CUdevice d)
{
    if (!pctx || d < 0 || d >= FAKE_CARDS)
        return CUDA_ERROR_INVALID_VALUE;
    int card = card_of(d);
    const char *mib = getenv("FAKE_CUDA_CTX_OVERHEAD_MIB");
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    struct fake_proc *p = fake_me(g);
    int fresh = !(p->ctx_mask & (1u << card));
    fake_unlock(g);
    if (fresh) {
        __atomic_fetch_add(&g->ctx_arrived, 1, __ATOMIC_ACQ_REL);
        ctx_barrier(g, card, 1);
    }
    fake_lock(g);
    if (!(p->ctx_mask & (1u << card))) {
        p->ctx_mask |= 1u << card;
        p->used[card] += (mib ? strtoull(mib, NULL, 10) : 0) << 20;
    }
    fake_unlock(g);
    if (fresh)
        ctx_barrier(g, card, 0);
    *pctx = (CUcontext)(uintptr_t)(d + 1);
    current_dev = d;
    return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice d) { return new_context(pctx, d); }
CUresult cuCtxCreate(CUcontext *pctx, unsigned int f, CUdevice d) { (void)f; return new_context(pctx, d); }
CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int f, CUdevice d) { (void)f; return new_context(pctx, d); }
CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *a, int n, unsigned int f, CUdevice d)
{
    (void)a, (void)n, (void)f;
    return new_context(pctx, d);
}
CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *a, unsigned int f, CUdevice d)
{
    (void)a, (void)f;
    return new_context(pctx, d);
}

struct fake_stream {
    int ordinal;
};
CUresult cuStreamCreate(CUstream *s, unsigned int flags)
{
    (void)flags;
    struct fake_stream *fs = malloc(sizeof(*fs));
    fs->ordinal = current_dev;
    *s = (CUstream)fs;
    return CUDA_SUCCESS;
}
static int stream_ordinal(CUstream s)
{
    return (uintptr_t)s <= 2 ? current_dev : ((struct fake_stream *)s)->ordinal;
}
CUresult cuStreamGetCtx(CUstream s, CUcontext *c)
{
    *c = (CUcontext)(uintptr_t)(stream_ordinal(s) + 1);
    return CUDA_SUCCESS;
}
CUresult cuStreamDestroy_v2(CUstream s) { free(s); return CUDA_SUCCESS; }

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
static unsigned long long v3_flags_seen;
/* A future ABI of "cuMemAlloc" (cuGetProcAddress version 14000 and up). */
static CUresult fake_cuMemAlloc_v3(CUdeviceptr *p, size_t n, unsigned long long flags)
{
    v3_flags_seen = flags;
    return take_ptr(n, p);
}
unsigned long long fake_cuda_v3_flags(void) { return v3_flags_seen; }
CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned int f) { (void)f; return take_ptr(n, p); }

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

/* ---- stream-ordered pools: freed blocks stay reserved and are reused only
 * by an allocation of the same size (as fragmentation does); a synchronize
 * releases free blocks above the release threshold. ---- */
struct fake_pool {
    int ordinal;
    uint64_t reserved, used, threshold;
    uint64_t free_blocks[MAX_POOL_BLOCKS];
    int nfree;
};
static struct fake_pool default_pools[MAX_DEV], *current_pools[MAX_DEV];

static struct fake_pool *device_pool(int ordinal)
{
    if (!current_pools[ordinal]) {
        default_pools[ordinal].ordinal = ordinal;
        current_pools[ordinal] = &default_pools[ordinal];
    }
    return current_pools[ordinal];
}

static void pool_release(struct fake_pool *p, uint64_t keep)
{
    while (p->reserved > keep && p->nfree > 0) {
        uint64_t b = p->free_blocks[--p->nfree];
        p->reserved -= b;
        card_add(card_of(p->ordinal), -(int64_t)b);
    }
}

static CUresult pool_alloc(struct fake_pool *p, CUdeviceptr *out, size_t n)
{
    struct vgpu_map_entry e, old;
    if (!out || n == 0)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t size = (n + POOL_CHUNK - 1) / POOL_CHUNK * POOL_CHUNK;
    pthread_mutex_lock(&lock);
    int reused = 0;
    for (int i = 0; i < p->nfree && !reused; i++)
        if (p->free_blocks[i] == size) {
            p->free_blocks[i] = p->free_blocks[--p->nfree];
            reused = 1;
        }
    if (!reused) {
        int card = card_of(p->ordinal);
        if (card_used(card) + size > total_bytes()) {
            pthread_mutex_unlock(&lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        p->reserved += size;
        card_add(card, (int64_t)size);
    }
    p->used += size;
    *out = next_address;
    next_address += size;
    pthread_mutex_unlock(&lock);
    e = (struct vgpu_map_entry){.key = *out, .size = size, .aux = (uintptr_t)p, .kind = 9};
    vgpu_map_put(&blocks, e, &old);
    return CUDA_SUCCESS;
}

static CUresult pool_free(CUdeviceptr ptr)
{
    struct vgpu_map_entry e;
    if (!vgpu_map_take(&blocks, 9, ptr, &e))
        return give(VGPU_KEY_PTR, ptr); /* cuMemFreeAsync of a cuMemAlloc pointer */
    struct fake_pool *p = (struct fake_pool *)(uintptr_t)e.aux;
    pthread_mutex_lock(&lock);
    p->used -= e.size;
    if (p->nfree < MAX_POOL_BLOCKS)
        p->free_blocks[p->nfree++] = e.size;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice d)
{
    *pool = (CUmemoryPool)device_pool(d);
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice d)
{
    device_pool(d);
    *pool = (CUmemoryPool)&default_pools[d];
    return CUDA_SUCCESS;
}
CUresult cuDeviceSetMemPool(CUdevice d, CUmemoryPool pool)
{
    current_pools[d] = (struct fake_pool *)pool;
    return CUDA_SUCCESS;
}
CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    struct fake_pool *p = calloc(1, sizeof(*p));
    p->ordinal = props ? props->location.id : 0;
    *pool = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}
CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    struct fake_pool *p = (struct fake_pool *)pool;
    pool_release(p, 0);
    card_add(card_of(p->ordinal), -(int64_t)p->reserved); /* live blocks go too */
    free(p);
    return CUDA_SUCCESS;
}
CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value)
{
    if (attr != CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
        return CUDA_ERROR_INVALID_VALUE;
    ((struct fake_pool *)pool)->threshold = *(cuuint64_t *)value;
    return CUDA_SUCCESS;
}
CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value)
{
    struct fake_pool *p = (struct fake_pool *)pool;
    cuuint64_t v;
    if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
        v = p->reserved;
    else if (attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
        v = p->used;
    else if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
        v = p->threshold;
    else
        return CUDA_ERROR_INVALID_VALUE;
    *(cuuint64_t *)value = v;
    return CUDA_SUCCESS;
}
CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
    pthread_mutex_lock(&lock);
    pool_release((struct fake_pool *)pool, keep);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
static void sync_pools(int ordinal)
{
    pthread_mutex_lock(&lock);
    struct fake_pool *p = device_pool(ordinal);
    pool_release(p, p->threshold);
    pthread_mutex_unlock(&lock);
}
CUresult cuStreamSynchronize(CUstream s) { sync_pools(stream_ordinal(s)); return CUDA_SUCCESS; }
CUresult cuCtxSynchronize(void) { sync_pools(current_dev); return CUDA_SUCCESS; }

CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s)
{
    return pool_alloc(device_pool(stream_ordinal(s)), p, n);
}
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { return cuMemAllocAsync(p, n, s); }
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)
{
    (void)s;
    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    return pool_alloc((struct fake_pool *)pool, p, n);
}
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)
{
    return cuMemAllocFromPoolAsync(p, n, pool, s);
}
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { (void)s; return pool_free(p); }
CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return cuMemFreeAsync(p, s); }

/* ---- virtual memory: a handle's memory stays until it is released and
 * unmapped everywhere ---- */
static struct {
    CUmemGenericAllocationHandle handle;
    uint64_t size;
    int card, maps, released;
} handles[MAX_HANDLES];
static struct {
    CUdeviceptr va;
    size_t size;
    CUmemGenericAllocationHandle handle;
} mappings[MAX_HANDLES];

static int handle_index(CUmemGenericAllocationHandle h)
{
    for (int i = 0; i < MAX_HANDLES; i++)
        if (handles[i].handle == h && h)
            return i;
    return -1;
}

static void handle_maybe_free(int i)
{
    if (handles[i].released && handles[i].maps == 0) {
        card_add(handles[i].card, -(int64_t)handles[i].size);
        handles[i].handle = 0;
    }
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop,
                     unsigned long long flags)
{
    (void)flags;
    int ordinal = prop ? prop->location.id % MAX_DEV : 0, card = card_of(ordinal);
    if (!h || n == 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    int i;
    for (i = 0; i < MAX_HANDLES && handles[i].handle; i++)
        ;
    if (i == MAX_HANDLES || card_used(card) + n > total_bytes()) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    card_add(card, (int64_t)n);
    *h = next_address;
    next_address += (n + 255) & ~255ull;
    handles[i].handle = *h;
    handles[i].size = n;
    handles[i].card = card;
    handles[i].maps = handles[i].released = 0;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    pthread_mutex_lock(&lock);
    int i = handle_index(h);
    if (i >= 0 && !handles[i].released) {
        handles[i].released = 1;
        handle_maybe_free(i);
    }
    pthread_mutex_unlock(&lock);
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags)
{
    (void)align, (void)addr, (void)flags;
    pthread_mutex_lock(&lock);
    *ptr = next_address;
    next_address += (size + 255) & ~255ull;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) { (void)ptr, (void)size; return CUDA_SUCCESS; }
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                  unsigned long long flags)
{
    (void)offset, (void)flags;
    pthread_mutex_lock(&lock);
    int i = handle_index(h), m;
    for (m = 0; m < MAX_HANDLES && mappings[m].va; m++)
        ;
    if (i < 0 || handles[i].released || m == MAX_HANDLES) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    handles[i].maps++;
    mappings[m].va = ptr;
    mappings[m].size = size;
    mappings[m].handle = h;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    pthread_mutex_lock(&lock);
    for (int m = 0; m < MAX_HANDLES; m++)
        if (mappings[m].va >= ptr && mappings[m].va < ptr + size && mappings[m].va) {
            int i = handle_index(mappings[m].handle);
            mappings[m].va = 0;
            if (i >= 0) {
                handles[i].maps--;
                handle_maybe_free(i);
            }
        }
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
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

/* ---- launches: kernels run on the card's timeline ---- */
static unsigned long long launched;

static CUresult run_on_gpu(long long ns)
{
    __atomic_fetch_add(&launched, 1, __ATOMIC_RELAXED);
    if (ns <= 0)
        return CUDA_SUCCESS;
    int card = card_of(current_dev);
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    struct fake_proc *p = fake_me(g);
    int64_t now = fake_now(), start = now;
    if (g->free_at[card] > start)
        start = g->free_at[card];
    if (p->stream_end > start)
        start = p->stream_end;
    int64_t end = start + ns;
    g->free_at[card] = end;
    g->scheduled_ns[card] += ns;
    p->stream_end = end;
    if (p->count == FAKE_RING) { /* fold the oldest (long finished) into the base */
        p->busy_base[p->ring[p->head].card] += p->ring[p->head].end - p->ring[p->head].start;
        p->head = (p->head + 1) % FAKE_RING;
        p->count--;
    }
    uint32_t i = (p->head + p->count++) % FAKE_RING;
    p->ring[i].start = start;
    p->ring[i].end = end;
    p->ring[i].card = card;
    fake_unlock(g);
    if (end - now > QUEUE_NS) { /* the launch queue is full: wait, as a real launch would */
        int64_t wait = end - now - QUEUE_NS;
        struct timespec ts = {wait / 1000000000ll, wait % 1000000000ll};
        nanosleep(&ts, NULL);
    }
    return CUDA_SUCCESS;
}

static CUresult run_kernel(void)
{
    static long us = -1;
    if (us < 0) {
        const char *s = getenv("FAKE_CUDA_LAUNCH_US");
        us = s ? atol(s) : 0;
    }
    return run_on_gpu(us * 1000ll);
}

/* This process's GPU time on its current card so far (ns). */
long long fake_cuda_busy_ns(void)
{
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    long long busy = fake_busy(fake_me(g), card_of(current_dev), fake_now());
    fake_unlock(g);
    return busy;
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
CUresult cuLaunch(CUfunction f) { (void)f; return run_kernel(); }
CUresult cuLaunchGrid(CUfunction f, int w, int h) { (void)f, (void)w, (void)h; return run_kernel(); }
CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s)
{
    (void)f, (void)w, (void)h, (void)s;
    return run_kernel();
}

/* A graph exec here is just its GPU time; made by fake_cuda_graph(us). */
struct fake_graph {
    long long ns;
};
CUgraphExec fake_cuda_graph(unsigned int us)
{
    struct fake_graph *g = malloc(sizeof(*g));
    g->ns = us * 1000ll;
    return (CUgraphExec)g;
}
CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    (void)s;
    return g ? run_on_gpu(((struct fake_graph *)g)->ns) : run_kernel();
}
CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) { return cuGraphLaunch(g, s); }

unsigned long long fake_cuda_launches(void) { return __atomic_load_n(&launched, __ATOMIC_RELAXED); }

/* ---- events: the time the stream's queued work ends ---- */
struct fake_event {
    int64_t t;
};
CUresult cuEventCreate(CUevent *e, unsigned int flags)
{
    (void)flags;
    *e = (CUevent)calloc(1, sizeof(struct fake_event));
    return CUDA_SUCCESS;
}
CUresult cuEventRecord(CUevent e, CUstream s)
{
    (void)s;
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    int64_t end = fake_me(g)->stream_end, now = fake_now();
    fake_unlock(g);
    ((struct fake_event *)e)->t = end > now ? end : now;
    return CUDA_SUCCESS;
}
CUresult cuEventQuery(CUevent e)
{
    return fake_now() >= ((struct fake_event *)e)->t ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b)
{
    *ms = (float)(((struct fake_event *)b)->t - ((struct fake_event *)a)->t) / 1e6f;
    return CUDA_SUCCESS;
}
CUresult cuEventDestroy_v2(CUevent e) { free(e); return CUDA_SUCCESS; }

/* ---- cuGetProcAddress: the driver's own (name, version) table ---- */
static CUresult alias_cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return take_ptr(n, p); }
static CUresult alias_cuMemGetInfo_v2(size_t *f, size_t *t) { return cuMemGetInfo_v2(f, t); }

#define P(name, since, ptsz, fn) {name, since, ptsz, (void *)&fn}
static const struct {
    const char *name;
    int since, ptsz;
    void *fn;
} proc_table[] = {
    P("cuInit", 2000, 0, cuInit), P("cuDriverGetVersion", 2020, 0, cuDriverGetVersion),
    P("cuDeviceGetCount", 2000, 0, cuDeviceGetCount), P("cuCtxGetDevice", 2000, 0, cuCtxGetDevice),
    P("cuCtxSetCurrent", 4000, 0, cuCtxSetCurrent), P("cuDeviceGetUuid", 9020, 0, cuDeviceGetUuid),
    P("cuDeviceGetUuid", 11040, 0, cuDeviceGetUuid_v2),
    P("cuMemAlloc", 2000, 0, cuMemAlloc), P("cuMemAlloc", 3020, 0, cuMemAlloc_v2),
    P("cuMemAlloc", 14000, 0, fake_cuMemAlloc_v3),
    P("cuMemAllocPitch", 2000, 0, cuMemAllocPitch), P("cuMemAllocPitch", 3020, 0, cuMemAllocPitch_v2),
    P("cuMemAllocManaged", 6000, 0, cuMemAllocManaged),
    P("cuMemAllocAsync", 11020, 0, cuMemAllocAsync), P("cuMemAllocAsync", 11020, 1, cuMemAllocAsync_ptsz),
    P("cuMemAllocFromPoolAsync", 11020, 0, cuMemAllocFromPoolAsync),
    P("cuMemAllocFromPoolAsync", 11020, 1, cuMemAllocFromPoolAsync_ptsz),
    P("cuMemCreate", 10020, 0, cuMemCreate), P("cuMemMap", 10020, 0, cuMemMap),
    P("cuMemUnmap", 10020, 0, cuMemUnmap), P("cuMemRelease", 10020, 0, cuMemRelease),
    P("cuMemPoolCreate", 11020, 0, cuMemPoolCreate), P("cuMemPoolDestroy", 11020, 0, cuMemPoolDestroy),
    P("cuMemPoolTrimTo", 11020, 0, cuMemPoolTrimTo),
    P("cuArrayCreate", 2000, 0, cuArrayCreate), P("cuArrayCreate", 3020, 0, cuArrayCreate_v2),
    P("cuArray3DCreate", 2000, 0, cuArray3DCreate), P("cuArray3DCreate", 3020, 0, cuArray3DCreate_v2),
    P("cuMipmappedArrayCreate", 5000, 0, cuMipmappedArrayCreate),
    P("cuMemFree", 2000, 0, cuMemFree), P("cuMemFree", 3020, 0, cuMemFree_v2),
    P("cuMemFreeAsync", 11020, 0, cuMemFreeAsync), P("cuMemFreeAsync", 11020, 1, cuMemFreeAsync_ptsz),
    P("cuArrayDestroy", 2000, 0, cuArrayDestroy),
    P("cuMipmappedArrayDestroy", 5000, 0, cuMipmappedArrayDestroy),
    P("cuMemGetInfo", 2000, 0, cuMemGetInfo), P("cuMemGetInfo", 3020, 0, cuMemGetInfo_v2),
    P("cuDeviceTotalMem", 2000, 0, cuDeviceTotalMem), P("cuDeviceTotalMem", 3020, 0, cuDeviceTotalMem_v2),
    P("cuDevicePrimaryCtxRetain", 7000, 0, cuDevicePrimaryCtxRetain),
    P("cuCtxCreate", 2000, 0, cuCtxCreate), P("cuCtxCreate", 3020, 0, cuCtxCreate_v2),
    P("cuCtxCreate", 11040, 0, cuCtxCreate_v3), P("cuCtxCreate", 12050, 0, cuCtxCreate_v4),
    P("cuLaunchKernel", 4000, 0, cuLaunchKernel), P("cuLaunchKernel", 7000, 1, cuLaunchKernel_ptsz),
    P("cuLaunchKernelEx", 11060, 0, cuLaunchKernelEx), P("cuLaunchKernelEx", 11060, 1, cuLaunchKernelEx_ptsz),
    P("cuLaunchCooperativeKernel", 9000, 0, cuLaunchCooperativeKernel),
    P("cuLaunchCooperativeKernel", 9000, 1, cuLaunchCooperativeKernel_ptsz),
    P("cuLaunch", 2000, 0, cuLaunch), P("cuLaunchGrid", 2000, 0, cuLaunchGrid),
    P("cuLaunchGridAsync", 2000, 0, cuLaunchGridAsync),
    P("cuGraphLaunch", 10000, 0, cuGraphLaunch), P("cuGraphLaunch", 10000, 1, cuGraphLaunch_ptsz),
};

static void *proc_lookup(const char *symbol, int version, int want_ptsz)
{
    void *best = NULL;
    int best_since = -1;
    for (int pass = want_ptsz ? 1 : 0; pass >= 0 && !best; pass--)
        for (size_t i = 0; i < sizeof(proc_table) / sizeof(proc_table[0]); i++)
            if (proc_table[i].ptsz == pass && proc_table[i].since <= version &&
                proc_table[i].since > best_since && strcmp(proc_table[i].name, symbol) == 0) {
                best = proc_table[i].fn;
                best_since = proc_table[i].since;
            }
    return best;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *status)
{
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = proc_lookup(symbol, version, (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0);
    if (getenv("FAKE_CUDA_PROC_ALIAS")) {
        if (*pfn == (void *)&cuMemAlloc_v2)
            *pfn = (void *)&alias_cuMemAlloc_v2;
        else if (*pfn == (void *)&cuMemGetInfo_v2)
            *pfn = (void *)&alias_cuMemGetInfo_v2;
    }
    if (status)
        *status = *pfn ? 0 : 1; /* CU_GET_PROC_ADDRESS_SUCCESS / SYMBOL_NOT_FOUND */
    return *pfn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
