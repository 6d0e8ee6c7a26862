/*
 * Devices, contexts and streams.
 *
 * Budgets are keyed by the card's UUID, not by the process's device
 * ordinal: under Ray or torchrun each rank sees its own card as device 0.
 *
 * When a process creates its first context on a card, the hook compares
 * NVML's compute-process list before and after: the one new pid is this
 * process's host pid (NVML reports host pids, which differ from ours inside
 * a PID namespace), and the memory NVML shows for it is the context's
 * overhead, charged to the budget.  Where it cannot be measured, the
 * per-card estimate from $VGPU_CONTEXT_OVERHEAD_MIB is charged instead.
 *
 * When several processes create their contexts on the card at the same
 * moment (pods of one Deployment starting together), several pids are new.
 * The hook then marks itself: it allocates a few MiB through the real driver
 * (not charged to the budget), and the one new pid whose used memory NVML
 * shows grow by that much, and shrink again when it is freed, is ours.  The
 * size is random per attempt (another process doing the same at the same
 * time must not look like us); a few attempts within a few ms.  Each attempt
 * compares with the list just taken (the first with the one after the
 * context) and lists the card once with the marker held; only when several
 * pids grew by it is the card listed again after the free (the one that also
 * shrank is ours).  NVML lists cost O(processes) each and hundreds of
 * processes take them at once in a start-up storm: one list per marker, not
 * three, and the before-list is sorted once rather than scanned per pid.
 * VGPU_LOG_LEVEL=trace prints a "profile:" line per context creation (time
 * before, in and after the driver call, lists taken, markers).  Still
 * unresolved, the new pids are kept and the compute controller tries again
 * at its next periods (candidates that exit drop out, the last one left is
 * ours) before one line says compute is throttled on the whole card.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "vgpu.h"

#define MAX_ORDINALS 64
#define MAX_PROCS 1024
#define MAX_CONTEXTS 16
#define MAX_CANDIDATES 64
#define MARK_ATTEMPTS 4           /* at context creation */
#define MARK_LATER_ATTEMPTS 2     /* at each later try */
#define MARK_BUDGET_NS 20000000ll /* no attempt starts after this long (a few ms on a GPU) */
#define MARK_UNIT (2ull << 20)    /* the driver's allocation granularity */
#define MARK_UNITS 8              /* marker sizes: 2, 4, ... 16 MiB */
#define LATER_TRIES 40            /* compute controller periods (50 ms each): 2 s */
#define GONE (~0ull - 1)          /* a candidate no longer listed */

typedef CUresult (*ctx_get_device_fn)(CUdevice *);
typedef CUresult (*ctx_get_device_v2_fn)(CUdevice *, CUcontext);
typedef CUresult (*ctx_push_fn)(CUcontext);
typedef CUresult (*ctx_pop_fn)(CUcontext *);
typedef CUresult (*stream_get_ctx_fn)(CUstream, CUcontext *);
typedef CUresult (*device_get_uuid_fn)(CUuuid *, CUdevice);

static int entry_of[MAX_ORDINALS]; /* budget entry + 1; 0 = not known yet */
static int context_done[MAX_ORDINALS];
static struct {
    CUcontext ctx;
    int ordinal;
} contexts[MAX_CONTEXTS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void *sym(void **cache, const char *name)
{
    void *f = __atomic_load_n(cache, __ATOMIC_ACQUIRE);
    if (!f) {
        f = vgpu_cuda_sym(name);
        if (f)
            __atomic_store_n(cache, f, __ATOMIC_RELEASE);
    }
    return f;
}

int vgpu_current_ordinal(void)
{
    static void *f;
    ctx_get_device_fn get = (ctx_get_device_fn)sym(&f, "cuCtxGetDevice");
    CUdevice dev = 0;
    if (!get || get(&dev) != CUDA_SUCCESS || dev < 0)
        return 0;
    return dev;
}

/* The 36 hex-and-dash characters of a UUID text, or NULL. */
static const char *uuid_body(const char *text)
{
    const char *dash = strchr(text, '-');
    return dash && strlen(dash + 1) >= 36 ? dash + 1 : NULL;
}

int vgpu_device_uuid(int ordinal, char out[VGPU_UUID_BYTES])
{
    static void *f1, *f2;
    device_get_uuid_fn get = (device_get_uuid_fn)sym(&f2, "cuDeviceGetUuid_v2");
    if (!get)
        get = (device_get_uuid_fn)sym(&f1, "cuDeviceGetUuid");
    CUuuid u;
    if (!get || get(&u, ordinal) != CUDA_SUCCESS)
        return -1;
    const unsigned char *b = (const unsigned char *)u.bytes;
    snprintf(out, VGPU_UUID_BYTES,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
             b[15]);
    /* The container's own name for it (e.g. MIG-...), as the plugin gave it. */
    vgpu_init();
    const char *visible = vgpu_cfg.visible;
    char item[VGPU_UUID_BYTES];
    while (visible && *visible) {
        size_t n = strcspn(visible, ",");
        if (n < sizeof(item)) {
            memcpy(item, visible, n);
            item[n] = '\0';
            const char *body = uuid_body(item);
            if (body && strncasecmp(body, out + 4, 36) == 0) {
                snprintf(out, VGPU_UUID_BYTES, "%s", item);
                break;
            }
        }
        visible += n + (visible[n] == ',');
    }
    return 0;
}

int vgpu_device_entry(int ordinal)
{
    static int logged;
    if (ordinal < 0 || ordinal >= MAX_ORDINALS)
        ordinal = MAX_ORDINALS - 1;
    int e = __atomic_load_n(&entry_of[ordinal], __ATOMIC_ACQUIRE);
    if (__builtin_expect(e > 0, 1))
        return e - 1;
    char uuid[VGPU_UUID_BYTES];
    if (vgpu_device_uuid(ordinal, uuid) != 0) {
        vgpu_log(&logged, "cuDeviceGetUuid failed: budgets are keyed by device number");
        snprintf(uuid, sizeof(uuid), "device-%d", ordinal);
    }
    e = vgpu_budget_entry(uuid, 1);
    VGPU_TRACE("device %d is %s: budget entry %d", ordinal, uuid, e);
    __atomic_store_n(&entry_of[ordinal], e + 1, __ATOMIC_RELEASE);
    return e;
}

/* The ordinal of a context: cuCtxGetDevice_v2 where the driver has it,
 * else push, ask, pop.  Cached: a program has few contexts. */
static int context_ordinal(CUcontext ctx)
{
    static void *fv2, *fpush, *fpop;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_CONTEXTS; i++)
        if (contexts[i].ctx == ctx) {
            int o = contexts[i].ordinal;
            pthread_mutex_unlock(&lock);
            return o;
        }
    pthread_mutex_unlock(&lock);
    CUdevice dev = -1;
    ctx_get_device_v2_fn v2 = (ctx_get_device_v2_fn)sym(&fv2, "cuCtxGetDevice_v2");
    if (!v2 || v2(&dev, ctx) != CUDA_SUCCESS) {
        ctx_push_fn push = (ctx_push_fn)sym(&fpush, "cuCtxPushCurrent_v2");
        ctx_pop_fn pop = (ctx_pop_fn)sym(&fpop, "cuCtxPopCurrent_v2");
        CUcontext popped;
        if (push && pop && push(ctx) == CUDA_SUCCESS) {
            dev = vgpu_current_ordinal();
            pop(&popped);
        }
    }
    if (dev < 0)
        return vgpu_current_ordinal();
    pthread_mutex_lock(&lock);
    static int next;
    contexts[next].ctx = ctx;
    contexts[next].ordinal = dev;
    next = (next + 1) % MAX_CONTEXTS;
    pthread_mutex_unlock(&lock);
    return dev;
}

int vgpu_stream_ordinal(CUstream stream)
{
    static void *f;
    /* NULL, CU_STREAM_LEGACY (1), CU_STREAM_PER_THREAD (2): the current context's. */
    if ((uintptr_t)stream <= 2)
        return vgpu_current_ordinal();
    stream_get_ctx_fn get = (stream_get_ctx_fn)sym(&f, "cuStreamGetCtx");
    CUcontext ctx = NULL;
    if (!get || get(stream, &ctx) != CUDA_SUCCESS || !ctx)
        return vgpu_current_ordinal();
    return context_ordinal(ctx);
}

static void forget_candidates(void);

void vgpu_device_after_fork(void)
{
    pthread_mutex_init(&lock, NULL);
    memset(context_done, 0, sizeof(context_done)); /* the child's contexts are its own */
    forget_candidates();
}

/* ---- context creation: host pid and context overhead ---- */

struct snapshot {
    nvmlDevice_t dev;
    int n;      /* -1: no list */
    int teller; /* the node daemon tells the host pid: nothing listed */
    nvmlProcessInfo_v2_t procs[MAX_PROCS];
    unsigned sorted[MAX_PROCS]; /* the pids of procs, sorted (after sort_pids) */
};

static int by_pid(const void *a, const void *b)
{
    unsigned x = *(const unsigned *)a, y = *(const unsigned *)b;
    return x < y ? -1 : x > y;
}

/* Sorts the list's pids once: each later look-up is a binary search (a storm
 * lists hundreds of processes; comparing every pair cost as much as the list). */
static void sort_pids(struct snapshot *s)
{
    for (int i = 0; i < s->n; i++)
        s->sorted[i] = s->procs[i].pid;
    qsort(s->sorted, (size_t)(s->n > 0 ? s->n : 0), sizeof(unsigned), by_pid);
}

static int listed(const struct snapshot *s, unsigned pid)
{
    return s->n > 0 && bsearch(&pid, s->sorted, (size_t)s->n, sizeof(unsigned), by_pid) != NULL;
}

/* Before the driver call: 1 and the process list, if this is the first
 * context of this process on the card and the hook has limits to keep. */
static int before_context(CUdevice ordinal, struct snapshot **out)
{
    *out = NULL;
    vgpu_init();
    if (vgpu_cfg.memory_limit == VGPU_NO_LIMIT && !vgpu_cfg.core_percent)
        return 0;
    if (ordinal < 0 || ordinal >= MAX_ORDINALS ||
        __atomic_load_n(&context_done[ordinal], __ATOMIC_ACQUIRE))
        return 0;
    struct snapshot *s = calloc(1, sizeof(*s));
    if (!s)
        return 0;
    s->n = -1;
    /* The node daemon tells host pids for this container (its compute
     * arbiter runs, so this process has a compute controller to adopt it):
     * no list of the card's processes before and after, the two lists each
     * process of a start-up storm would otherwise make. */
    if (vgpu_cfg.core_percent && !vgpu_budget_host_pid() && vgpu_budget_teller_alive()) {
        s->teller = 1;
        *out = s;
        return 1;
    }
    char uuid[VGPU_UUID_BYTES];
    long long t0 = vgpu_trace_on ? vgpu_now_ns() : 0;
    int loaded = vgpu_nvml_load();
    VGPU_TRACE("profile: nvml load %lld us", (vgpu_now_ns() - t0) / 1000);
    if (loaded == 0 && vgpu_device_uuid(ordinal, uuid) == 0 &&
        vgpu_nvml.by_uuid(uuid, &s->dev) == NVML_SUCCESS)
        s->n = vgpu_nvml_processes(s->dev, s->procs, MAX_PROCS);
    *out = s;
    return 1;
}

/* ---- several new pids: which one is ours ---- */

struct candidates {
    nvmlDevice_t dev;
    CUcontext ctx;
    int ordinal;
    int entry;                               /* budget entry the overhead went to */
    uint64_t charged;                        /* overhead charged while unresolved */
    int tries_left;                          /* later tries (controller periods) */
    int seen;                                /* new pids at context creation */
    int n;                                   /* candidates left; 0 = nothing pending */
    unsigned pid[MAX_CANDIDATES];
    unsigned long long mem[MAX_CANDIDATES];  /* usedGpuMemory right after our context */
};

enum { TOLD, UNTOLD, NO_PROCESS_MEMORY, NO_CANDIDATE };

/* Contexts made while the node daemon tells host pids: the host pid to wait
 * for, and the overhead estimate charged meanwhile (under pending_lock). */
struct awaiting {
    int entry;           /* budget entry the estimate went to; -1 = none */
    uint64_t charged;    /* estimate charged (memory limit only) */
    int tries_left;      /* compute controller periods, for the host pid */
    int measure_left;    /* then for the daemon's measurement */
};
static struct awaiting awaiting[MAX_ORDINALS];
static int have_awaiting; /* contexts waiting */
static int asking = -1;   /* the ordinal whose overhead the daemon is asked for */

static struct candidates pending; /* under pending_lock */
static int have_pending;
static pthread_mutex_t pending_lock = PTHREAD_MUTEX_INITIALIZER;

static void forget_candidates(void)
{
    pthread_mutex_init(&pending_lock, NULL);
    pending.n = 0;
    have_pending = 0;
    memset(awaiting, 0, sizeof(awaiting));
    have_awaiting = 0;
    asking = -1;
}

/* Each candidate's used memory now (GONE where not listed); -1 without a list. */
static int candidate_memory(const struct candidates *c, nvmlProcessInfo_v2_t *buf,
                            unsigned long long *out)
{
    int n = vgpu_nvml_processes(c->dev, buf, MAX_PROCS);
    if (n < 0)
        return -1;
    for (int i = 0; i < c->n; i++) {
        out[i] = GONE;
        for (int j = 0; j < n; j++)
            if (buf[j].pid == c->pid[i])
                out[i] = buf[j].usedGpuMemory;
    }
    return 0;
}

/* Drops candidates that are gone or are another process of this container
 * (`now` is compacted with them). */
static void drop_others(struct candidates *c, unsigned long long *now)
{
    static struct vgpu_pid ours[VGPU_MAX_SLOTS]; /* under pending_lock */
    int nours = vgpu_budget_peek_pids(ours, VGPU_MAX_SLOTS), kept = 0;
    for (int i = 0; i < c->n; i++) {
        int sibling = 0;
        for (int j = 0; j < nours && !sibling; j++)
            sibling = ours[j].host_pid == c->pid[i];
        if (now[i] == GONE || sibling)
            continue;
        c->pid[kept] = c->pid[i];
        c->mem[kept] = c->mem[i];
        now[kept] = now[i];
        kept++;
    }
    c->n = kept;
}

/* A marker size, in driver allocation units, unlike the previous one. */
static uint64_t marker_bytes(uint64_t previous)
{
    static unsigned state;
    if (!state)
        state = (unsigned)vgpu_now_ns() ^ ((unsigned)getpid() << 16) ^ (unsigned)(uintptr_t)&state;
    for (;;) {
        state ^= state << 13, state ^= state >> 17, state ^= state << 5;
        uint64_t bytes = MARK_UNIT * (1 + state % MARK_UNITS);
        if (bytes != previous)
            return bytes;
    }
}

static int markers; /* marker allocations made (trace profile) */

/* Whether usedGpuMemory `high` is at least `bytes` above `low` (both listed). */
static int rose_by(unsigned long long low, unsigned long long high, uint64_t bytes)
{
    return low < GONE && high < GONE && high >= low && high - low >= bytes;
}

/* One marker: pushes our context, allocates through the real driver (the
 * budget is not charged: this memory is gone again before we return), and
 * compares each candidate's memory with it to `m0`, the caller's list from
 * just before.  Only where several grew by it (another process's allocation
 * at the same moment) is the card listed once more, after the free.  One
 * list per marker, not three: hundreds of processes mark at once in a storm,
 * and each list is O(processes) on the driver.  The index of the one
 * candidate it shows, else -1. */
static int mark_once(const struct candidates *c, nvmlProcessInfo_v2_t *buf, uint64_t bytes,
                     const unsigned long long *m0)
{
    static void *fpush, *fpop;
    ctx_push_fn push = (ctx_push_fn)sym(&fpush, "cuCtxPushCurrent_v2");
    ctx_pop_fn pop = (ctx_pop_fn)sym(&fpop, "cuCtxPopCurrent_v2");
    unsigned long long m1[MAX_CANDIDATES], m2[MAX_CANDIDATES];
    CUcontext popped;
    CUdeviceptr ptr = 0;
    if (!push || !pop || push(c->ctx) != CUDA_SUCCESS)
        return -1;
    CUresult rc = VGPU_REAL(cuMemAlloc_v2, &ptr, bytes);
    markers++;
    int seen = rc == CUDA_SUCCESS && candidate_memory(c, buf, m1) == 0;
    if (rc == CUDA_SUCCESS)
        VGPU_REAL(cuMemFree_v2, ptr);
    /* Grew by the marker. */
    int grew = 0, grew_at = -1, grown[MAX_CANDIDATES];
    for (int i = 0; seen && i < c->n; i++)
        if ((grown[i] = rose_by(m0[i], m1[i], bytes)))
            grew++, grew_at = i;
    /* Where several did, the one that also shrank by it when it was freed. */
    int shrank = 0, shrank_at = -1;
    if (grew > 1 && candidate_memory(c, buf, m2) == 0)
        for (int i = 0; i < c->n; i++)
            if (grown[i] && rose_by(m2[i], m1[i], bytes))
                shrank++, shrank_at = i;
    pop(&popped);
    if (!seen)
        return -1;
    VGPU_TRACE("marker of %llu MiB: %d of %d new pids grew by it, %d also shrank",
               (unsigned long long)(bytes / VGPU_MIB), grew, c->n, shrank);
    return grew == 1 ? grew_at : shrank == 1 ? shrank_at : -1;
}

/* Narrows `c` down to our pid (c->pid[0] on TOLD) in at most `attempts`
 * markers and MARK_BUDGET_NS.  `fresh`: c->mem is a list of just now (the
 * one after the context), which the first attempt starts from. */
static int identify(struct candidates *c, int attempts, int fresh)
{
    nvmlProcessInfo_v2_t *buf = calloc(MAX_PROCS, sizeof(*buf));
    unsigned long long now[MAX_CANDIDATES];
    int result = UNTOLD;
    if (!buf)
        return UNTOLD;
    uint64_t bytes = 0;
    for (long long start = vgpu_now_ns();
         attempts-- > 0 && vgpu_now_ns() - start < MARK_BUDGET_NS;) {
        if (fresh) {
            memcpy(now, c->mem, sizeof(now));
            fresh = 0;
        } else if (candidate_memory(c, buf, now) != 0) {
            break;
        }
        drop_others(c, now);
        if (c->n <= 1) { /* the others exited: the one left is ours, if any */
            result = c->n ? TOLD : NO_CANDIDATE;
            break;
        }
        int memory = 1;
        for (int i = 0; i < c->n; i++)
            memory &= now[i] != NVML_VALUE_NOT_AVAILABLE;
        if (!memory) {
            result = NO_PROCESS_MEMORY;
            break;
        }
        bytes = marker_bytes(bytes);
        int k = mark_once(c, buf, bytes, now);
        if (k >= 0) {
            c->pid[0] = c->pid[k];
            c->mem[0] = c->mem[k];
            c->n = 1;
            result = TOLD;
            break;
        }
    }
    free(buf);
    return result;
}

static void log_untold(int count, int why)
{
    static int logged;
    vgpu_log(&logged,
             "could not tell this process's host pid from NVML (%d new processes on the card%s); "
             "%s", count,
             why == NO_PROCESS_MEMORY ? ", and NVML reports no per-process usedGpuMemory to "
                                        "mark one by" : "",
             vgpu_cfg.core_percent ? "compute is throttled on the whole card's utilisation"
                                   : "the container's NVML process list leaves it out");
}

/* The context's own usedGpuMemory on `ordinal` now (NVML_VALUE_NOT_AVAILABLE
 * if not listed): one list, made once the host pid is known. */
static unsigned long long own_memory(int ordinal, unsigned host)
{
    char uuid[VGPU_UUID_BYTES];
    nvmlDevice_t dev;
    unsigned long long mem = NVML_VALUE_NOT_AVAILABLE;
    if (vgpu_nvml_load() != 0 || vgpu_device_uuid(ordinal, uuid) != 0 ||
        vgpu_nvml.by_uuid(uuid, &dev) != NVML_SUCCESS)
        return mem;
    nvmlProcessInfo_v2_t *buf = calloc(MAX_PROCS, sizeof(*buf));
    int n = buf ? vgpu_nvml_processes(dev, buf, MAX_PROCS) : -1;
    for (int i = 0; i < n; i++)
        if (buf[i].pid == host)
            mem = buf[i].usedGpuMemory;
    free(buf);
    return mem;
}

/* Replaces the estimate charged for the context on `a`'s entry by `mem`. */
static void correct_overhead(const struct awaiting *a, unsigned long long mem)
{
    if (mem == NVML_VALUE_NOT_AVAILABLE)
        return;
    if (mem > a->charged)
        vgpu_budget_charge(a->entry, mem - a->charged);
    else
        vgpu_budget_release(a->entry, a->charged - mem);
}

/* The told host pid arrived (or never will); then, under a memory limit, the
 * daemon measures the context's overhead (one NVML list per card per period
 * for the whole node, not one per process), which replaces the estimate.  Not
 * measured within LATER_TRIES periods: one list of our own.  One context at a
 * time asks.  Compute controller thread, once per period. */
static void settle_awaiting(void)
{
    static int logged;
    if (!__atomic_load_n(&have_awaiting, __ATOMIC_ACQUIRE))
        return;
    unsigned host = vgpu_budget_host_pid();
    pthread_mutex_lock(&pending_lock);
    for (int o = 0; o < MAX_ORDINALS && have_awaiting; o++) {
        struct awaiting *a = &awaiting[o];
        if (!a->tries_left)
            continue;
        if (!host) {
            if (--a->tries_left > 0)
                continue;
            vgpu_log(&logged, "the node daemon did not tell this process's host pid within 2 s; "
                     "compute is throttled on the whole card's utilisation");
        } else if (vgpu_cfg.memory_limit != VGPU_NO_LIMIT && a->entry >= 0) {
            if (asking < 0) {
                asking = o;
                a->measure_left = LATER_TRIES;
                vgpu_budget_await_overhead(a->entry);
                continue;
            }
            if (asking != o)
                continue;
            long long mem = vgpu_budget_measured_overhead(a->entry);
            if (mem < 0 && --a->measure_left > 0)
                continue;
            correct_overhead(a, mem >= 0 ? (unsigned long long)mem : own_memory(o, host));
            VGPU_TRACE("context on device %d: overhead %lld bytes, %s", o,
                       mem >= 0 ? mem : -1, mem >= 0 ? "measured by the node daemon"
                                                     : "not measured by the node daemon: listed");
            vgpu_budget_await_overhead(-1);
            asking = -1;
        }
        VGPU_TRACE("context on device %d: host pid %u, told by the node daemon", o, host);
        a->tries_left = 0;
        __atomic_store_n(&have_awaiting, have_awaiting - 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&pending_lock);
}

int vgpu_device_host_pid_pending(void)
{
    return __atomic_load_n(&have_pending, __ATOMIC_ACQUIRE) ||
           __atomic_load_n(&have_awaiting, __ATOMIC_ACQUIRE);
}

int vgpu_device_host_pid_awaiting(void)
{
    return __atomic_load_n(&have_awaiting, __ATOMIC_ACQUIRE);
}

/* Later tries, from the compute controller thread: once per period. */
void vgpu_device_retry_host_pid(void)
{
    settle_awaiting();
    if (!__atomic_load_n(&have_pending, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&pending_lock);
    int why = UNTOLD;
    if (pending.n && !vgpu_budget_host_pid()) {
        long long t0 = vgpu_now_ns();
        why = identify(&pending, MARK_LATER_ATTEMPTS, 0);
        if (why == TOLD) {
            unsigned long long mem = pending.mem[0];
            vgpu_budget_set_host_pid(pending.pid[0]);
            VGPU_TRACE("context on device %d: host pid %u, told later in %lld us",
                       pending.ordinal, pending.pid[0], (vgpu_now_ns() - t0) / 1000);
            /* The overhead NVML showed for it replaces the estimate charged meanwhile. */
            if (vgpu_cfg.memory_limit != VGPU_NO_LIMIT && mem != NVML_VALUE_NOT_AVAILABLE) {
                if (mem > pending.charged)
                    vgpu_budget_charge(pending.entry, mem - pending.charged);
                else
                    vgpu_budget_release(pending.entry, pending.charged - mem);
            }
        }
    }
    if (why == TOLD || why == NO_CANDIDATE || !pending.n || vgpu_budget_host_pid() ||
        --pending.tries_left <= 0) {
        if (why != TOLD && !vgpu_budget_host_pid())
            log_untold(pending.seen, why);
        pending.n = 0;
        __atomic_store_n(&have_pending, 0, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&pending_lock);
}

/* A context made while the node daemon tells host pids: the estimate is
 * charged now; the controller adopts the told pid and measures the overhead. */
static void told_later(CUdevice ordinal)
{
    int entry = vgpu_device_entry(ordinal);
    uint64_t charged = 0;
    if (vgpu_cfg.memory_limit != VGPU_NO_LIMIT && vgpu_cfg.context_overhead) {
        charged = vgpu_cfg.context_overhead;
        vgpu_budget_charge(entry, charged);
    }
    pthread_mutex_lock(&pending_lock);
    if (!awaiting[ordinal].tries_left) {
        awaiting[ordinal] = (struct awaiting){.entry = entry, .charged = charged,
                                              .tries_left = LATER_TRIES};
        __atomic_store_n(&have_awaiting, have_awaiting + 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&pending_lock);
    VGPU_TRACE("context on device %d: host pid left to the node daemon", ordinal);
}

static void after_context(CUdevice ordinal, CUcontext ctx, struct snapshot *before)
{
    static int logged_mem;
    if (__atomic_exchange_n(&context_done[ordinal], 1, __ATOMIC_ACQ_REL)) {
        free(before);
        return;
    }
    if (before->teller) {
        told_later(ordinal);
        free(before);
        return;
    }
    uint64_t overhead = VGPU_NO_LIMIT; /* not measured */
    unsigned host = vgpu_budget_host_pid();
    struct candidates *untold = NULL; /* several new pids, none told ours */
    int why = UNTOLD;
    if (before->n >= 0) {
        struct snapshot *after = calloc(1, sizeof(*after));
        if (after) {
            after->n = vgpu_nvml_processes(before->dev, after->procs, MAX_PROCS);
            sort_pids(before);
            int fresh = -1, count = 0;
            for (int i = 0; i < after->n; i++)
                if (!listed(before, after->procs[i].pid)) {
                    fresh = i;
                    count++;
                }
            if (count == 1 && (!host || host == after->procs[fresh].pid)) {
                host = after->procs[fresh].pid;
                overhead = after->procs[fresh].usedGpuMemory;
            } else if (count > 1 && !host && (untold = calloc(1, sizeof(*untold)))) {
                *untold = (struct candidates){.dev = before->dev, .ctx = ctx, .ordinal = ordinal,
                                              .tries_left = LATER_TRIES, .seen = count};
                for (int i = 0; i < after->n && untold->n < MAX_CANDIDATES; i++)
                    if (!listed(before, after->procs[i].pid)) {
                        untold->pid[untold->n] = after->procs[i].pid;
                        untold->mem[untold->n++] = after->procs[i].usedGpuMemory;
                    }
                long long t0 = vgpu_now_ns();
                pthread_mutex_lock(&pending_lock);
                why = identify(untold, MARK_ATTEMPTS, 1);
                pthread_mutex_unlock(&pending_lock);
                VGPU_TRACE("context on device %d: %d new pids, %s in %lld us", ordinal, count,
                           why == TOLD ? "ours told by a marker allocation" : "none told ours",
                           (vgpu_now_ns() - t0) / 1000);
                if (why == TOLD) {
                    host = untold->pid[0];
                    overhead = untold->mem[0];
                    free(untold);
                    untold = NULL;
                } else if (why == NO_CANDIDATE) {
                    free(untold);
                    untold = NULL;
                }
            } else {
                for (int i = 0; host && i < after->n; i++)
                    if (after->procs[i].pid == host && !listed(before, host))
                        overhead = after->procs[i].usedGpuMemory;
            }
            if (!host && !untold)
                log_untold(count, why);
            free(after);
        }
    }
    /* The card's budget entry, also under a compute limit alone where the
     * container shares a budget file: its compute poller polls only the cards
     * the container has entries for. */
    int entry = vgpu_cfg.memory_limit != VGPU_NO_LIMIT || (vgpu_cfg.core_percent && vgpu_cfg.shared_dir)
                    ? vgpu_device_entry(ordinal)
                    : -1;
    if (host && host != vgpu_budget_host_pid()) {
        vgpu_budget_set_host_pid(host);
        VGPU_TRACE("context on device %d: host pid %u", ordinal, host);
    }
    if (vgpu_cfg.memory_limit != VGPU_NO_LIMIT) {
        if (overhead == VGPU_NO_LIMIT || overhead == NVML_VALUE_NOT_AVAILABLE) {
            overhead = vgpu_cfg.context_overhead;
            if (overhead)
                vgpu_log(&logged_mem, "NVML cannot measure the context's memory: charging the "
                         "estimate of %llu MiB per card", (unsigned long long)(overhead / VGPU_MIB));
        }
        if (overhead) {
            vgpu_budget_charge(entry, overhead);
            VGPU_TRACE("context on device %d: charged %llu bytes of overhead", ordinal,
                       (unsigned long long)overhead);
        }
        if (untold) {
            untold->entry = entry;
            untold->charged = overhead;
        }
    }
    if (untold) {
        /* The compute controller tries again at its next periods; without a
         * compute limit there is none, and this is the last word. */
        pthread_mutex_lock(&pending_lock);
        if (vgpu_cfg.core_percent && !pending.n) {
            pending = *untold;
            __atomic_store_n(&have_pending, 1, __ATOMIC_RELEASE);
        } else if (!pending.n) {
            log_untold(untold->seen, why);
        }
        pthread_mutex_unlock(&pending_lock);
        free(untold);
    }
    free(before);
}

#define CONTEXT(ordinal, pctx, call)                                                             \
    do {                                                                                         \
        struct snapshot *s_;                                                                     \
        vgpu_init();                                                                             \
        if (__builtin_expect(vgpu_cfg.refuse, 0)) /* fail-safe (config.c) */                     \
            return CUDA_ERROR_NOT_INITIALIZED;                                                   \
        long long t0_ = vgpu_trace_on ? vgpu_now_ns() : 0;                                       \
        int want_ = before_context(ordinal, &s_);                                                \
        long long t1_ = vgpu_trace_on ? vgpu_now_ns() : 0;                                       \
        CUresult rc_ = (call);                                                                   \
        long long t2_ = vgpu_trace_on ? vgpu_now_ns() : 0;                                       \
        VGPU_TRACE("%s(device %d) = %d", __func__, (int)(ordinal), rc_);                         \
        if (want_ && rc_ == CUDA_SUCCESS && (pctx))                                              \
            after_context(ordinal, *(pctx), s_);                                                 \
        else                                                                                     \
            free(s_);                                                                            \
        if (want_)                                                                               \
            VGPU_TRACE("profile: context us before %lld driver %lld after %lld; nvml lists %lld "  \
                       "list us %lld markers %d",                                                  \
                       (t1_ - t0_) / 1000, (t2_ - t1_) / 1000, (vgpu_now_ns() - t2_) / 1000,     \
                       vgpu_nvml_lists, vgpu_nvml_list_ns / 1000, markers);                      \
        return rc_;                                                                              \
    } while (0)

VGPU_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    CONTEXT(dev, pctx, VGPU_REAL(cuDevicePrimaryCtxRetain, pctx, dev));
}

VGPU_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CONTEXT(dev, pctx, VGPU_REAL(cuCtxCreate, pctx, flags, dev));
}

VGPU_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CONTEXT(dev, pctx, VGPU_REAL(cuCtxCreate_v2, pctx, flags, dev));
}

VGPU_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n,
                                    unsigned int flags, CUdevice dev)
{
    CONTEXT(dev, pctx, VGPU_REAL(cuCtxCreate_v3, pctx, params, n, flags, dev));
}

VGPU_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params,
                                    unsigned int flags, CUdevice dev)
{
    CONTEXT(dev, pctx, VGPU_REAL(cuCtxCreate_v4, pctx, params, flags, dev));
}
