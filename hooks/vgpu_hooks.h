/*
 * The intercepted driver entry points, as one X-macro list:
 *   X(symbol, base name, first cudaVersion, per-thread-stream variant, params)
 * "base name" + "first cudaVersion" + "per-thread" is how cuGetProcAddress
 * names a symbol (the CUDA 12 runtime asks for "cuMemAlloc" with
 * cudaVersion 12000 and gets cuMemAlloc_v2).  The stand-in driver used by
 * the tests includes this list too, so both sides agree on the mapping.
 */
#ifndef VGPU_HOOKS_H
#define VGPU_HOOKS_H

#include "cuda_types.h"

#define VGPU_LAUNCH_PARAMS                                                       \
    (CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,        \
     unsigned int, unsigned int, unsigned int, CUstream, void **, void **)
#define VGPU_COOP_PARAMS                                                         \
    (CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,        \
     unsigned int, unsigned int, unsigned int, CUstream, void **)
#define VGPU_ALLOC_ASYNC_PARAMS (CUdeviceptr *, size_t, CUstream)
#define VGPU_POOL_ASYNC_PARAMS (CUdeviceptr *, size_t, CUmemoryPool, CUstream)

#define VGPU_HOOK_LIST(X)                                                                \
    X(cuMemAlloc, cuMemAlloc, 0, 0, (CUdeviceptr_v1 *, unsigned int))                   \
    X(cuMemAlloc_v2, cuMemAlloc, 3020, 0, (CUdeviceptr *, size_t))                      \
    X(cuMemAllocPitch, cuMemAllocPitch, 0, 0,                                           \
      (CUdeviceptr_v1 *, unsigned int *, unsigned int, unsigned int, unsigned int))     \
    X(cuMemAllocPitch_v2, cuMemAllocPitch, 3020, 0,                                     \
      (CUdeviceptr *, size_t *, size_t, size_t, unsigned int))                          \
    X(cuMemAllocManaged, cuMemAllocManaged, 0, 0, (CUdeviceptr *, size_t, unsigned int)) \
    X(cuMemAllocAsync, cuMemAllocAsync, 0, 0, VGPU_ALLOC_ASYNC_PARAMS)                  \
    X(cuMemAllocAsync_ptsz, cuMemAllocAsync, 0, 1, VGPU_ALLOC_ASYNC_PARAMS)             \
    X(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync, 0, 0, VGPU_POOL_ASYNC_PARAMS)   \
    X(cuMemAllocFromPoolAsync_ptsz, cuMemAllocFromPoolAsync, 0, 1,                      \
      VGPU_POOL_ASYNC_PARAMS)                                                           \
    X(cuMemCreate, cuMemCreate, 0, 0,                                                   \
      (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,             \
       unsigned long long))                                                             \
    X(cuArrayCreate, cuArrayCreate, 0, 0, (CUarray *, const CUDA_ARRAY_DESCRIPTOR_v1 *)) \
    X(cuArrayCreate_v2, cuArrayCreate, 3020, 0, (CUarray *, const CUDA_ARRAY_DESCRIPTOR *)) \
    X(cuArray3DCreate, cuArray3DCreate, 0, 0,                                           \
      (CUarray *, const CUDA_ARRAY3D_DESCRIPTOR_v1 *))                                  \
    X(cuArray3DCreate_v2, cuArray3DCreate, 3020, 0,                                     \
      (CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *))                                     \
    X(cuMipmappedArrayCreate, cuMipmappedArrayCreate, 0, 0,                             \
      (CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned int))              \
    X(cuMemFree, cuMemFree, 0, 0, (CUdeviceptr_v1))                                     \
    X(cuMemFree_v2, cuMemFree, 3020, 0, (CUdeviceptr))                                  \
    X(cuMemFreeAsync, cuMemFreeAsync, 0, 0, (CUdeviceptr, CUstream))                    \
    X(cuMemFreeAsync_ptsz, cuMemFreeAsync, 0, 1, (CUdeviceptr, CUstream))               \
    X(cuMemRelease, cuMemRelease, 0, 0, (CUmemGenericAllocationHandle))                 \
    X(cuArrayDestroy, cuArrayDestroy, 0, 0, (CUarray))                                  \
    X(cuMipmappedArrayDestroy, cuMipmappedArrayDestroy, 0, 0, (CUmipmappedArray))       \
    X(cuMemGetInfo, cuMemGetInfo, 0, 0, (unsigned int *, unsigned int *))               \
    X(cuMemGetInfo_v2, cuMemGetInfo, 3020, 0, (size_t *, size_t *))                     \
    X(cuDeviceTotalMem, cuDeviceTotalMem, 0, 0, (unsigned int *, CUdevice))             \
    X(cuDeviceTotalMem_v2, cuDeviceTotalMem, 3020, 0, (size_t *, CUdevice))             \
    X(cuLaunchKernel, cuLaunchKernel, 0, 0, VGPU_LAUNCH_PARAMS)                         \
    X(cuLaunchKernel_ptsz, cuLaunchKernel, 0, 1, VGPU_LAUNCH_PARAMS)                    \
    X(cuLaunchKernelEx, cuLaunchKernelEx, 0, 0,                                         \
      (const CUlaunchConfig *, CUfunction, void **, void **))                           \
    X(cuLaunchKernelEx_ptsz, cuLaunchKernelEx, 0, 1,                                    \
      (const CUlaunchConfig *, CUfunction, void **, void **))                           \
    X(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel, 0, 0, VGPU_COOP_PARAMS)     \
    X(cuLaunchCooperativeKernel_ptsz, cuLaunchCooperativeKernel, 0, 1, VGPU_COOP_PARAMS) \
    X(cuGraphLaunch, cuGraphLaunch, 0, 0, (CUgraphExec, CUstream))                      \
    X(cuGraphLaunch_ptsz, cuGraphLaunch, 0, 1, (CUgraphExec, CUstream))                 \
    X(cuGetProcAddress, cuGetProcAddress, 0, 0, (const char *, void **, int, cuuint64_t)) \
    X(cuGetProcAddress_v2, cuGetProcAddress, 12000, 0,                                  \
      (const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *))

/* One enum value per hook (VGPU_H_cuMemAlloc_v2, ...) and one function
 * pointer type per hook (cuMemAlloc_v2_fn, ...). */
#define VGPU_HOOK_ENUM(sym, base, since, ptsz, params) VGPU_H_##sym,
enum vgpu_hook_id { VGPU_HOOK_LIST(VGPU_HOOK_ENUM) VGPU_HOOK_COUNT };
#undef VGPU_HOOK_ENUM

#define VGPU_HOOK_TYPEDEF(sym, base, since, ptsz, params) typedef CUresult(*sym##_fn) params;
VGPU_HOOK_LIST(VGPU_HOOK_TYPEDEF)
#undef VGPU_HOOK_TYPEDEF

/* Naming metadata for one symbol (see the list above). */
struct vgpu_proc_name {
    const char *symbol;
    const char *base;
    int since;
    int ptsz;
};

/*
 * Which entry of `names` (n of them) cuGetProcAddress(base, version, flags)
 * designates: the newest one not newer than `version`, the per-thread-stream
 * variant when flags ask for it and one exists.  Returns -1 if none.
 */
static inline int vgpu_proc_pick(const struct vgpu_proc_name *names, int n, const char *base,
                                 int version, cuuint64_t flags)
{
    int want_ptsz = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    for (int pass = want_ptsz ? 0 : 1; pass < 2; pass++) {
        int best = -1;
        int ptsz = pass == 0;
        for (int i = 0; i < n; i++) {
            const struct vgpu_proc_name *e = &names[i];
            if (e->ptsz != ptsz || e->since > version || __builtin_strcmp(e->base, base) != 0)
                continue;
            if (best < 0 || e->since > names[best].since)
                best = i;
        }
        if (best >= 0)
            return best;
    }
    return -1;
}

#endif
