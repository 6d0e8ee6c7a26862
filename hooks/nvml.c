/*
 * NVML: the hook's own use (process lists, utilisation), and what programs
 * in the container are shown.  nvidia-smi, pynvml, gpustat and
 * torch.cuda's NVML queries see the container's slice: its memory limit as
 * the total, its own usage as used, and only its own processes (under their
 * container pids).  Everything else NVML answers is untouched.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "vgpu.h"

#define NVML_LIBRARY "libnvidia-ml.so.1"
#define NVML_ERROR_UNINITIALIZED 1
#define MAX_LISTED 65536

struct vgpu_nvml_api vgpu_nvml;
static int nvml_state; /* 0 not tried, 1 usable, -1 unavailable */
static pthread_mutex_t nvml_lock = PTHREAD_MUTEX_INITIALIZER;

int vgpu_nvml_load(void)
{
    static int logged;
    pthread_mutex_lock(&nvml_lock);
    if (nvml_state == 0) {
        void *h = dlopen(NVML_LIBRARY, RTLD_NOW | RTLD_LOCAL);
#define LOOK(name) (h ? vgpu_dlsym_real(h, name) : NULL)
        nvmlInit_v2_fn init = (nvmlInit_v2_fn)LOOK("nvmlInit_v2");
        vgpu_nvml.count = (nvmlDeviceGetCount_v2_fn)LOOK("nvmlDeviceGetCount_v2");
        vgpu_nvml.by_index = (nvmlDeviceGetHandleByIndex_v2_fn)LOOK("nvmlDeviceGetHandleByIndex_v2");
        vgpu_nvml.by_uuid = (nvmlDeviceGetHandleByUUID_fn)LOOK("nvmlDeviceGetHandleByUUID");
        vgpu_nvml.uuid = (nvmlDeviceGetUUID_fn)LOOK("nvmlDeviceGetUUID");
        vgpu_nvml.utilization =
            (nvmlDeviceGetProcessUtilization_fn)LOOK("nvmlDeviceGetProcessUtilization");
        vgpu_nvml.rates = (nvmlDeviceGetUtilizationRates_fn)LOOK("nvmlDeviceGetUtilizationRates");
        vgpu_nvml.processes =
            (nvmlDeviceGetComputeRunningProcesses_v3_fn)LOOK("nvmlDeviceGetComputeRunningProcesses_v3");
        if (!vgpu_nvml.processes) /* same entry layout */
            vgpu_nvml.processes = (nvmlDeviceGetComputeRunningProcesses_v3_fn)LOOK(
                "nvmlDeviceGetComputeRunningProcesses_v2");
        vgpu_nvml.memory = (nvmlDeviceGetMemoryInfo_fn)LOOK("nvmlDeviceGetMemoryInfo");
#undef LOOK
        int ok = init && vgpu_nvml.count && vgpu_nvml.by_index && vgpu_nvml.by_uuid &&
                 vgpu_nvml.uuid && vgpu_nvml.processes && init() == NVML_SUCCESS;
        if (!ok)
            vgpu_log(&logged, "NVML (%s) unavailable: host pids and context memory cannot be "
                     "measured%s", NVML_LIBRARY,
                     vgpu_cfg.core_percent ? ", the compute limit is not enforced" : "");
        nvml_state = ok ? 1 : -1;
    }
    int state = nvml_state;
    pthread_mutex_unlock(&nvml_lock);
    return state > 0 ? 0 : -1;
}

void vgpu_nvml_after_fork(void)
{
    /* The thread that held it is gone; a load it left unfinished (state 0)
     * is made again by whoever needs NVML next. */
    pthread_mutex_init(&nvml_lock, NULL);
}

long long vgpu_nvml_lists, vgpu_nvml_list_ns;

int vgpu_nvml_processes(nvmlDevice_t dev, nvmlProcessInfo_v2_t *out, int max)
{
    unsigned int n = (unsigned int)max;
    long long t0 = vgpu_trace_on ? vgpu_now_ns() : 0;
    nvmlReturn_t rc = vgpu_nvml.processes ? vgpu_nvml.processes(dev, &n, out) : NVML_ERROR_NOT_SUPPORTED;
    if (vgpu_trace_on) {
        __atomic_fetch_add(&vgpu_nvml_lists, 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&vgpu_nvml_list_ns, vgpu_now_ns() - t0, __ATOMIC_RELAXED);
    }
    if (rc != NVML_SUCCESS)
        return -1;
    return n < (unsigned int)max ? (int)n : max;
}

/* ---- what the program sees ---- */

static int limited(void)
{
    vgpu_init();
    return vgpu_cfg.memory_limit != VGPU_NO_LIMIT;
}

/* The budget entry of an NVML device (-1: none yet: nothing used there). */
static int entry_of(nvmlDevice_t dev)
{
    static void *cached;
    nvmlDeviceGetUUID_fn uuid = __atomic_load_n(&cached, __ATOMIC_ACQUIRE);
    if (!uuid) {
        void *h = dlopen(NVML_LIBRARY, RTLD_LAZY | RTLD_NOLOAD);
        uuid = h ? (nvmlDeviceGetUUID_fn)vgpu_dlsym_real(h, "nvmlDeviceGetUUID") : NULL;
        if (h)
            dlclose(h);
        if (!uuid)
            return -1;
        __atomic_store_n(&cached, (void *)uuid, __ATOMIC_RELEASE);
    }
    char text[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    if (uuid(dev, text, sizeof(text)) != NVML_SUCCESS)
        return -1;
    text[sizeof(text) - 1] = '\0';
    return vgpu_budget_entry(text, 0);
}

/* total = min(limit, card), used = the container's usage, free = the rest
 * (never more than the card's real free). */
static void slice(nvmlDevice_t dev, unsigned long long *total, unsigned long long *free_bytes,
                  unsigned long long *used)
{
    int e = entry_of(dev);
    uint64_t usage = e >= 0 ? vgpu_budget_used(e) : 0, limit = vgpu_cfg.memory_limit;
    uint64_t t = limit < *total ? limit : *total, u = usage < t ? usage : t;
    uint64_t f = t - u;
    *total = t;
    *used = u;
    if (f < *free_bytes)
        *free_bytes = f;
}

#define NVML_REAL(sym, ...)                                                                      \
    ({                                                                                           \
        sym##_fn real_ = (sym##_fn)vgpu_nvml_real(VGPU_N_##sym);                                 \
        real_ ? real_(__VA_ARGS__) : NVML_ERROR_UNINITIALIZED;                                   \
    })

VGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *m)
{
    nvmlReturn_t rc = NVML_REAL(nvmlDeviceGetMemoryInfo, dev, m);
    if (rc == NVML_SUCCESS && m && limited())
        slice(dev, &m->total, &m->free, &m->used);
    VGPU_TRACE("nvmlDeviceGetMemoryInfo = %d: total %llu, used %llu", rc, m ? m->total : 0,
               m ? m->used : 0);
    return rc;
}

VGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *m)
{
    nvmlReturn_t rc = NVML_REAL(nvmlDeviceGetMemoryInfo_v2, dev, m);
    if (rc == NVML_SUCCESS && m && limited()) {
        m->reserved = 0; /* the driver's own share is not the container's business */
        slice(dev, &m->total, &m->free, &m->used);
    }
    VGPU_TRACE("nvmlDeviceGetMemoryInfo_v2 = %d: total %llu, used %llu", rc, m ? m->total : 0,
               m ? m->used : 0);
    return rc;
}

typedef nvmlReturn_t (*process_list_fn)(nvmlDevice_t, unsigned int *, void *);

/* Only the container's own processes, under their container pids; the
 * caller's buffer protocol (count in, count out, INSUFFICIENT_SIZE) kept. */
static nvmlReturn_t own_processes(enum vgpu_nvml_hook_id id, nvmlDevice_t dev,
                                  unsigned int *count, void *infos, size_t elem)
{
    process_list_fn real = (process_list_fn)vgpu_nvml_real(id);
    if (!real)
        return NVML_ERROR_UNINITIALIZED;
    vgpu_init();
    if (!count)
        return real(dev, count, infos);
    unsigned int cap = 64, n;
    char *buf = NULL;
    nvmlReturn_t rc;
    for (;;) {
        char *grown = realloc(buf, cap * elem);
        if (!grown) {
            free(buf);
            return real(dev, count, infos); /* no memory to filter in: the plain answer */
        }
        buf = grown;
        n = cap;
        rc = real(dev, &n, buf);
        if (rc == NVML_ERROR_INSUFFICIENT_SIZE && n > cap && n < MAX_LISTED) {
            cap = n + 16;
            continue;
        }
        break;
    }
    if (rc != NVML_SUCCESS) {
        free(buf);
        return rc;
    }
    static struct vgpu_pid ours[VGPU_MAX_SLOTS];
    static pthread_mutex_t ours_lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&ours_lock);
    int nours = vgpu_budget_pids(ours, VGPU_MAX_SLOTS);
    unsigned int kept = 0;
    for (unsigned int i = 0; i < n && i < cap; i++) {
        unsigned int pid;
        memcpy(&pid, buf + i * elem, sizeof(pid));
        for (int j = 0; j < nours; j++)
            if (ours[j].host_pid && ours[j].host_pid == pid) {
                unsigned int mine = (unsigned int)ours[j].pid;
                memmove(buf + kept * elem, buf + i * elem, elem);
                memcpy(buf + kept * elem, &mine, sizeof(mine));
                kept++;
                break;
            }
    }
    pthread_mutex_unlock(&ours_lock);
    VGPU_TRACE("nvml process list: %u of %u processes are the container's", kept, n);
    if (!infos || *count < kept) {
        rc = kept ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    } else {
        memcpy(infos, buf, kept * elem);
    }
    *count = kept;
    free(buf);
    return rc;
}

#define PROCESSES(sym, type)                                                                     \
    VGPU_EXPORT nvmlReturn_t sym(nvmlDevice_t dev, unsigned int *count, type *infos)             \
    {                                                                                            \
        return own_processes(VGPU_N_##sym, dev, count, infos, sizeof(type));                     \
    }

PROCESSES(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t)
PROCESSES(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_v2_t)
PROCESSES(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_v2_t)
PROCESSES(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t)
PROCESSES(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_v2_t)
PROCESSES(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_v2_t)
PROCESSES(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t)
PROCESSES(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_v2_t)
PROCESSES(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_v2_t)
