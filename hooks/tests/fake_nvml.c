/*
 * A stand-in libnvidia-ml.so.1 over the stand-in GPU (fake_gpu.h): every
 * process with a context on a card is listed with its host pid and its
 * device memory; its SM utilisation is the share of the time since the
 * caller's previous query that its kernels ran on the card.
 *   FAKE_NVML_UTIL_UNSUPPORTED  per-process utilisation unsupported (as on MIG)
 *   FAKE_NVML_NO_PROCESS_MEMORY usedGpuMemory not available (as in some containers)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../nvml_types.h"
#include "fake_gpu.h"

#define UNINITIALIZED 1
#define INVALID_ARGUMENT 2

nvmlReturn_t nvmlInit_v2(void) { return NVML_SUCCESS; }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return NVML_SUCCESS; }
nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) { *n = FAKE_CARDS; return NVML_SUCCESS; }

static int card_of(nvmlDevice_t d) { return (int)((uintptr_t)d - 1); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d)
{
    if (i >= FAKE_CARDS)
        return INVALID_ARGUMENT;
    *d = (nvmlDevice_t)(uintptr_t)(i + 1);
    return NVML_SUCCESS;
}

static void uuid_text(int card, char *out, unsigned int len)
{
    unsigned char b[16];
    fake_uuid_bytes(card, b);
    snprintf(out, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *out, unsigned int len)
{
    if (!out || len < 41)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    uuid_text(card_of(d), out, len);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *out, unsigned int len)
{
    if (!out || len < 16)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(out, len, "Stand-in GPU %d", card_of(d));
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *minor)
{
    *minor = (unsigned int)card_of(d);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *d)
{
    char text[96];
    for (int card = 0; card < FAKE_CARDS; card++) {
        uuid_text(card, text, sizeof(text));
        if (uuid && strcasecmp(uuid + 4, text + 4) == 0) {
            *d = (nvmlDevice_t)(uintptr_t)(card + 1);
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

static uint64_t total_bytes(void)
{
    const char *s = getenv("FAKE_CUDA_TOTAL_MIB");
    return (s ? strtoull(s, NULL, 10) : 80 * 1024ull) << 20;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    struct fake_gpu *g = fake_gpu();
    uint64_t used = 0;
    fake_lock(g);
    for (int i = 0; i < FAKE_MAX_PROCS; i++)
        if (fake_alive(g->procs[i].pid))
            used += g->procs[i].used[card_of(d)];
    fake_unlock(g);
    m->total = total_bytes();
    m->used = used;
    m->free = m->total - used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    nvmlMemory_t v1;
    nvmlDeviceGetMemoryInfo(d, &v1);
    m->total = v1.total;
    m->reserved = 300ull << 20;
    m->used = v1.used;
    m->free = v1.free - m->reserved;
    return NVML_SUCCESS;
}

/* Every live process with a context on the card: host pid and memory. */
static nvmlReturn_t processes(nvmlDevice_t d, unsigned int *count, void *infos, size_t elem)
{
    struct fake_gpu *g = fake_gpu();
    nvmlProcessInfo_v2_t list[FAKE_MAX_PROCS];
    int32_t pids[FAKE_MAX_PROCS];
    int index[FAKE_MAX_PROCS];
    unsigned int n = 0, live = 0, dead = 0;
    int card = card_of(d);
    int no_memory = getenv("FAKE_NVML_NO_PROCESS_MEMORY") != NULL;
    /* A snapshot under the lock, liveness checked after it: the lock is held
     * for a copy only, as a driver's process list does not serialise the card. */
    fake_lock(g);
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        const struct fake_proc *p = &g->procs[i];
        if (p->pid <= 0 || !(p->ctx_mask & (1u << card)))
            continue;
        pids[n] = p->pid;
        index[n] = i;
        list[n].pid = p->host_pid;
        list[n].usedGpuMemory =
            no_memory ? NVML_VALUE_NOT_AVAILABLE : p->used[card];
        list[n].gpuInstanceId = list[n].computeInstanceId = ~0u;
        n++;
    }
    fake_unlock(g);
    for (unsigned int i = 0; i < n; i++) {
        if (fake_alive(pids[i])) {
            list[live++] = list[i];
        } else {
            pids[dead] = pids[i];
            index[dead++] = index[i];
        }
    }
    n = live;
    /* A process that exited holds no context any more (a driver tears its
     * contexts down with it): its record is freed, so that later lists do not
     * probe it again (after a storm, hundreds of dead ones). */
    if (dead) {
        fake_lock(g);
        for (unsigned int i = 0; i < dead; i++)
            if (g->procs[index[i]].pid == pids[i])
                g->procs[index[i]].pid = 0;
        fake_unlock(g);
    }
    if (!infos || *count < n) {
        *count = n;
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    for (unsigned int i = 0; i < n; i++) {
        char *at = (char *)infos + i * elem;
        memcpy(at, &list[i].pid, sizeof(unsigned int));
        memcpy(at + 8, &list[i].usedGpuMemory, sizeof(unsigned long long));
        if (elem == sizeof(nvmlProcessInfo_v2_t))
            memcpy(at, &list[i], elem);
    }
    *count = n;
    return NVML_SUCCESS;
}

#define PROCESSES(name, type)                                                                    \
    nvmlReturn_t name(nvmlDevice_t d, unsigned int *count, type *infos)                          \
    {                                                                                            \
        return processes(d, count, infos, sizeof(type));                                         \
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

/* The caller's previous reading of each process, to turn busy time into utilisation. */
static struct {
    int32_t pid;
    int64_t at, busy;
} seen[FAKE_MAX_PROCS][FAKE_CARDS];

/* The card's utilisation since this caller's previous reading: the time its
 * timeline ran kernels (the card serialises them, so what is queued beyond
 * now is one stretch up to free_at). */
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u)
{
    static struct {
        int64_t at, busy;
    } last[FAKE_CARDS];
    if (getenv("FAKE_NVML_UTIL_UNSUPPORTED"))
        return NVML_ERROR_NOT_SUPPORTED;
    if (!u)
        return INVALID_ARGUMENT;
    struct fake_gpu *g = fake_gpu();
    int card = card_of(d);
    fake_lock(g);
    int64_t now = fake_now();
    int64_t ahead = g->free_at[card] > now ? g->free_at[card] - now : 0;
    int64_t busy = g->scheduled_ns[card] - ahead;
    fake_unlock(g);
    double util = 0;
    if (last[card].at && now > last[card].at)
        util = 100.0 * (double)(busy - last[card].busy) / (double)(now - last[card].at);
    last[card].at = now;
    last[card].busy = busy;
    u->gpu = (unsigned int)(util < 0 ? 0 : util > 100 ? 100 : util + 0.5);
    u->memory = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *s,
                                             unsigned int *count, unsigned long long last_seen)
{
    (void)last_seen;
    if (getenv("FAKE_NVML_UTIL_UNSUPPORTED"))
        return NVML_ERROR_NOT_SUPPORTED;
    if (!count)
        return INVALID_ARGUMENT;
    struct fake_gpu *g = fake_gpu();
    int card = card_of(d);
    unsigned int n = 0;
    if (!s) { /* the size query, as the real NVML answers it: nothing consumed */
        int32_t pids[FAKE_MAX_PROCS];
        unsigned int listed = 0;
        fake_lock(g);
        for (int i = 0; i < FAKE_MAX_PROCS; i++)
            if (g->procs[i].pid > 0 && (g->procs[i].ctx_mask & (1u << card)))
                pids[listed++] = g->procs[i].pid;
        fake_unlock(g);
        for (unsigned int i = 0; i < listed; i++) /* liveness outside the lock */
            n += fake_alive(pids[i]);
        *count = n;
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_ERROR_NOT_FOUND;
    }
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    unsigned long long stamp = (unsigned long long)wall.tv_sec * 1000000ull + wall.tv_nsec / 1000;
    /* Busy times under the lock (memory only), liveness after it. */
    static struct {
        int index;
        int32_t pid;
        uint32_t host_pid;
        int64_t busy;
    } snap[FAKE_MAX_PROCS];
    unsigned int taken = 0;
    fake_lock(g);
    int64_t now = fake_now();
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        const struct fake_proc *p = &g->procs[i];
        if (p->pid <= 0 || !(p->ctx_mask & (1u << card)))
            continue;
        snap[taken].index = i;
        snap[taken].pid = p->pid;
        snap[taken].host_pid = p->host_pid;
        snap[taken].busy = fake_busy(p, card, now);
        taken++;
    }
    fake_unlock(g);
    for (unsigned int k = 0; k < taken; k++) {
        int i = snap[k].index;
        int64_t busy = snap[k].busy;
        if (!fake_alive(snap[k].pid))
            continue;
        if (seen[i][card].pid == snap[k].pid && now > seen[i][card].at && n < *count) {
            double util = 100.0 * (double)(busy - seen[i][card].busy) / (double)(now - seen[i][card].at);
            s[n].pid = snap[k].host_pid;
            s[n].timeStamp = stamp;
            s[n].smUtil = (unsigned int)(util < 0 ? 0 : util > 100 ? 100 : util + 0.5);
            s[n].memUtil = s[n].encUtil = s[n].decUtil = 0;
            n++;
        }
        seen[i][card].pid = snap[k].pid;
        seen[i][card].at = now;
        seen[i][card].busy = busy;
    }
    *count = n;
    return n ? NVML_SUCCESS : NVML_ERROR_NOT_FOUND;
}
