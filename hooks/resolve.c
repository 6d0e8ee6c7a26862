/*
 * Finding the real driver and NVML, and handing our wrappers to every caller:
 *  - direct calls reach our exported cu* / nvml* symbols (LD_PRELOAD comes first);
 *  - dlopen + dlsym: our exported dlsym returns the wrapper for a hooked
 *    name the handle can resolve and forwards everything else to the C
 *    library's dlsym;
 *  - cuGetProcAddress(_v2): we ask the driver, then swap its answer for our
 *    wrapper only when the answer is exactly a hooked function: the same
 *    address as the exported symbol, or a (name, version, flags) pair our
 *    table maps to it (vgpu_hooks.h).  Anything else passes through.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <string.h>

#include "vgpu.h"

#define CUDA_LIBRARY "libcuda.so.1"
#define NVML_LIBRARY "libnvidia-ml.so.1"
#define MISSING ((void *)1) /* the library lacks this symbol */

typedef void *(*dlsym_fn)(void *, const char *);

struct proc_name {
    const char *symbol;
    const char *base;
    int since, until, ptsz;
};
#define NAME_ENTRY(sym, base, since, until, ptsz, params) {#sym, #base, since, until, ptsz},
static const struct proc_name hook_names[VGPU_HOOK_COUNT] = {VGPU_HOOK_LIST(NAME_ENTRY)};
#define WRAPPER_ENTRY(sym, base, since, until, ptsz, params) (void *)&sym,
static void *const hook_wrappers[VGPU_HOOK_COUNT] = {VGPU_HOOK_LIST(WRAPPER_ENTRY)};
static void *hook_real[VGPU_HOOK_COUNT];

#define NVML_NAME(sym, params) #sym,
static const char *const nvml_names[VGPU_NVML_HOOK_COUNT] = {VGPU_NVML_HOOK_LIST(NVML_NAME)};
#define NVML_WRAPPER(sym, params) (void *)&sym,
static void *const nvml_wrappers[VGPU_NVML_HOOK_COUNT] = {VGPU_NVML_HOOK_LIST(NVML_WRAPPER)};
static void *nvml_real[VGPU_NVML_HOOK_COUNT];

static dlsym_fn real_dlsym_fn;
static void *cuda_handle, *nvml_handle;

/* glibc-only symbols, weak: in a musl image they are absent, the library
 * still loads and the process still starts. */
extern void *dlvsym(void *, const char *, const char *) __attribute__((weak));

/* ---- the C library's dlsym ---- */

static uint32_t gnu_hash(const char *s)
{
    uint32_t h = 5381;
    for (; *s; s++)
        h = h * 33 + (unsigned char)*s;
    return h;
}

static uint32_t sysv_hash(const char *s)
{
    uint32_t h = 0, g;
    for (; *s; s++) {
        h = (h << 4) + (unsigned char)*s;
        g = h & 0xf0000000u;
        h ^= g >> 24;
        h &= ~g;
    }
    return h;
}

struct dlsym_search {
    const void *self; /* an address inside libvgpu */
    void *found;
};

/* Looks `dlsym` up in one loaded object's dynamic symbol table. */
static int find_dlsym(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    struct dlsym_search *search = arg;
    const ElfW(Dyn) *dyn = NULL;
    int mine = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uintptr_t lo = info->dlpi_addr + ph->p_vaddr;
        if (ph->p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)lo;
        if (ph->p_type == PT_LOAD && (uintptr_t)search->self >= lo &&
            (uintptr_t)search->self < lo + ph->p_memsz)
            mine = 1;
    }
    if (!dyn || mine)
        return 0;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const uint32_t *hash = NULL, *gnu = NULL;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        uintptr_t v = dyn->d_un.d_ptr;
        if (v < info->dlpi_addr) /* glibc relocates these entries; musl does not */
            v += info->dlpi_addr;
        if (dyn->d_tag == DT_SYMTAB)
            symtab = (const ElfW(Sym) *)v;
        else if (dyn->d_tag == DT_STRTAB)
            strtab = (const char *)v;
        else if (dyn->d_tag == DT_HASH)
            hash = (const uint32_t *)v;
        else if (dyn->d_tag == DT_GNU_HASH)
            gnu = (const uint32_t *)v;
    }
    if (!symtab || !strtab)
        return 0;
    const char *name = "dlsym";
    const ElfW(Sym) *hit = NULL;
    if (gnu) {
        uint32_t nbuckets = gnu[0], symoffset = gnu[1], bloom_size = gnu[2];
        const uint32_t *buckets = gnu + 4 + bloom_size * (sizeof(ElfW(Addr)) / 4);
        const uint32_t *chain = buckets + nbuckets;
        uint32_t h = gnu_hash(name);
        for (uint32_t i = nbuckets ? buckets[h % nbuckets] : 0; i >= symoffset && i; i++) {
            uint32_t ch = chain[i - symoffset];
            if ((ch | 1) == (h | 1) && strcmp(strtab + symtab[i].st_name, name) == 0) {
                hit = &symtab[i];
                break;
            }
            if (ch & 1)
                break;
        }
    } else if (hash) {
        uint32_t nbucket = hash[0];
        const uint32_t *bucket = hash + 2, *chain = bucket + nbucket;
        for (uint32_t i = nbucket ? bucket[sysv_hash(name) % nbucket] : 0; i; i = chain[i])
            if (strcmp(strtab + symtab[i].st_name, name) == 0) {
                hit = &symtab[i];
                break;
            }
    }
    if (!hit || hit->st_shndx == SHN_UNDEF || ELF64_ST_TYPE(hit->st_info) != STT_FUNC)
        return 0;
    search->found = (void *)(info->dlpi_addr + hit->st_value);
    return 1;
}

/*
 * Lock-free lazy lookups (no pthread_once, no malloc): racing threads
 * compute the same value and store it twice, which is harmless.
 */
static inline dlsym_fn real_dlsym(void)
{
    dlsym_fn f = __atomic_load_n(&real_dlsym_fn, __ATOMIC_ACQUIRE);
    if (__builtin_expect(f == NULL, 0)) {
        if (dlvsym) { /* glibc: the newest version first, then the base one */
            f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
            if (!f)
                f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", VGPU_GLIBC_BASE);
        }
        if (!f) { /* another C library (musl): read the loaded objects' symbol tables */
            struct dlsym_search search = {(const void *)&real_dlsym_fn, NULL};
            dl_iterate_phdr(find_dlsym, &search);
            f = (dlsym_fn)search.found;
        }
        __atomic_store_n(&real_dlsym_fn, f, __ATOMIC_RELEASE);
    }
    return f;
}

void *vgpu_dlsym_real(void *handle, const char *name)
{
    dlsym_fn f = real_dlsym();
    return f ? f(handle, name) : NULL;
}

/* A library the process has loaded; NULL (and retried later) until it has. */
static void *loaded(void **cache, const char *library)
{
    void *h = __atomic_load_n(cache, __ATOMIC_ACQUIRE);
    if (!h) {
        h = dlopen(library, RTLD_LAZY | RTLD_NOLOAD);
        if (h && !__atomic_compare_exchange_n(cache, &(void *){NULL}, h, 0, __ATOMIC_ACQ_REL,
                                              __ATOMIC_ACQUIRE))
            dlclose(h); /* another thread won; keep one reference */
        h = __atomic_load_n(cache, __ATOMIC_ACQUIRE);
    }
    return h;
}

static void *lookup(void **slot, void **cache, const char *library, const char *name)
{
    void *p = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (__builtin_expect(p == NULL, 0)) {
        void *h = loaded(cache, library);
        if (!h)
            return NULL;
        p = vgpu_dlsym_real(h, name);
        __atomic_store_n(slot, p ? p : MISSING, __ATOMIC_RELEASE);
    }
    return p == MISSING ? NULL : p;
}

void *vgpu_real(enum vgpu_hook_id id)
{
    return lookup(&hook_real[id], &cuda_handle, CUDA_LIBRARY, hook_names[id].symbol);
}

void *vgpu_nvml_real(enum vgpu_nvml_hook_id id)
{
    return lookup(&nvml_real[id], &nvml_handle, NVML_LIBRARY, nvml_names[id]);
}

void *vgpu_cuda_sym(const char *name)
{
    void *h = loaded(&cuda_handle, CUDA_LIBRARY);
    return h ? vgpu_dlsym_real(h, name) : NULL;
}

/* ---- cuGetProcAddress ---- */

/* The entry our table maps (base, version, flags) to, or -1. */
static int proc_pick(const char *base, int version, cuuint64_t flags)
{
    int want_ptsz = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    if (version > VGPU_PROC_KNOWN_MAX)
        return -1;
    for (int pass = want_ptsz ? 0 : 1; pass < 2; pass++)
        for (int i = 0; i < VGPU_HOOK_COUNT; i++) {
            const struct proc_name *e = &hook_names[i];
            if (e->ptsz == (pass == 0) && version >= e->since &&
                (e->until == 0 || version < e->until) && strcmp(e->base, base) == 0)
                return i;
        }
    return -1;
}

static int hooked_base(const char *base)
{
    for (int i = 0; i < VGPU_HOOK_COUNT; i++)
        if (strcmp(hook_names[i].base, base) == 0)
            return 1;
    return 0;
}

typedef CUresult (*get_proc_fn)(const char *, void **, int, cuuint64_t);

void *vgpu_wrap_proc(const char *symbol, void *p, int version, cuuint64_t flags)
{
    static int logged;
    for (int i = 0; i < VGPU_HOOK_COUNT; i++)
        if (vgpu_real((enum vgpu_hook_id)i) == p || hook_wrappers[i] == p) {
            VGPU_TRACE("cuGetProcAddress(%s, %d, %llu): %s by address", symbol, version,
                       (unsigned long long)flags, hook_names[i].symbol);
            return hook_wrappers[i];
        }
    if (!symbol)
        return p;
    /* The driver may hand out an internal address: the table decides. */
    int i = proc_pick(symbol, version, flags);
    if (i < 0 && version > VGPU_PROC_KNOWN_MAX && hooked_base(symbol)) {
        /* Newer than the table: the same function as for the newest known
         * version is the same ABI; anything else is not ours to wrap. */
        get_proc_fn get = (get_proc_fn)vgpu_real(VGPU_H_cuGetProcAddress);
        void *known = NULL;
        if (get && get(symbol, &known, VGPU_PROC_KNOWN_MAX, flags) == CUDA_SUCCESS && known == p)
            i = proc_pick(symbol, VGPU_PROC_KNOWN_MAX, flags);
        if (i < 0)
            vgpu_log(&logged, "cuGetProcAddress(%s, %d): an entry point newer than this hook; "
                     "passed through without limits", symbol, version);
    }
    if (i >= 0 && vgpu_real((enum vgpu_hook_id)i)) {
        VGPU_TRACE("cuGetProcAddress(%s, %d, %llu): %s by name", symbol, version,
                   (unsigned long long)flags, hook_names[i].symbol);
        return hook_wrappers[i];
    }
    VGPU_TRACE("cuGetProcAddress(%s, %d, %llu): passed through", symbol, version,
               (unsigned long long)flags);
    return p;
}

/* ---- dlsym ---- */

static int hook_index(const char *name)
{
    for (int i = 0; i < VGPU_HOOK_COUNT; i++)
        if (strcmp(hook_names[i].symbol, name) == 0)
            return i;
    return -1;
}

static int nvml_index(const char *name)
{
    for (int i = 0; i < VGPU_NVML_HOOK_COUNT; i++)
        if (strcmp(nvml_names[i], name) == 0)
            return i;
    return -1;
}

/* The wrapper for a hooked name that `handle` can resolve, else NULL. */
static __attribute__((noinline)) void *hooked_dlsym(void *handle, const char *name)
{
    void *wrapper = NULL, *real = NULL;
    int i;
    if (name[0] == 'c') {
        if ((i = hook_index(name)) < 0)
            return NULL;
        wrapper = hook_wrappers[i];
        if (handle == RTLD_NEXT) /* relative to the caller, whom we cannot see here */
            real = vgpu_real((enum vgpu_hook_id)i);
    } else {
        if ((i = nvml_index(name)) < 0)
            return NULL;
        wrapper = nvml_wrappers[i];
        if (handle == RTLD_NEXT)
            real = vgpu_nvml_real((enum vgpu_nvml_hook_id)i);
    }
    if (handle != RTLD_NEXT)
        real = vgpu_dlsym_real(handle, name);
    VGPU_TRACE("dlsym(%s): %s", name, real ? "wrapped" : "not in that library");
    return real ? wrapper : NULL;
}

VGPU_EXPORT void *dlsym(void *handle, const char *name)
{
    const char *n = name;
    __asm__("" : "+r"(n)); /* glibc declares name nonnull; callers may still pass NULL */
    if (n && ((n[0] == 'c' && n[1] == 'u') || (n[0] == 'n' && n[1] == 'v' && n[2] == 'm'))) {
        void *w = hooked_dlsym(handle, name);
        if (w)
            return w;
    }
    /*
     * Must stay a tail call (the build checks the jmp): the C library's dlsym
     * takes the caller from its return address, and RTLD_NEXT must be
     * resolved relative to whoever called us, not relative to libvgpu.
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
