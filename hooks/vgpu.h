/* Internal interfaces of libvgpu; nothing here is exported. */
#ifndef VGPU_H
#define VGPU_H

#include <stdint.h>

#include "alloc_map.h"
#include "vgpu_hooks.h"

#define VGPU_EXPORT __attribute__((visibility("default")))
#define VGPU_MIB (1024ull * 1024ull)
#define VGPU_NO_LIMIT UINT64_MAX

/* ---- log.c / config.c ---- */
/* One line "vgpu: ..." on stderr.  `once` (may be NULL) makes it one-shot. */
void vgpu_log(int *once, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

struct vgpu_config {
    uint64_t memory_limit; /* bytes, or VGPU_NO_LIMIT */
    int core_percent;      /* 1..99, or 0 = no compute limit */
};
/* Reads $VGPU_CONFIG, else $VGPU_MEMORY_LIMIT_MIB / $VGPU_CORE_LIMIT. */
void vgpu_config_load(struct vgpu_config *cfg);

/* ---- init.c ---- */
extern struct vgpu_config vgpu_cfg;
void vgpu_init_slow(void);
extern int vgpu_ready;
static inline void vgpu_init(void)
{
    if (!__atomic_load_n(&vgpu_ready, __ATOMIC_ACQUIRE))
        vgpu_init_slow();
}

/* ---- resolve.c: the real driver, dlsym and cuGetProcAddress ---- */
#define VGPU_HOOK_DECL(sym, base, since, ptsz, params) VGPU_EXPORT CUresult sym params;
VGPU_HOOK_LIST(VGPU_HOOK_DECL)
#undef VGPU_HOOK_DECL
/* glibc's own dlsym (our exported dlsym interposes it). */
void *vgpu_dlsym_real(void *handle, const char *name);
void *vgpu_real(enum vgpu_hook_id id);
/* The driver's own cuCtxGetDevice, for attributing allocations. */
int vgpu_current_device(void);
/* Our wrapper for a pointer the driver handed out for `symbol`, or `p`. */
void *vgpu_wrap_proc(const char *symbol, void *p, int version, cuuint64_t flags);

#define VGPU_REAL(sym, ...)                                                      \
    ({                                                                           \
        sym##_fn real_ = (sym##_fn)vgpu_real(VGPU_H_##sym);                      \
        real_ ? real_(__VA_ARGS__) : CUDA_ERROR_NOT_INITIALIZED;                 \
    })

/* ---- budget.c: the container-wide memory budget ---- */
void vgpu_budget_attach(void);  /* once, from init */
void vgpu_budget_after_fork(void);
/* Reserve `bytes` on `dev`; 0 on success, -1 if over the limit. */
int vgpu_budget_reserve(int dev, uint64_t bytes);
void vgpu_budget_release(int dev, uint64_t bytes);
/* Bytes the whole container holds on `dev` (after reclaiming dead slots). */
uint64_t vgpu_budget_used(int dev);
/* Pids of the container's live processes; returns how many (<= max). */
int vgpu_budget_pids(int *pids, int max);

/* ---- memory.c ---- */
void vgpu_memory_after_fork(void);

/* ---- throttle.c ---- */
void vgpu_throttle_wait(void); /* before each kernel launch */
void vgpu_throttle_after_fork(void);

#endif
