/*
 * Memory wrappers.  Every allocation reserves its bytes in the budget
 * before calling the driver and gives them back if the driver fails, so
 * concurrent allocations can never overshoot together.  A per-process map
 * remembers what each pointer/handle took; a free gives back exactly that,
 * and a free of something unknown gives back nothing.
 */
#include <limits.h>

#include "vgpu.h"
#include "vgpu_shared.h"

#define PITCH_ALIGN 512 /* the driver's usual pitch alignment; corrected after the call */
#define MAX_MIP_LEVELS 32

static struct vgpu_map allocations = VGPU_MAP_INITIALIZER;

void vgpu_memory_after_fork(void)
{
    vgpu_map_reset(&allocations);
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

/* Reserves `bytes` on `dev` (-1: the current context's device); 0 if granted. */
static int reserve(struct pending *r, int dev, uint64_t bytes)
{
    r->active = limited();
    if (!r->active)
        return 0;
    r->dev = dev >= 0 && dev < VGPU_MAX_DEVICES ? dev : vgpu_current_device();
    r->bytes = bytes;
    return vgpu_budget_reserve(r->dev, bytes);
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
    struct vgpu_map_entry old, e = {.key = key, .size = r->bytes, .dev = r->dev, .kind = (uint8_t)kind};
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

VGPU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream stream)
{
    ACCOUNTED(-1, bytes, VGPU_KEY_PTR, *dptr, VGPU_REAL(cuMemAllocAsync, dptr, bytes, stream));
}

VGPU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream stream)
{
    ACCOUNTED(-1, bytes, VGPU_KEY_PTR, *dptr, VGPU_REAL(cuMemAllocAsync_ptsz, dptr, bytes, stream));
}

VGPU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                                             CUstream stream)
{
    ACCOUNTED(-1, bytes, VGPU_KEY_PTR, *dptr,
              VGPU_REAL(cuMemAllocFromPoolAsync, dptr, bytes, pool, stream));
}

VGPU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytes,
                                                  CUmemoryPool pool, CUstream stream)
{
    ACCOUNTED(-1, bytes, VGPU_KEY_PTR, *dptr,
              VGPU_REAL(cuMemAllocFromPoolAsync_ptsz, dptr, bytes, pool, stream));
}

VGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t bytes,
                                 const CUmemAllocationProp *prop, unsigned long long flags)
{
    if (!prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return VGPU_REAL(cuMemCreate, handle, bytes, prop, flags); /* host memory */
    int dev = prop->location.id >= 0 && prop->location.id < VGPU_MAX_DEVICES
                  ? prop->location.id
                  : VGPU_MAX_DEVICES - 1;
    ACCOUNTED(dev, bytes, VGPU_KEY_HANDLE, *handle,
              VGPU_REAL(cuMemCreate, handle, bytes, prop, flags));
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

VGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream)
{
    RELEASED(VGPU_KEY_PTR, dptr, VGPU_REAL(cuMemFreeAsync, dptr, stream));
}

VGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream)
{
    RELEASED(VGPU_KEY_PTR, dptr, VGPU_REAL(cuMemFreeAsync_ptsz, dptr, stream));
}

VGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    RELEASED(VGPU_KEY_HANDLE, handle, VGPU_REAL(cuMemRelease, handle));
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
            limit_info(vgpu_current_device(), &f_, &t_);                                         \
            *(free_bytes) = f_;                                                                  \
            *(total_bytes) = t_;                                                                 \
        }                                                                                        \
        return rc_;                                                                              \
    } while (0)

#define LIMITED_TOTAL(sym, bytes, dev)                                                           \
    do {                                                                                         \
        CUresult rc_ = VGPU_REAL(sym, bytes, dev);                                               \
        if (rc_ == CUDA_SUCCESS && limited() && *(bytes) > vgpu_cfg.memory_limit)                \
            *(bytes) = vgpu_cfg.memory_limit;                                                    \
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
