/*
 * Memory wrappers.  Every allocation reserves its bytes in the budget of its
 * card before calling the driver and gives them back if the driver fails, so
 * concurrent allocations can never overshoot together.  A per-process map
 * remembers what each pointer/handle took; a free gives back exactly that,
 * and a free of something unknown gives back nothing.
 *
 * Virtual memory: a cuMemCreate handle released while still mapped keeps its
 * memory until its last cuMemUnmap, and is credited only then.
 *
 * Stream-ordered pools: what a pool really reserves is charged (the growth
 * of CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), not the bytes handed out, and
 * credited when it shrinks; the card is the pool's or the stream's.
 */
#include <limits.h>
#include <pthread.h>

#include "vgpu.h"

#define PITCH_ALIGN 512 /* the driver's usual pitch alignment; corrected after the call */
#define MAX_MIP_LEVELS 32

static struct vgpu_map allocations = VGPU_MAP_INITIALIZER;

#define MAX_POOLS 64

typedef CUresult (*pool_get_attribute_fn)(CUmemoryPool, int, void *);
typedef CUresult (*device_get_mem_pool_fn)(CUmemoryPool *, CUdevice);

/* The pools this process allocated from, and what each is charged. */
static struct pool {
    CUmemoryPool handle;
    int entry;        /* budget entry (card) */
    uint64_t charged; /* its reserved bytes as last charged */
} pools[MAX_POOLS];
static int npools;
static pthread_mutex_t pools_lock = PTHREAD_MUTEX_INITIALIZER;

static void pools_forget(void);

void vgpu_memory_after_fork(void)
{
    vgpu_map_reset(&allocations);
    pools_forget();
}

static inline int limited(void)
{
    vgpu_init();
    return vgpu_cfg.memory_limit != VGPU_NO_LIMIT;
}

/* A reservation in flight. */
struct pending {
    int active;
    int dev;
    uint64_t bytes;
};

static void pools_refresh(void);

/* Reserves `bytes` on device `ordinal` (-1: the current context's); 0 if
 * granted.  Before refusing, pools that shrank give their bytes back. */
static int reserve(struct pending *r, int ordinal, uint64_t bytes)
{
    r->active = limited();
    if (!r->active)
        return 0;
    r->dev = vgpu_device_entry(ordinal >= 0 ? ordinal : vgpu_current_ordinal());
    r->bytes = bytes;
    int rc = vgpu_budget_reserve(r->dev, bytes);
    if (rc != 0 && __atomic_load_n(&npools, __ATOMIC_ACQUIRE)) {
        pools_refresh();
        rc = vgpu_budget_reserve(r->dev, bytes);
    }
    VGPU_TRACE("reserve %llu bytes on budget entry %d: %s", (unsigned long long)bytes, r->dev,
               rc ? "refused" : "granted");
    return rc;
}

/* After the driver call: keep the reservation for `key`, or undo it. */
static CUresult settle(struct pending *r, CUresult rc, int kind, uint64_t key)
{
    static int logged;
    if (!r->active)
        return rc;
    if (rc != CUDA_SUCCESS) {
        vgpu_budget_release(r->dev, r->bytes);
        return rc;
    }
    struct vgpu_map_entry old,
        e = {.key = key, .size = r->bytes, .dev = r->dev, .kind = (uint8_t)kind};
    int put = vgpu_map_put(&allocations, e, &old);
    if (put == 1) /* the driver reused a key we missed the free of */
        vgpu_budget_release(old.dev, old.size);
    else if (put < 0)
        vgpu_log(&logged, "out of host memory: an allocation stays charged after its free");
    return rc;
}

/* Resizes the reservation to the size the driver really took; -1 if over. */
static int correct(struct pending *r, uint64_t actual)
{
    if (!r->active || actual == r->bytes)
        return 0;
    if (actual < r->bytes) {
        vgpu_budget_release(r->dev, r->bytes - actual);
    } else if (vgpu_budget_reserve(r->dev, actual - r->bytes) != 0) {
        return -1;
    }
    r->bytes = actual;
    return 0;
}

#define ACCOUNTED(dev, bytes, kind, key, call)                                                   \
    do {                                                                                         \
        struct pending r_;                                                                       \
        if (reserve(&r_, dev, bytes) != 0)                                                       \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                     \
        CUresult rc_ = (call);                                                                   \
        return settle(&r_, rc_, kind, rc_ == CUDA_SUCCESS ? (uint64_t)(key) : 0);                \
    } while (0)

/* Free: take the entry out first (the driver may hand the address out again
 * the moment it is freed), give the bytes back once the driver agrees. */
static CUresult released(CUresult rc, int had, const struct vgpu_map_entry *e)
{
    struct vgpu_map_entry old;
    if (!had)
        return rc;
    VGPU_TRACE("free of %llu bytes on budget entry %d: rc %d", (unsigned long long)e->size, e->dev,
               rc);
    if (rc == CUDA_SUCCESS)
        vgpu_budget_release(e->dev, e->size);
    else if (vgpu_map_put(&allocations, *e, &old) == 1)
        vgpu_budget_release(old.dev, old.size);
    return rc;
}

#define RELEASED(kind, key, call)                                                                \
    do {                                                                                         \
        struct vgpu_map_entry e_;                                                                \
        int had_ = limited() && vgpu_map_take(&allocations, kind, (uint64_t)(key), &e_);         \
        return released((call), had_, &e_);                               \
    } while (0)

static uint64_t mul3(uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t ab, abc;
    if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc))
        return UINT64_MAX; /* cannot fit: the reservation fails */
    return abc;
}

static uint64_t element_bytes(CUarray_format format, unsigned int channels)
{
    uint64_t size;
    switch (format) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
        size = 1;
        break;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
        size = 2;
        break;
    default: /* 32-bit formats; newer packed/compressed ones are over-estimated */
        size = 4;
    }
    return size * (channels ? channels : 1);
}

static uint64_t max1(uint64_t v)
{
    return v ? v : 1;
}

/* Bytes of an array (an estimate: the driver's tiling is not visible). */
static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format f, unsigned int ch)
{
    return mul3(mul3(max1(w), max1(h), max1(d)), element_bytes(f, ch), 1);
}

static uint64_t mipmap_bytes(const CUDA_ARRAY3D_DESCRIPTOR *a, unsigned int levels)
{
    uint64_t total = 0;
    if (!a)
        return 0;
    for (unsigned int l = 0; l < levels && l < MAX_MIP_LEVELS; l++) {
        uint64_t w = max1(a->Width >> l), h = a->Height ? max1(a->Height >> l) : 0;
        uint64_t d = a->Depth ? max1(a->Depth >> l) : 0;
        uint64_t level = array_bytes(w, h, d, a->Format, a->NumChannels);
        total = level > UINT64_MAX - total ? UINT64_MAX : total + level;
    }
    return total;
}

/* ---- allocations ---- */

VGPU_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytes)
{
    ACCOUNTED(-1, bytes, VGPU_KEY_PTR, *dptr, VGPU_REAL(cuMemAlloc, dptr, bytes));
}

VGPU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes)
{
    ACCOUNTED(-1, bytes, VGPU_KEY_PTR, *dptr, VGPU_REAL(cuMemAlloc_v2, dptr, bytes));
}

VGPU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags)
{
    ACCOUNTED(-1, bytes, VGPU_KEY_PTR, *dptr, VGPU_REAL(cuMemAllocManaged, dptr, bytes, flags));
}

/* ---- stream-ordered pools ---- */

static uint64_t pool_attribute(CUmemoryPool pool, int attribute)
{
    static void *f;
    pool_get_attribute_fn get = __atomic_load_n(&f, __ATOMIC_ACQUIRE);
    if (!get) {
        get = (pool_get_attribute_fn)vgpu_cuda_sym("cuMemPoolGetAttribute");
        __atomic_store_n(&f, (void *)get, __ATOMIC_RELEASE);
    }
    cuuint64_t v = 0;
    if (!get || get(pool, attribute, &v) != CUDA_SUCCESS)
        return UINT64_MAX;
    return v;
}

static uint64_t pool_reserved(CUmemoryPool pool)
{
    return pool_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
}

/* How much the pool may have to grow to serve `bytes` (all of it if unknown). */
static uint64_t pool_growth(CUmemoryPool pool, uint64_t bytes)
{
    uint64_t reserved = pool_reserved(pool),
             used = pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
    if (reserved == UINT64_MAX || used == UINT64_MAX || used > reserved)
        return bytes;
    return bytes > reserved - used ? bytes - (reserved - used) : 0;
}

/* The pool's record (added on first use, on budget entry `entry`). */
static struct pool *pool_of(CUmemoryPool handle, int entry)
{
    static int logged;
    struct pool *p = NULL;
    pthread_mutex_lock(&pools_lock);
    for (int i = 0; i < npools && !p; i++)
        if (pools[i].handle == handle)
            p = &pools[i];
    if (!p && entry >= 0) {
        if (npools < MAX_POOLS) {
            p = &pools[npools];
            *p = (struct pool){handle, entry, 0};
            __atomic_store_n(&npools, npools + 1, __ATOMIC_RELEASE);
        } else {
            vgpu_log(&logged, "more than %d memory pools: allocations from the others are "
                     "charged by size", MAX_POOLS);
        }
    }
    pthread_mutex_unlock(&pools_lock);
    return p;
}

/* Charges the pool's growth, credits its shrinkage.  1 if the card's
 * budget is over the limit afterwards. */
static int pool_sync(struct pool *p)
{
    uint64_t now = pool_reserved(p->handle);
    if (now == UINT64_MAX)
        return 0;
    pthread_mutex_lock(&pools_lock);
    uint64_t before = p->charged;
    p->charged = now;
    pthread_mutex_unlock(&pools_lock);
    if (now > before)
        vgpu_budget_charge(p->entry, now - before);
    else if (now < before)
        vgpu_budget_release(p->entry, before - now);
    if (now != before)
        VGPU_TRACE("pool %p reserves %llu bytes (was %llu)", (void *)p->handle,
                   (unsigned long long)now, (unsigned long long)before);
    return vgpu_budget_used(p->entry) > vgpu_cfg.memory_limit;
}

static void pools_refresh(void)
{
    int n = __atomic_load_n(&npools, __ATOMIC_ACQUIRE);
    for (int i = 0; i < n; i++)
        pool_sync(&pools[i]);
}

static void pools_forget(void)
{
    pthread_mutex_init(&pools_lock, NULL);
    npools = 0; /* the child's pools are new ones */
}

typedef CUresult (*free_async_fn)(CUdeviceptr, CUstream);

/*
 * An allocation from a pool: reserve the growth it may cause, allocate,
 * then charge what the pool really reserves now.  If that is over the limit
 * (the pool grew by more than asked), the allocation is undone, the pool
 * trimmed, and the caller gets CUDA_ERROR_OUT_OF_MEMORY.
 */
#define POOLED(pool_in, stream, call, free_sym)                                                  \
    do {                                                                                         \
        if (!limited())                                                                          \
            return (call);                                                                       \
        int ordinal_ = vgpu_stream_ordinal(stream);                                              \
        CUmemoryPool pool_ = (pool_in);                                                          \
        struct pool *p_ = pool_ ? pool_of(pool_, -1) : NULL;                                     \
        if (!pool_) {                                                                            \
            device_get_mem_pool_fn get_ =                                                        \
                (device_get_mem_pool_fn)vgpu_cuda_sym("cuDeviceGetMemPool");                     \
            if (!get_ || get_(&pool_, ordinal_) != CUDA_SUCCESS)                                 \
                pool_ = NULL;                                                                    \
        }                                                                                        \
        if (pool_ && !p_)                                                                        \
            p_ = pool_of(pool_, vgpu_device_entry(ordinal_));                                    \
        if (!p_) /* no pool to watch: charge by size */                                          \
            ACCOUNTED(ordinal_, bytes, VGPU_KEY_PTR, *dptr, (call));                             \
        struct pending r_ = {1, p_->entry, pool_growth(pool_, bytes)};                           \
        if (vgpu_budget_reserve(r_.dev, r_.bytes) != 0) {                                        \
            pools_refresh();                                                                     \
            if (vgpu_budget_reserve(r_.dev, r_.bytes) != 0) {                                    \
                VGPU_TRACE("pool allocation of %zu bytes: refused", bytes);                      \
                return CUDA_ERROR_OUT_OF_MEMORY;                                                 \
            }                                                                                    \
        }                                                                                        \
        CUresult rc_ = (call);                                                                   \
        vgpu_budget_release(r_.dev, r_.bytes);                                                   \
        if (rc_ != CUDA_SUCCESS)                                                                 \
            return rc_;                                                                          \
        if (pool_sync(p_)) {                                                                     \
            free_async_fn free_ = (free_async_fn)vgpu_real(VGPU_H_##free_sym);                   \
            if (free_)                                                                           \
                free_(*dptr, stream);                                                            \
            VGPU_REAL(cuMemPoolTrimTo, pool_, 0);                                                \
            pool_sync(p_);                                                                       \
            VGPU_TRACE("pool allocation of %zu bytes: the pool grew past the limit; undone",     \
                       bytes);                                                                   \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                     \
        }                                                                                        \
        struct vgpu_map_entry old_, e_ = {.key = *dptr, .size = 0, .aux = (uintptr_t)pool_,      \
                                          .dev = p_->entry, .kind = VGPU_KEY_POOLPTR};           \
        vgpu_map_put(&allocations, e_, &old_);                                                   \
        VGPU_TRACE("pool allocation of %zu bytes on budget entry %d", bytes, p_->entry);         \
        return rc_;                                                                              \
    } while (0)

VGPU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream stream)
{
    POOLED(NULL, stream, VGPU_REAL(cuMemAllocAsync, dptr, bytes, stream), cuMemFreeAsync);
}

VGPU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream stream)
{
    POOLED(NULL, stream, VGPU_REAL(cuMemAllocAsync_ptsz, dptr, bytes, stream),
           cuMemFreeAsync_ptsz);
}

VGPU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                                             CUstream stream)
{
    POOLED(pool, stream, VGPU_REAL(cuMemAllocFromPoolAsync, dptr, bytes, pool, stream),
           cuMemFreeAsync);
}

VGPU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytes,
                                                  CUmemoryPool pool, CUstream stream)
{
    POOLED(pool, stream, VGPU_REAL(cuMemAllocFromPoolAsync_ptsz, dptr, bytes, pool, stream),
           cuMemFreeAsync_ptsz);
}

VGPU_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    CUresult rc = VGPU_REAL(cuMemPoolCreate, pool, props);
    if (rc == CUDA_SUCCESS && pool && props && limited() &&
        props->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        pool_of(*pool, vgpu_device_entry(props->location.id));
    VGPU_TRACE("cuMemPoolCreate = %d", rc);
    return rc;
}

VGPU_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    CUresult rc = VGPU_REAL(cuMemPoolDestroy, pool);
    struct pool *p = rc == CUDA_SUCCESS ? pool_of(pool, -1) : NULL;
    if (p) {
        pthread_mutex_lock(&pools_lock);
        uint64_t charged = p->charged;
        int entry = p->entry;
        *p = pools[npools - 1];
        __atomic_store_n(&npools, npools - 1, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&pools_lock);
        vgpu_budget_release(entry, charged);
    }
    VGPU_TRACE("cuMemPoolDestroy = %d", rc);
    return rc;
}

VGPU_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
    CUresult rc = VGPU_REAL(cuMemPoolTrimTo, pool, keep);
    struct pool *p = pool_of(pool, -1);
    if (p)
        pool_sync(p);
    return rc;
}

/* ---- virtual memory ---- */

VGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t bytes,
                                 const CUmemAllocationProp *prop, unsigned long long flags)
{
    if (!prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return VGPU_REAL(cuMemCreate, handle, bytes, prop, flags); /* host memory */
    ACCOUNTED(prop->location.id, bytes, VGPU_KEY_HANDLE, *handle,
              VGPU_REAL(cuMemCreate, handle, bytes, prop, flags));
}

VGPU_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                              CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    CUresult rc = VGPU_REAL(cuMemMap, ptr, size, offset, handle, flags);
    struct vgpu_map_entry old, gone;
    if (rc == CUDA_SUCCESS && limited() && vgpu_map_handle(&allocations, handle, 1, 0, &gone)) {
        struct vgpu_map_entry e = {.key = ptr, .size = size, .aux = handle,
                                   .kind = VGPU_KEY_MAPPING};
        vgpu_map_put(&allocations, e, &old);
    }
    VGPU_TRACE("cuMemMap(%#llx, %zu, handle %#llx) = %d", (unsigned long long)ptr, size,
               (unsigned long long)handle, rc);
    return rc;
}

VGPU_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CUresult rc = VGPU_REAL(cuMemUnmap, ptr, size);
    VGPU_TRACE("cuMemUnmap(%#llx, %zu) = %d", (unsigned long long)ptr, size, rc);
    if (rc != CUDA_SUCCESS || !limited())
        return rc;
    /* The range may span several mappings laid end to end. */
    for (CUdeviceptr at = ptr; at < ptr + size;) {
        struct vgpu_map_entry m, h;
        if (!vgpu_map_take(&allocations, VGPU_KEY_MAPPING, at, &m))
            break;
        if (vgpu_map_handle(&allocations, m.aux, -1, 0, &h) == 2) {
            VGPU_TRACE("last mapping of released handle %#llx gone: %llu bytes back",
                       (unsigned long long)m.aux, (unsigned long long)h.size);
            vgpu_budget_release(h.dev, h.size);
        }
        at += m.size ? m.size : size;
    }
    return rc;
}

VGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    struct vgpu_map_entry e;
    /* Unmapped: out of the map now (the driver may hand the value out again
     * at once), credited when the driver agrees.  Still mapped: marked; its
     * memory is credited at its last cuMemUnmap. */
    int state = limited() ? vgpu_map_handle(&allocations, handle, 0, 1, &e) : 0;
    CUresult rc = VGPU_REAL(cuMemRelease, handle);
    VGPU_TRACE("cuMemRelease(%#llx) = %d: %s", (unsigned long long)handle, rc,
               state == 2 ? "credited" : state == 1 ? "still mapped" : "unknown");
    if (state == 2)
        return released(rc, 1, &e);
    return rc;
}

/* The pitch is the driver's choice: reserve a guess, then correct it. */
#define PITCHED(alloc_sym, free_sym)                                                             \
    do {                                                                                         \
        struct pending r_;                                                                       \
        uint64_t guess_ = mul3((width + PITCH_ALIGN - 1ull) / PITCH_ALIGN * PITCH_ALIGN, height, 1); \
        if (reserve(&r_, -1, guess_) != 0)                                                       \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                     \
        CUresult rc_ = VGPU_REAL(alloc_sym, dptr, pitch, width, height, elem);                   \
        if (rc_ == CUDA_SUCCESS && correct(&r_, mul3(*pitch, height, 1)) != 0) {                 \
            VGPU_REAL(free_sym, *dptr);                                                          \
            rc_ = CUDA_ERROR_OUT_OF_MEMORY;                                                      \
        }                                                                                        \
        return settle(&r_, rc_, VGPU_KEY_PTR, rc_ == CUDA_SUCCESS ? *dptr : 0);                  \
    } while (0)

VGPU_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch,
                                     unsigned int width, unsigned int height, unsigned int elem)
{
    PITCHED(cuMemAllocPitch, cuMemFree);
}

VGPU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
                                        size_t height, unsigned int elem)
{
    PITCHED(cuMemAllocPitch_v2, cuMemFree_v2);
}

VGPU_EXPORT CUresult cuArrayCreate(CUarray *handle, const CUDA_ARRAY_DESCRIPTOR_v1 *a)
{
    uint64_t bytes = a ? array_bytes(a->Width, a->Height, 0, a->Format, a->NumChannels) : 0;
    ACCOUNTED(-1, bytes, VGPU_KEY_ARRAY, (uintptr_t)*handle, VGPU_REAL(cuArrayCreate, handle, a));
}

VGPU_EXPORT CUresult cuArrayCreate_v2(CUarray *handle, const CUDA_ARRAY_DESCRIPTOR *a)
{
    uint64_t bytes = a ? array_bytes(a->Width, a->Height, 0, a->Format, a->NumChannels) : 0;
    ACCOUNTED(-1, bytes, VGPU_KEY_ARRAY, (uintptr_t)*handle,
              VGPU_REAL(cuArrayCreate_v2, handle, a));
}

VGPU_EXPORT CUresult cuArray3DCreate(CUarray *handle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *a)
{
    uint64_t bytes = a ? array_bytes(a->Width, a->Height, a->Depth, a->Format, a->NumChannels) : 0;
    ACCOUNTED(-1, bytes, VGPU_KEY_ARRAY, (uintptr_t)*handle,
              VGPU_REAL(cuArray3DCreate, handle, a));
}

VGPU_EXPORT CUresult cuArray3DCreate_v2(CUarray *handle, const CUDA_ARRAY3D_DESCRIPTOR *a)
{
    uint64_t bytes = a ? array_bytes(a->Width, a->Height, a->Depth, a->Format, a->NumChannels) : 0;
    ACCOUNTED(-1, bytes, VGPU_KEY_ARRAY, (uintptr_t)*handle,
              VGPU_REAL(cuArray3DCreate_v2, handle, a));
}

VGPU_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *handle,
                                            const CUDA_ARRAY3D_DESCRIPTOR *a, unsigned int levels)
{
    ACCOUNTED(-1, mipmap_bytes(a, levels), VGPU_KEY_MIPMAP, (uintptr_t)*handle,
              VGPU_REAL(cuMipmappedArrayCreate, handle, a, levels));
}

/* ---- frees ---- */

VGPU_EXPORT CUresult cuMemFree(CUdeviceptr_v1 dptr)
{
    RELEASED(VGPU_KEY_PTR, dptr, VGPU_REAL(cuMemFree, dptr));
}

VGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    RELEASED(VGPU_KEY_PTR, dptr, VGPU_REAL(cuMemFree_v2, dptr));
}

/* A pool allocation's free: the pool keeps (and is charged for) its
 * reservation; what it gives back is credited. */
#define FREED_ASYNC(call)                                                                        \
    do {                                                                                         \
        struct vgpu_map_entry e_, old_;                                                          \
        if (limited() && vgpu_map_take(&allocations, VGPU_KEY_POOLPTR, dptr, &e_)) {             \
            CUresult rc_ = (call);                                                               \
            struct pool *p_ = pool_of((CUmemoryPool)(uintptr_t)e_.aux, -1);                      \
            if (rc_ != CUDA_SUCCESS)                                                             \
                vgpu_map_put(&allocations, e_, &old_);                                           \
            else if (p_)                                                                         \
                pool_sync(p_);                                                                   \
            return rc_;                                                                          \
        }                                                                                        \
        RELEASED(VGPU_KEY_PTR, dptr, (call));                                                    \
    } while (0)

VGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream)
{
    FREED_ASYNC(VGPU_REAL(cuMemFreeAsync, dptr, stream));
}

VGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream)
{
    FREED_ASYNC(VGPU_REAL(cuMemFreeAsync_ptsz, dptr, stream));
}

VGPU_EXPORT CUresult cuArrayDestroy(CUarray array)
{
    RELEASED(VGPU_KEY_ARRAY, (uintptr_t)array, VGPU_REAL(cuArrayDestroy, array));
}

VGPU_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray array)
{
    RELEASED(VGPU_KEY_MIPMAP, (uintptr_t)array, VGPU_REAL(cuMipmappedArrayDestroy, array));
}

/* ---- what the program is told ---- */

/* free = limit - the container's usage (never below 0, never above the
 * driver's free), total = the limit (never above the card). */
static void limit_info(int dev, uint64_t *free_bytes, uint64_t *total_bytes)
{
    if (__atomic_load_n(&npools, __ATOMIC_ACQUIRE))
        pools_refresh();
    uint64_t limit = vgpu_cfg.memory_limit, used = vgpu_budget_used(dev);
    uint64_t avail = used < limit ? limit - used : 0;
    if (limit < *total_bytes)
        *total_bytes = limit;
    if (avail < *free_bytes)
        *free_bytes = avail;
    if (*free_bytes > *total_bytes)
        *free_bytes = *total_bytes;
}

/* Values only shrink here, so they still fit the legacy 32-bit outputs. */
#define LIMITED_INFO(sym, free_bytes, total_bytes)                                               \
    do {                                                                                         \
        CUresult rc_ = VGPU_REAL(sym, free_bytes, total_bytes);                                  \
        if (rc_ == CUDA_SUCCESS && limited()) {                                                  \
            uint64_t f_ = *(free_bytes), t_ = *(total_bytes);                                    \
            limit_info(vgpu_device_entry(vgpu_current_ordinal()), &f_, &t_);                                         \
            *(free_bytes) = f_;                                                                  \
            *(total_bytes) = t_;                                                                 \
        }                                                                                        \
        VGPU_TRACE("%s = %d: free %llu, total %llu", #sym, rc_,                                  \
                   (unsigned long long)*(free_bytes), (unsigned long long)*(total_bytes));       \
        return rc_;                                                                              \
    } while (0)

#define LIMITED_TOTAL(sym, bytes, dev)                                                           \
    do {                                                                                         \
        CUresult rc_ = VGPU_REAL(sym, bytes, dev);                                               \
        if (rc_ == CUDA_SUCCESS && limited() && *(bytes) > vgpu_cfg.memory_limit)                \
            *(bytes) = vgpu_cfg.memory_limit;                                                    \
        VGPU_TRACE("%s = %d: %llu bytes", #sym, rc_, (unsigned long long)*(bytes));              \
        return rc_;                                                                              \
    } while (0)

VGPU_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    LIMITED_INFO(cuMemGetInfo_v2, free_bytes, total_bytes);
}

VGPU_EXPORT CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes)
{
    LIMITED_INFO(cuMemGetInfo, free_bytes, total_bytes);
}

VGPU_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    LIMITED_TOTAL(cuDeviceTotalMem_v2, bytes, dev);
}

VGPU_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    LIMITED_TOTAL(cuDeviceTotalMem, bytes, dev);
}
