/*
 * Finding the real driver, and handing our wrappers to every caller:
 *  - direct calls reach our exported cu* symbols (LD_PRELOAD comes first);
 *  - dlopen("libcuda.so.1") + dlsym: our exported dlsym returns the wrapper
 *    for a hooked name and forwards everything else to glibc's dlsym;
 *  - cuGetProcAddress(_v2): we ask the driver, then swap a pointer to a
 *    hooked function for our wrapper (by address, else by name+version).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "vgpu.h"
#include "vgpu_shared.h"

#if defined(__x86_64__)
#define DLSYM_BASE_VERSION "GLIBC_2.2.5"
#elif defined(__aarch64__)
#define DLSYM_BASE_VERSION "GLIBC_2.17"
#else
#error "set DLSYM_BASE_VERSION: the glibc symbol version of dlsym on this architecture"
#endif

#define CUDA_LIBRARY "libcuda.so.1"
#define MISSING ((void *)1) /* the driver lacks this symbol */

typedef void *(*dlsym_fn)(void *, const char *);
typedef CUresult (*ctx_get_device_fn)(CUdevice *);

#define NAME_ENTRY(sym, base, since, ptsz, params) {#sym, #base, since, ptsz},
static const struct vgpu_proc_name hook_names[VGPU_HOOK_COUNT] = {VGPU_HOOK_LIST(NAME_ENTRY)};
#define WRAPPER_ENTRY(sym, base, since, ptsz, params) (void *)&sym,
static void *const hook_wrappers[VGPU_HOOK_COUNT] = {VGPU_HOOK_LIST(WRAPPER_ENTRY)};
static void *hook_real[VGPU_HOOK_COUNT];

static dlsym_fn real_dlsym_fn;
static void *cuda_handle;
static ctx_get_device_fn real_ctx_get_device;

/*
 * Lock-free lazy lookups (no pthread_once, no malloc): racing threads
 * compute the same value and store it twice, which is harmless.
 */
static inline dlsym_fn real_dlsym(void)
{
    dlsym_fn f = __atomic_load_n(&real_dlsym_fn, __ATOMIC_ACQUIRE);
    if (__builtin_expect(f == NULL, 0)) {
        f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
        if (!f)
            f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", DLSYM_BASE_VERSION);
        __atomic_store_n(&real_dlsym_fn, f, __ATOMIC_RELEASE);
    }
    return f;
}

void *vgpu_dlsym_real(void *handle, const char *name)
{
    return real_dlsym()(handle, name);
}

/* The driver the process has loaded; NULL (and retried later) until it has. */
static void *cuda(void)
{
    void *h = __atomic_load_n(&cuda_handle, __ATOMIC_ACQUIRE);
    if (!h) {
        h = dlopen(CUDA_LIBRARY, RTLD_LAZY | RTLD_NOLOAD);
        if (h && !__atomic_compare_exchange_n(&cuda_handle, &(void *){NULL}, h, 0,
                                              __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            dlclose(h); /* another thread won; keep one reference */
        h = __atomic_load_n(&cuda_handle, __ATOMIC_ACQUIRE);
    }
    return h;
}

void *vgpu_real(enum vgpu_hook_id id)
{
    void *p = __atomic_load_n(&hook_real[id], __ATOMIC_ACQUIRE);
    if (__builtin_expect(p == NULL, 0)) {
        void *h = cuda();
        if (!h)
            return NULL;
        p = real_dlsym()(h, hook_names[id].symbol);
        __atomic_store_n(&hook_real[id], p ? p : MISSING, __ATOMIC_RELEASE);
    }
    return p == MISSING ? NULL : p;
}

int vgpu_current_device(void)
{
    ctx_get_device_fn f = __atomic_load_n(&real_ctx_get_device, __ATOMIC_ACQUIRE);
    if (!f) {
        void *h = cuda();
        f = h ? (ctx_get_device_fn)real_dlsym()(h, "cuCtxGetDevice") : NULL;
        if (!f)
            return 0;
        __atomic_store_n(&real_ctx_get_device, f, __ATOMIC_RELEASE);
    }
    CUdevice dev = 0;
    if (f(&dev) != CUDA_SUCCESS || dev < 0)
        return 0;
    return dev < VGPU_MAX_DEVICES ? dev : VGPU_MAX_DEVICES - 1;
}

static int hook_index(const char *name)
{
    for (int i = 0; i < VGPU_HOOK_COUNT; i++)
        if (strcmp(hook_names[i].symbol, name) == 0)
            return i;
    return -1;
}

void *vgpu_wrap_proc(const char *symbol, void *p, int version, cuuint64_t flags)
{
    for (int i = 0; i < VGPU_HOOK_COUNT; i++)
        if (vgpu_real((enum vgpu_hook_id)i) == p || hook_wrappers[i] == p)
            return hook_wrappers[i];
    /* The driver may hand out an internal address: fall back to the name. */
    int i = symbol ? vgpu_proc_pick(hook_names, VGPU_HOOK_COUNT, symbol, version, flags) : -1;
    return i >= 0 && vgpu_real((enum vgpu_hook_id)i) ? hook_wrappers[i] : p;
}

/* The wrapper for a hooked name that `handle` can resolve, else NULL. */
static __attribute__((noinline)) void *hooked_dlsym(void *handle, const char *name)
{
    int i = hook_index(name);
    if (i < 0)
        return NULL;
    if (handle == RTLD_NEXT) /* relative to the caller, whom we cannot see here */
        return vgpu_real((enum vgpu_hook_id)i) ? hook_wrappers[i] : NULL;
    return real_dlsym()(handle, name) ? hook_wrappers[i] : NULL;
}

VGPU_EXPORT void *dlsym(void *handle, const char *name)
{
    const char *n = name;
    __asm__("" : "+r"(n)); /* glibc declares name nonnull; callers may still pass NULL */
    if (n && n[0] == 'c' && n[1] == 'u') {
        void *w = hooked_dlsym(handle, name);
        if (w)
            return w;
    }
    /*
     * Must stay a tail call (the build checks the jmp): glibc's dlsym takes
     * the caller from its return address, and RTLD_NEXT must be resolved
     * relative to whoever called us, not relative to libvgpu.
     */
    return real_dlsym()(handle, name);
}

VGPU_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    CUresult rc = VGPU_REAL(cuGetProcAddress, symbol, pfn, version, flags);
    if (rc == CUDA_SUCCESS && pfn && *pfn)
        *pfn = vgpu_wrap_proc(symbol, *pfn, version, flags);
    return rc;
}

VGPU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                                         cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    CUresult rc = VGPU_REAL(cuGetProcAddress_v2, symbol, pfn, version, flags, status);
    if (rc == CUDA_SUCCESS && pfn && *pfn)
        *pfn = vgpu_wrap_proc(symbol, *pfn, version, flags);
    return rc;
}
