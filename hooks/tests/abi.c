/*
 * The hook's hand-declared CUDA/NVML ABI, printed as JSON (tests/hooks/test_headers.py).
 * Built twice: against the hook's own cuda_types.h / nvml_types.h, and with
 * -DVGPU_REAL_HEADERS against the CUDA toolkit's cuda.h and cudaTypedefs.h (and
 * nvml.h with -DVGPU_REAL_NVML); the two outputs must agree.  The real build
 * also checks every intercepted entry point's signature against the driver's
 * PFN_<name>_v<version> type, so a wrong parameter fails to compile.
 */
#include <stddef.h>
#include <stdio.h>

#ifdef VGPU_REAL_HEADERS
#define __CUDA_API_VERSION_INTERNAL 1 /* the legacy (v1) declarations too */
#include <cuda.h>
#include <cudaTypedefs.h>
#define VGPU_CUDA_TYPES_H /* the hook's list below then uses the real types */
#ifdef VGPU_REAL_NVML
#include <nvml.h>
#define VGPU_NVML_TYPES_H
#endif
#endif
#include "../vgpu_hooks.h"

#ifdef VGPU_REAL_HEADERS
#define PFN_0(base, since) PFN_##base##_v##since
#define PFN_1(base, since) PFN_##base##_v##since##_ptsz
#define PFN(base, since, ptsz) PFN_##ptsz(base, since)
#define CHECK(sym, base, since, until, ptsz, params)                                             \
    _Static_assert(__builtin_types_compatible_p(sym##_fn, PFN(base, since, ptsz)),              \
                   #sym ": the hook's parameters differ from PFN_" #base "_v" #since);
VGPU_HOOK_LIST(CHECK)
#ifdef VGPU_ABI_SELFTEST /* a deliberate mismatch: the check must catch it */
CHECK(cuMemAlloc_v2, cuMemGetInfo, 3020, 0, 0, ())
#endif
#define REAL "real"
#else
#define REAL "ours"
#endif

#define SIZE(t) printf("%s\"sizeof %s\": %zu", sep(), #t, sizeof(t))
#define OFF(t, f) printf("%s\"%s.%s\": %zu", sep(), #t, #f, offsetof(t, f))
#define VALUE(v) printf("%s\"%s\": %lld", sep(), #v, (long long)(v))

static const char *sep(void)
{
    static int n;
    return n++ ? ", " : "";
}

int main(void)
{
    printf("{\"headers\": \"" REAL "\", ");
    SIZE(CUresult);
    SIZE(CUdevice);
    SIZE(CUdeviceptr);
    SIZE(CUdeviceptr_v1);
    SIZE(CUmemGenericAllocationHandle);
    SIZE(CUuuid);
    SIZE(CUDA_ARRAY_DESCRIPTOR);
    OFF(CUDA_ARRAY_DESCRIPTOR, Height);
    OFF(CUDA_ARRAY_DESCRIPTOR, Format);
    OFF(CUDA_ARRAY_DESCRIPTOR, NumChannels);
    SIZE(CUDA_ARRAY_DESCRIPTOR_v1);
    OFF(CUDA_ARRAY_DESCRIPTOR_v1, Format);
    OFF(CUDA_ARRAY_DESCRIPTOR_v1, NumChannels);
    SIZE(CUDA_ARRAY3D_DESCRIPTOR);
    OFF(CUDA_ARRAY3D_DESCRIPTOR, Depth);
    OFF(CUDA_ARRAY3D_DESCRIPTOR, Format);
    OFF(CUDA_ARRAY3D_DESCRIPTOR, NumChannels);
    SIZE(CUDA_ARRAY3D_DESCRIPTOR_v1);
    OFF(CUDA_ARRAY3D_DESCRIPTOR_v1, Depth);
    OFF(CUDA_ARRAY3D_DESCRIPTOR_v1, Format);
    SIZE(CUmemLocation);
    OFF(CUmemLocation, id);
    SIZE(CUmemAllocationProp);
    OFF(CUmemAllocationProp, location);
    SIZE(CUmemPoolProps);
    OFF(CUmemPoolProps, location);
    VALUE(CUDA_SUCCESS);
    VALUE(CUDA_ERROR_INVALID_VALUE);
    VALUE(CUDA_ERROR_OUT_OF_MEMORY);
    VALUE(CUDA_ERROR_NOT_INITIALIZED);
    VALUE(CUDA_ERROR_INVALID_CONTEXT);
    VALUE(CUDA_ERROR_NOT_FOUND);
    VALUE(CUDA_ERROR_NOT_READY);
    VALUE(CUDA_ERROR_NOT_SUPPORTED);
    VALUE(CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
    VALUE(CU_MEM_LOCATION_TYPE_DEVICE);
    VALUE(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD);
    VALUE(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
    VALUE(CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
    VALUE(CU_AD_FORMAT_UNSIGNED_INT8);
    VALUE(CU_AD_FORMAT_SIGNED_INT16);
    VALUE(CU_AD_FORMAT_HALF);
    VALUE(CU_AD_FORMAT_FLOAT);
    printf("%s\"nvml\": {", sep());
    printf("\"nvmlMemory_t\": [%zu, %zu, %zu, %zu], ", sizeof(nvmlMemory_t),
           offsetof(nvmlMemory_t, total), offsetof(nvmlMemory_t, free), offsetof(nvmlMemory_t, used));
    printf("\"nvmlMemory_v2_t\": [%zu, %zu, %zu, %zu, %zu, %zu], ", sizeof(nvmlMemory_v2_t),
           offsetof(nvmlMemory_v2_t, version), offsetof(nvmlMemory_v2_t, total),
           offsetof(nvmlMemory_v2_t, reserved), offsetof(nvmlMemory_v2_t, free),
           offsetof(nvmlMemory_v2_t, used));
    printf("\"nvmlProcessInfo_v1_t\": [%zu, %zu, %zu], ", sizeof(nvmlProcessInfo_v1_t),
           offsetof(nvmlProcessInfo_v1_t, pid), offsetof(nvmlProcessInfo_v1_t, usedGpuMemory));
    printf("\"nvmlProcessInfo_v2_t\": [%zu, %zu, %zu, %zu, %zu], ", sizeof(nvmlProcessInfo_v2_t),
           offsetof(nvmlProcessInfo_v2_t, pid), offsetof(nvmlProcessInfo_v2_t, usedGpuMemory),
           offsetof(nvmlProcessInfo_v2_t, gpuInstanceId),
           offsetof(nvmlProcessInfo_v2_t, computeInstanceId));
    printf("\"nvmlUtilization_t\": [%zu, %zu, %zu], ", sizeof(nvmlUtilization_t),
           offsetof(nvmlUtilization_t, gpu), offsetof(nvmlUtilization_t, memory));
    printf("\"nvmlProcessUtilizationSample_t\": [%zu, %zu, %zu, %zu], ",
           sizeof(nvmlProcessUtilizationSample_t), offsetof(nvmlProcessUtilizationSample_t, pid),
           offsetof(nvmlProcessUtilizationSample_t, timeStamp),
           offsetof(nvmlProcessUtilizationSample_t, smUtil));
    printf("\"NVML_SUCCESS\": %d, \"NVML_ERROR_NOT_SUPPORTED\": %d, \"NVML_ERROR_NOT_FOUND\": %d, "
           "\"NVML_ERROR_INSUFFICIENT_SIZE\": %d}}\n", NVML_SUCCESS, NVML_ERROR_NOT_SUPPORTED,
           NVML_ERROR_NOT_FOUND, NVML_ERROR_INSUFFICIENT_SIZE);
    return 0;
}
