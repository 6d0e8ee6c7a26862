/*
 * The intercepted driver entry points, as one X-macro list:
 *   X(symbol, base name, since, until, per-thread-stream variant, params)
 * cuGetProcAddress(base, cudaVersion, flags) designates `symbol` for every
 * cudaVersion in [since, until) (until 0: up to VGPU_PROC_KNOWN_MAX), as
 * the driver's own table does (cudaTypedefs.h: PFN_<base>_v<since>).  The
 * hook hands out its wrapper only for those pairs: a (base, version) pair
 * outside them may designate an ABI the wrapper was not written for.
 * tests/hooks/test_headers.py checks this list against the CUDA headers.
 * The stand-in driver keeps a table of its own (tests/fake_cuda.c).
 */
#ifndef VGPU_HOOKS_H
#define VGPU_HOOKS_H

#include "cuda_types.h"

/* The newest cudaVersion whose (base, version) mapping this list was checked against. */
#define VGPU_PROC_KNOWN_MAX 13000

#define VGPU_LAUNCH_PARAMS                                                       \
    (CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,        \
     unsigned int, unsigned int, unsigned int, CUstream, void **, void **)
#define VGPU_COOP_PARAMS                                                         \
    (CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,        \
     unsigned int, unsigned int, unsigned int, CUstream, void **)
#define VGPU_ALLOC_ASYNC_PARAMS (CUdeviceptr *, size_t, CUstream)
#define VGPU_POOL_ASYNC_PARAMS (CUdeviceptr *, size_t, CUmemoryPool, CUstream)
#define VGPU_CTX_CREATE_PARAMS (CUcontext *, unsigned int, CUdevice)

#define VGPU_HOOK_LIST(X)                                                                \
    X(cuMemAlloc, cuMemAlloc, 2000, 3020, 0, (CUdeviceptr_v1 *, unsigned int))          \
    X(cuMemAlloc_v2, cuMemAlloc, 3020, 0, 0, (CUdeviceptr *, size_t))                   \
    X(cuMemAllocPitch, cuMemAllocPitch, 2000, 3020, 0,                                  \
      (CUdeviceptr_v1 *, unsigned int *, unsigned int, unsigned int, unsigned int))     \
    X(cuMemAllocPitch_v2, cuMemAllocPitch, 3020, 0, 0,                                  \
      (CUdeviceptr *, size_t *, size_t, size_t, unsigned int))                          \
    X(cuMemAllocManaged, cuMemAllocManaged, 6000, 0, 0, (CUdeviceptr *, size_t, unsigned int)) \
    X(cuMemAllocAsync, cuMemAllocAsync, 11020, 0, 0, VGPU_ALLOC_ASYNC_PARAMS)           \
    X(cuMemAllocAsync_ptsz, cuMemAllocAsync, 11020, 0, 1, VGPU_ALLOC_ASYNC_PARAMS)      \
    X(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync, 11020, 0, 0, VGPU_POOL_ASYNC_PARAMS) \
    X(cuMemAllocFromPoolAsync_ptsz, cuMemAllocFromPoolAsync, 11020, 0, 1,               \
      VGPU_POOL_ASYNC_PARAMS)                                                           \
    X(cuMemCreate, cuMemCreate, 10020, 0, 0,                                            \
      (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,             \
       unsigned long long))                                                             \
    X(cuMemMap, cuMemMap, 10020, 0, 0,                                                  \
      (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))  \
    X(cuMemUnmap, cuMemUnmap, 10020, 0, 0, (CUdeviceptr, size_t))                       \
    X(cuMemPoolCreate, cuMemPoolCreate, 11020, 0, 0, (CUmemoryPool *, const CUmemPoolProps *)) \
    X(cuMemPoolDestroy, cuMemPoolDestroy, 11020, 0, 0, (CUmemoryPool))                  \
    X(cuMemPoolTrimTo, cuMemPoolTrimTo, 11020, 0, 0, (CUmemoryPool, size_t))            \
    X(cuArrayCreate, cuArrayCreate, 2000, 3020, 0, (CUarray *, const CUDA_ARRAY_DESCRIPTOR_v1 *)) \
    X(cuArrayCreate_v2, cuArrayCreate, 3020, 0, 0, (CUarray *, const CUDA_ARRAY_DESCRIPTOR *)) \
    X(cuArray3DCreate, cuArray3DCreate, 2000, 3020, 0,                                  \
      (CUarray *, const CUDA_ARRAY3D_DESCRIPTOR_v1 *))                                  \
    X(cuArray3DCreate_v2, cuArray3DCreate, 3020, 0, 0,                                  \
      (CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *))                                     \
    X(cuMipmappedArrayCreate, cuMipmappedArrayCreate, 5000, 0, 0,                       \
      (CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned int))              \
    X(cuMemFree, cuMemFree, 2000, 3020, 0, (CUdeviceptr_v1))                            \
    X(cuMemFree_v2, cuMemFree, 3020, 0, 0, (CUdeviceptr))                               \
    X(cuMemFreeAsync, cuMemFreeAsync, 11020, 0, 0, (CUdeviceptr, CUstream))             \
    X(cuMemFreeAsync_ptsz, cuMemFreeAsync, 11020, 0, 1, (CUdeviceptr, CUstream))        \
    X(cuMemRelease, cuMemRelease, 10020, 0, 0, (CUmemGenericAllocationHandle))          \
    X(cuArrayDestroy, cuArrayDestroy, 2000, 0, 0, (CUarray))                            \
    X(cuMipmappedArrayDestroy, cuMipmappedArrayDestroy, 5000, 0, 0, (CUmipmappedArray)) \
    X(cuMemGetInfo, cuMemGetInfo, 2000, 3020, 0, (unsigned int *, unsigned int *))      \
    X(cuMemGetInfo_v2, cuMemGetInfo, 3020, 0, 0, (size_t *, size_t *))                  \
    X(cuDeviceTotalMem, cuDeviceTotalMem, 2000, 3020, 0, (unsigned int *, CUdevice))    \
    X(cuDeviceTotalMem_v2, cuDeviceTotalMem, 3020, 0, 0, (size_t *, CUdevice))          \
    X(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, 7000, 0, 0, (CUcontext *, CUdevice)) \
    X(cuCtxCreate, cuCtxCreate, 2000, 3020, 0, VGPU_CTX_CREATE_PARAMS)                  \
    X(cuCtxCreate_v2, cuCtxCreate, 3020, 11040, 0, VGPU_CTX_CREATE_PARAMS)              \
    X(cuCtxCreate_v3, cuCtxCreate, 11040, 12050, 0,                                     \
      (CUcontext *, CUexecAffinityParam *, int, unsigned int, CUdevice))                \
    X(cuCtxCreate_v4, cuCtxCreate, 12050, 0, 0,                                         \
      (CUcontext *, CUctxCreateParams *, unsigned int, CUdevice))                       \
    X(cuLaunchKernel, cuLaunchKernel, 4000, 0, 0, VGPU_LAUNCH_PARAMS)                   \
    X(cuLaunchKernel_ptsz, cuLaunchKernel, 7000, 0, 1, VGPU_LAUNCH_PARAMS)              \
    X(cuLaunchKernelEx, cuLaunchKernelEx, 11060, 0, 0,                                  \
      (const CUlaunchConfig *, CUfunction, void **, void **))                           \
    X(cuLaunchKernelEx_ptsz, cuLaunchKernelEx, 11060, 0, 1,                             \
      (const CUlaunchConfig *, CUfunction, void **, void **))                           \
    X(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel, 9000, 0, 0, VGPU_COOP_PARAMS) \
    X(cuLaunchCooperativeKernel_ptsz, cuLaunchCooperativeKernel, 9000, 0, 1, VGPU_COOP_PARAMS) \
    X(cuLaunch, cuLaunch, 2000, 0, 0, (CUfunction))                                     \
    X(cuLaunchGrid, cuLaunchGrid, 2000, 0, 0, (CUfunction, int, int))                   \
    X(cuLaunchGridAsync, cuLaunchGridAsync, 2000, 0, 0, (CUfunction, int, int, CUstream)) \
    X(cuGraphLaunch, cuGraphLaunch, 10000, 0, 0, (CUgraphExec, CUstream))               \
    X(cuGraphLaunch_ptsz, cuGraphLaunch, 10000, 0, 1, (CUgraphExec, CUstream))          \
    X(cuGetProcAddress, cuGetProcAddress, 11030, 12000, 0,                              \
      (const char *, void **, int, cuuint64_t))                                         \
    X(cuGetProcAddress_v2, cuGetProcAddress, 12000, 0, 0,                               \
      (const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *))

/* One enum value per hook (VGPU_H_cuMemAlloc_v2, ...) and one function
 * pointer type per hook (cuMemAlloc_v2_fn, ...). */
#define VGPU_HOOK_ENUM(sym, base, since, until, ptsz, params) VGPU_H_##sym,
enum vgpu_hook_id { VGPU_HOOK_LIST(VGPU_HOOK_ENUM) VGPU_HOOK_COUNT };
#undef VGPU_HOOK_ENUM

#define VGPU_HOOK_TYPEDEF(sym, base, since, until, ptsz, params) typedef CUresult(*sym##_fn) params;
VGPU_HOOK_LIST(VGPU_HOOK_TYPEDEF)
#undef VGPU_HOOK_TYPEDEF

/*
 * The NVML entry points the hook intercepts (what nvidia-smi, pynvml and
 * gpustat read): memory information and running-process lists.
 *   NX(symbol, params)
 */
#include "nvml_types.h"
#define VGPU_NVML_HOOK_LIST(NX)                                                          \
    NX(nvmlDeviceGetMemoryInfo, (nvmlDevice_t, nvmlMemory_t *))                          \
    NX(nvmlDeviceGetMemoryInfo_v2, (nvmlDevice_t, nvmlMemory_v2_t *))                    \
    NX(nvmlDeviceGetComputeRunningProcesses, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_v1_t *)) \
    NX(nvmlDeviceGetComputeRunningProcesses_v2, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_v2_t *)) \
    NX(nvmlDeviceGetComputeRunningProcesses_v3, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_v2_t *)) \
    NX(nvmlDeviceGetGraphicsRunningProcesses, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_v1_t *)) \
    NX(nvmlDeviceGetGraphicsRunningProcesses_v2, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_v2_t *)) \
    NX(nvmlDeviceGetGraphicsRunningProcesses_v3, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_v2_t *)) \
    NX(nvmlDeviceGetMPSComputeRunningProcesses, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_v1_t *)) \
    NX(nvmlDeviceGetMPSComputeRunningProcesses_v2, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_v2_t *)) \
    NX(nvmlDeviceGetMPSComputeRunningProcesses_v3, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_v2_t *))

#define VGPU_NVML_ENUM(sym, params) VGPU_N_##sym,
enum vgpu_nvml_hook_id { VGPU_NVML_HOOK_LIST(VGPU_NVML_ENUM) VGPU_NVML_HOOK_COUNT };
#undef VGPU_NVML_ENUM

#define VGPU_NVML_TYPEDEF(sym, params) typedef nvmlReturn_t(*sym##_fn) params;
VGPU_NVML_HOOK_LIST(VGPU_NVML_TYPEDEF)
#undef VGPU_NVML_TYPEDEF

#endif
