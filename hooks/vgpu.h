/* Internal interfaces of libvgpu; nothing here is exported. */
#ifndef VGPU_H
#define VGPU_H

#include <stdint.h>
#include <time.h>

#include "alloc_map.h"
#include "vgpu_hooks.h"
#include "vgpu_shared.h"

/* CLOCK_MONOTONIC in nanoseconds (every timer and staleness check of the hook). */
static inline long long vgpu_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

#define VGPU_EXPORT __attribute__((visibility("default")))
#define VGPU_MIB (1024ull * 1024ull)
#define VGPU_NO_LIMIT UINT64_MAX

/* ---- config.c ---- */
/* One line "vgpu: ..." on stderr.  `once` (may be NULL) makes it one-shot. */
void vgpu_log(int *once, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* VGPU_LOG_LEVEL=trace (or debug): every intercepted call and decision on stderr. */
extern int vgpu_trace_on;
void vgpu_trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#define VGPU_TRACE(...)                                                                    \
    do {                                                                                   \
        if (__builtin_expect(vgpu_trace_on, 0))                                            \
            vgpu_trace(__VA_ARGS__);                                                       \
    } while (0)

struct vgpu_config {
    uint64_t memory_limit;     /* bytes per card, or VGPU_NO_LIMIT */
    int core_percent;          /* 1..99, or 0 = no compute limit */
    uint64_t context_overhead; /* bytes charged per process and card when NVML cannot measure it */
    int refuse;                /* fail-safe: no usable limits; contexts refused, memory limit 0 */
    const char *shared_dir;    /* the budget file's directory; NULL: a per-process budget */
    const char *visible;       /* the container's card names ("MIG-...,GPU-..."), or NULL */
};

/* A sliced container's files at their fixed mount points (vgpu/core/contract.py:
 * CONFIG_MOUNT, CONFIG_FILE, SHARED_MOUNT).  When VGPU_MOUNT_DIR exists the
 * mounted config is the one source of the limits, whatever the environment
 * says: a process started with `env -i` (through /etc/ld.so.preload) finds
 * the same limits, and no variable can widen them. */
#define VGPU_MOUNT_DIR "/etc/vgpu"
#define VGPU_MOUNT_CONFIG VGPU_MOUNT_DIR "/config.json"
#define VGPU_MOUNT_SHARED_DIR "/var/run/vgpu"

/* The limits, once per process (init.c):
 *  - VGPU_MOUNT_DIR present: VGPU_MOUNT_CONFIG, the budget in VGPU_MOUNT_SHARED_DIR,
 *    the card names from its "cards";
 *  - else $VGPU_CONFIG (file), $VGPU_SHARED_DIR, $NVIDIA_VISIBLE_DEVICES;
 *  - else $VGPU_MEMORY_LIMIT_MIB / $VGPU_CORE_LIMIT.
 * A config file that cannot be used (missing, not a regular file, a link, over
 * 64 KiB, not a JSON object, a limit that is not an integer in range) is
 * logged once and replaced by the environment's limits when it has any;
 * otherwise the process fails safe (`refuse`).  Always read:
 * $VGPU_CONTEXT_OVERHEAD_MIB and $VGPU_LOG_LEVEL. */
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

/* ---- resolve.c: the real driver and NVML, dlsym and cuGetProcAddress ---- */
#define VGPU_HOOK_DECL(sym, base, since, until, ptsz, params) VGPU_EXPORT CUresult sym params;
VGPU_HOOK_LIST(VGPU_HOOK_DECL)
#undef VGPU_HOOK_DECL
#define VGPU_NVML_DECL(sym, params) VGPU_EXPORT nvmlReturn_t sym params;
VGPU_NVML_HOOK_LIST(VGPU_NVML_DECL)
#undef VGPU_NVML_DECL
/* The C library's own dlsym (our exported dlsym interposes it). */
void *vgpu_dlsym_real(void *handle, const char *name);
void *vgpu_real(enum vgpu_hook_id id);
void *vgpu_nvml_real(enum vgpu_nvml_hook_id id);
/* A driver function the hook calls but does not intercept (NULL if absent). */
void *vgpu_cuda_sym(const char *name);
/* Our wrapper for a pointer the driver handed out for (symbol, version,
 * flags), or `p` itself. */
void *vgpu_wrap_proc(const char *symbol, void *p, int version, cuuint64_t flags);

#define VGPU_REAL(sym, ...)                                                      \
    ({                                                                           \
        sym##_fn real_ = (sym##_fn)vgpu_real(VGPU_H_##sym);                      \
        real_ ? real_(__VA_ARGS__) : CUDA_ERROR_NOT_INITIALIZED;                 \
    })

/* ---- budget.c: the container-wide memory budget, one entry per card ---- */
void vgpu_budget_after_fork(void);
/* The budget entry of a card UUID: found, else added when `add`; -1 if absent. */
int vgpu_budget_entry(const char *uuid, int add);
/* Whether any process of the container has a budget entry for this card
 * (lock-free): 1 yes, 0 no, -1 the container has no entry yet. */
int vgpu_budget_uses_card(const char *uuid);
/* Reserve `bytes` on entry `e`; 0 on success, -1 if over the limit. */
int vgpu_budget_reserve(int e, uint64_t bytes);
/* Charge `bytes` whatever the limit (memory the driver already took). */
void vgpu_budget_charge(int e, uint64_t bytes);
void vgpu_budget_release(int e, uint64_t bytes);
/* Bytes the whole container holds on entry `e` (after reclaiming dead slots). */
uint64_t vgpu_budget_used(int e);
struct vgpu_pid {
    int pid;           /* in the container */
    unsigned host_pid; /* as NVML reports it; 0 = not known */
    int slot;          /* its slot in the budget file */
};
/* The container's live processes; returns how many (<= max). */
int vgpu_budget_pids(struct vgpu_pid *out, int max);
/* The same without the lock or reclaiming dead slots (a racy snapshot, for
 * matching NVML's host pids: NVML does not list dead processes); out NULL:
 * only counts them. */
int vgpu_budget_peek_pids(struct vgpu_pid *out, int max);
/* The container's utilisation as its poller last published it (vgpu_shared.h). */
struct vgpu_poll {
    uint32_t seq;
    long long at_ns; /* CLOCK_MONOTONIC */
    int rc;          /* VGPU_POLL_* */
    double container, self; /* percent; self: this process's slot */
};
/* 0 and the publication, or -1 if there is none (or no shared file). */
int vgpu_budget_poll_read(struct vgpu_poll *out);
/* 1 if this process is (now) the container's poller (it stays so until it
 * dies), 0 if another process is, -1 without a shared file (poll alone). */
int vgpu_budget_poll_take(void);
/* The poller's publication: begin, each slot's share, end. */
void vgpu_budget_poll_begin(void);
void vgpu_budget_poll_slot(int slot, double percent);
void vgpu_budget_poll_end(int rc, double container_percent, long long at_ns);
/* This process's host pid, once learned (0 = not known); a host pid the node
 * daemon told for our slot is adopted here. */
void vgpu_budget_set_host_pid(unsigned host_pid);
unsigned vgpu_budget_host_pid(void);
/* 1 while the node daemon tells host pids for this file (a fresh heartbeat). */
int vgpu_budget_teller_alive(void);
/* Asks the node daemon to measure this process's memory on budget entry
 * `entry` (-1: nothing asked); the bytes it measured there, or -1 (none yet). */
void vgpu_budget_await_overhead(int entry);
long long vgpu_budget_measured_overhead(int entry);
/* The compute arbiter's word (vgpu_shared.h); 0 without a shared file. */
uint64_t vgpu_budget_arbiter(void);
/* A launch waited for tokens: counted in the file for the arbiter. */
void vgpu_budget_note_wait(void);

/* ---- device.c: devices, contexts and streams ---- */
/* The current context's device ordinal (0 if none). */
int vgpu_current_ordinal(void);
/* The budget entry of a device ordinal (keyed by the card's UUID). */
int vgpu_device_entry(int ordinal);
/* The device ordinal a stream belongs to. */
int vgpu_stream_ordinal(CUstream stream);
/* "GPU-..." (or the matching NVIDIA_VISIBLE_DEVICES entry) of an ordinal; 0 on success. */
int vgpu_device_uuid(int ordinal, char out[VGPU_UUID_BYTES]);
void vgpu_device_after_fork(void);
/* Whether several processes created their contexts with ours and which of
 * them is this one is still to be told; the compute controller's periodic
 * retry of that (cheap when nothing is pending). */
int vgpu_device_host_pid_pending(void);
/* Whether a context made while the node daemon tells host pids still waits
 * for its own (told within one arbiter period of the process's start). */
int vgpu_device_host_pid_awaiting(void);
void vgpu_device_retry_host_pid(void);

/* ---- nvml.c ---- */
struct vgpu_nvml_api {
    nvmlDeviceGetCount_v2_fn count;
    nvmlDeviceGetHandleByIndex_v2_fn by_index;
    nvmlDeviceGetHandleByUUID_fn by_uuid;
    nvmlDeviceGetUUID_fn uuid;
    nvmlDeviceGetProcessUtilization_fn utilization;
    nvmlDeviceGetUtilizationRates_fn rates; /* the whole card's (optional) */
    nvmlDeviceGetComputeRunningProcesses_v3_fn processes;
    nvmlDeviceGetMemoryInfo_fn memory;
};
extern struct vgpu_nvml_api vgpu_nvml;
/* Loads and initialises NVML for the hook's own use, once; 0 if usable. */
int vgpu_nvml_load(void);
/* In a forked child: the load's lock is free again (a controller thread of
 * the parent may have held it while loading NVML when the fork came). */
void vgpu_nvml_after_fork(void);
/* The compute processes NVML lists on the device (host pids). */
int vgpu_nvml_processes(nvmlDevice_t dev, nvmlProcessInfo_v2_t *out, int max);
/* Under trace: process lists taken and the time they took (start-up profile). */
extern long long vgpu_nvml_lists, vgpu_nvml_list_ns;

/* ---- memory.c ---- */
void vgpu_memory_after_fork(void);

/* ---- throttle.c ---- */
void vgpu_throttle_after_fork(void);

#endif
