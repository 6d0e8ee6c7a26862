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
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vgpu.h"

#define MAX_ORDINALS 64
#define MAX_PROCS 1024
#define MAX_CONTEXTS 16

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
    const char *visible = getenv("NVIDIA_VISIBLE_DEVICES");
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

void vgpu_device_after_fork(void)
{
    pthread_mutex_init(&lock, NULL);
    memset(context_done, 0, sizeof(context_done)); /* the child's contexts are its own */
}

/* ---- context creation: host pid and context overhead ---- */

struct snapshot {
    nvmlDevice_t dev;
    int n; /* -1: no list */
    nvmlProcessInfo_v2_t procs[MAX_PROCS];
};

static int listed(const struct snapshot *s, unsigned pid)
{
    for (int i = 0; i < s->n; i++)
        if (s->procs[i].pid == pid)
            return 1;
    return 0;
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
    char uuid[VGPU_UUID_BYTES];
    if (vgpu_nvml_load() == 0 && vgpu_device_uuid(ordinal, uuid) == 0 &&
        vgpu_nvml.by_uuid(uuid, &s->dev) == NVML_SUCCESS)
        s->n = vgpu_nvml_processes(s->dev, s->procs, MAX_PROCS);
    *out = s;
    return 1;
}

static void after_context(CUdevice ordinal, struct snapshot *before)
{
    static int logged_pid, logged_mem;
    if (__atomic_exchange_n(&context_done[ordinal], 1, __ATOMIC_ACQ_REL)) {
        free(before);
        return;
    }
    uint64_t overhead = VGPU_NO_LIMIT; /* not measured */
    unsigned host = vgpu_budget_host_pid();
    if (before->n >= 0) {
        struct snapshot *after = calloc(1, sizeof(*after));
        if (after) {
            after->n = vgpu_nvml_processes(before->dev, after->procs, MAX_PROCS);
            int fresh = -1, count = 0;
            for (int i = 0; i < after->n; i++)
                if (!listed(before, after->procs[i].pid)) {
                    fresh = i;
                    count++;
                }
            if (count == 1 && (!host || host == after->procs[fresh].pid)) {
                host = after->procs[fresh].pid;
                overhead = after->procs[fresh].usedGpuMemory;
            } else {
                for (int i = 0; host && i < after->n; i++)
                    if (after->procs[i].pid == host && !listed(before, host))
                        overhead = after->procs[i].usedGpuMemory;
                if (!host)
                    vgpu_log(&logged_pid, "could not tell this process's host pid from NVML (%d "
                             "new processes on the card); compute is throttled on the whole "
                             "card's utilisation", count);
            }
            free(after);
        }
    }
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
            vgpu_budget_charge(vgpu_device_entry(ordinal), overhead);
            VGPU_TRACE("context on device %d: charged %llu bytes of overhead", ordinal,
                       (unsigned long long)overhead);
        }
    }
    free(before);
}

#define CONTEXT(ordinal, call)                                                                   \
    do {                                                                                         \
        struct snapshot *s_;                                                                     \
        int want_ = before_context(ordinal, &s_);                                                \
        CUresult rc_ = (call);                                                                   \
        VGPU_TRACE("%s(device %d) = %d", __func__, (int)(ordinal), rc_);                         \
        if (want_ && rc_ == CUDA_SUCCESS)                                                        \
            after_context(ordinal, s_);                                                          \
        else                                                                                     \
            free(s_);                                                                            \
        return rc_;                                                                              \
    } while (0)

VGPU_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    CONTEXT(dev, VGPU_REAL(cuDevicePrimaryCtxRetain, pctx, dev));
}

VGPU_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CONTEXT(dev, VGPU_REAL(cuCtxCreate, pctx, flags, dev));
}

VGPU_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CONTEXT(dev, VGPU_REAL(cuCtxCreate_v2, pctx, flags, dev));
}

VGPU_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n,
                                    unsigned int flags, CUdevice dev)
{
    CONTEXT(dev, VGPU_REAL(cuCtxCreate_v3, pctx, params, n, flags, dev));
}

VGPU_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params,
                                    unsigned int flags, CUdevice dev)
{
    CONTEXT(dev, VGPU_REAL(cuCtxCreate_v4, pctx, params, flags, dev));
}
