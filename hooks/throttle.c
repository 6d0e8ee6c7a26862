/*
 * Compute limit: a token bucket of GPU time in front of every kernel launch.
 *
 * Tokens are nanoseconds of GPU time, earned at `limit x gain` of real time.
 * The bucket is refilled lazily: a launch that finds it empty credits the time
 * elapsed since the last refill and, if that is not enough, sleeps for as long
 * as the debt takes to earn back (woken sooner when the rate rises or the
 * bucket disengages); nothing wakes periodically to refill (in a
 * container of hundreds of processes, hundreds of threads ticking every few
 * milliseconds would slow everyone's start-up).  A background thread, every
 * control period (50 ms), reads SM utilisation from NVML for the container's
 * own processes (by their host pids, which NVML reports):
 *  - each launch costs its estimated GPU time: a kernel the mean measured
 *    over the last periods with samples (this process's busy time / its
 *    launches in those same periods), a graph
 *    launch its own measured duration (CUDA events around a sample of its
 *    launches), so a graph of many kernels is not charged as one small one;
 *  - a launch waits while the bucket is empty and then takes its cost, which
 *    may leave it in debt: a kernel longer than the refill period delays the
 *    next launch by as long as it must, so long kernels converge too;
 *  - every 200 ms, gain <- gain x clamp(limit / utilisation, 0.7, 1.4)
 *    corrects what the estimates miss (other processes of the container,
 *    overlap), the limit being the mean allowed share over those 200 ms; a
 *    new cost estimate rescales the gain with it (same launches per second),
 *    so that an error is corrected once, by the step, not twice; a window in
 *    which the arbiter moved the limit leaves the gain as it was.
 * Until the container's utilisation first exceeds the limit the bucket is not
 * engaged (launches pay one atomic increment); it engages with the gain at
 * this process's part of the container's work (1/N of the limit for N equal
 * processes), and disengages again when the
 * program uses far less than the bucket allows.  Without NVML, or without
 * per-process utilisation (MIG), one line says the limit is not enforced.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "vgpu.h"

#define CONTROL_NS 50000000ll /* control period */
#define MIN_WAIT_NS 2500000ll /* shortest sleep of a launch waiting for tokens (fewer wake-ups) */
#define MAX_WAIT_NS 1000000000ll /* longest one: a raised rate or a disengagement wakes it sooner */
#define RATE_SHIFT 20        /* rate: tokens per ns of real time, fixed point */
#define BURST_NS 20000000ll  /* the bucket holds 20 ms worth of the allowed rate */
#define MAX_SAMPLES 512
#define MAX_GRAPHS 64
#define MEASURE_EVERY 16     /* graph launches between two measurements */
#define WINDOW 4             /* control periods per gain step (200 ms) */
#define GAIN_MIN (1.0 / VGPU_MAX_SLOTS) /* a container's slots can share its limit */
#define GAIN_MAX 50.0

enum { OFF_UNKNOWN, OFF, RUNNING };

static struct {
    nvmlDevice_t devices[VGPU_MAX_DEVICES];
    char uuids[VGPU_MAX_DEVICES][NVML_DEVICE_UUID_V2_BUFFER_SIZE]; /* "" = not known */
    unsigned long long last_seen[VGPU_MAX_DEVICES];
    unsigned int device_count;
} nvml;

static int state = OFF_UNKNOWN;
static int engaged;               /* the bucket is in force */
static long long tokens;          /* ns of GPU time; negative = debt */
static long long refilled_at;     /* CLOCK_MONOTONIC ns the tokens were credited up to */
static long long rate_fp;         /* limit x gain, << RATE_SHIFT; 0: not engaged yet */
static long long kernel_cost_ns = 100000; /* estimate per kernel launch */
static unsigned long long kernel_launches;
static long long graph_ns;        /* GPU time charged to graph launches this period */
static unsigned long long bucket_waits; /* launches that found the bucket empty */
/* Launches waiting for tokens sleep on `wake_seq` (a private futex) until their
 * debt is earned back at the rate they saw; a raised rate or a disengaged
 * bucket bumps it and wakes them.  A fixed short sleep (10 ms) instead woke a
 * process with a small share many times per launch: a greedy tenant held to
 * 5 % with 5 ms kernels woke 127 times a second, 59 now (its controller's 20
 * periods included). */
static uint32_t wake_seq;
static int sleepers;
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;

typedef CUresult (*event_create_fn)(CUevent *, unsigned int);
typedef CUresult (*event_record_fn)(CUevent, CUstream);
typedef CUresult (*event_query_fn)(CUevent);
typedef CUresult (*event_elapsed_fn)(float *, CUevent, CUevent);

static struct graph {
    CUgraphExec exec;
    long long cost_ns; /* measured; 0 = not yet */
    CUevent start, end;
    int pending, broken;
    unsigned int launches;
} graphs[MAX_GRAPHS];
static int graph_victim;
static pthread_mutex_t graph_lock = PTHREAD_MUTEX_INITIALIZER;

static void sleep_ns(long long ns)
{
    struct timespec ts = {ns / 1000000000ll, ns % 1000000000ll};
    nanosleep(&ts, NULL);
}

/*
 * Credits the tokens earned since the last refill, up to a full bucket
 * (BURST_NS of the rate).  A bucket in debt earns for the whole interval: a
 * launch that slept a second for its tokens is owed the whole second (an
 * interval clipped to BURST_NS, as before, paid a debt back at 20 ms per
 * refill however long the wait).  Any thread may call it; the one whose
 * compare-and-swap moves `refilled_at` credits that interval, so no time is
 * counted twice.
 */
static void refill(long long t)
{
    long long last = __atomic_load_n(&refilled_at, __ATOMIC_ACQUIRE);
    if (t <= last ||
        !__atomic_compare_exchange_n(&refilled_at, &last, t, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return;
    long long rate = __atomic_load_n(&rate_fp, __ATOMIC_RELAXED), elapsed = t - last;
    long long cap = (BURST_NS * rate) >> RATE_SHIFT;
    long long cur = __atomic_load_n(&tokens, __ATOMIC_RELAXED);
    if (rate <= 0 || cur >= cap)
        return;
    /* the time that fills the bucket: no more is credited (nor multiplied,
     * so that an idle hour cannot overflow the product) */
    long long room = cap - cur, fill_ns = (room << RATE_SHIFT) / rate + 1;
    long long add = ((elapsed < fill_ns ? elapsed : fill_ns) * rate) >> RATE_SHIFT;
    if (add > room)
        add = room;
    if (add)
        __atomic_fetch_add(&tokens, add, __ATOMIC_RELEASE);
}

/* Launches asleep for tokens look again: the rate rose, or the bucket is off. */
static void wake_waiters(void)
{
    __atomic_fetch_add(&wake_seq, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&sleepers, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &wake_seq, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static void disengage(void)
{
    __atomic_store_n(&engaged, 0, __ATOMIC_RELEASE);
    wake_waiters();
}

/* The rate in force from now on (the time until now is credited at the old one). */
static void set_rate(double limit, double gain)
{
    refill(vgpu_now_ns());
    double r = limit / 100 * gain * (double)(1ll << RATE_SHIFT);
    long long next = (long long)(r > 1 ? r : 1);
    if (__atomic_exchange_n(&rate_fp, next, __ATOMIC_ACQ_REL) < next)
        wake_waiters();
}

static int nvml_devices(void)
{
    static int logged;
    unsigned int n = 0;
    if (vgpu_nvml_load() != 0 || !vgpu_nvml.utilization)
        return -1;
    if (vgpu_nvml.count(&n) != NVML_SUCCESS || n == 0) {
        vgpu_log(&logged, "NVML sees no device: compute limit of %d%% not enforced",
                 vgpu_cfg.core_percent);
        return -1;
    }
    for (unsigned int i = 0; i < n && nvml.device_count < VGPU_MAX_DEVICES; i++) {
        unsigned int d = nvml.device_count;
        if (vgpu_nvml.by_index(i, &nvml.devices[d]) != NVML_SUCCESS)
            continue;
        if (vgpu_nvml.uuid(nvml.devices[d], nvml.uuids[d], sizeof(nvml.uuids[d])) != NVML_SUCCESS)
            nvml.uuids[d][0] = '\0';
        nvml.uuids[d][sizeof(nvml.uuids[d]) - 1] = '\0';
        nvml.device_count++;
    }
    return nvml.device_count ? 0 : -1;
}

/* NVML's devices, loaded on the controller thread the first time this process
 * must query NVML itself: as the container's poller, or when the poller's
 * publication is stale.  The other processes of a container never load NVML
 * for the throttle (in a start-up storm, hundreds of library loads and
 * nvmlInit calls that would only follow the poller's figures).  0 when
 * usable; -1 (once and for good) when not, which has been said. */
static int nvml_ready(void)
{
    static int ready; /* controller thread only: 0 not tried, 1 usable, -1 not */
    if (!ready)
        ready = nvml.device_count || nvml_devices() == 0 ? 1 : -1;
    return ready > 0 ? 0 : -1;
}

static struct {
    uint64_t seq;
    long long seen_at;
    int following;
} arb;

struct util {
    double self;      /* this process */
    double container; /* the container's processes */
    int self_unknown; /* its host pid is not known: self is the container's */
};

/* One device's new samples, one entry per host pid (the mean of its samples),
 * sorted by pid: controller thread only. */
struct pid_util {
    unsigned int pid;
    double util;
};
static struct pid_util per_pid[VGPU_MAX_DEVICES][MAX_SAMPLES];
static int per_pid_count[VGPU_MAX_DEVICES];

static int by_pid(const void *a, const void *b)
{
    unsigned int x = ((const struct pid_util *)a)->pid, y = ((const struct pid_util *)b)->pid;
    return x < y ? -1 : x > y;
}

static int by_host_pid(const void *a, const void *b)
{
    unsigned int x = ((const struct vgpu_pid *)a)->host_pid,
                 y = ((const struct vgpu_pid *)b)->host_pid;
    return x < y ? -1 : x > y;
}

static const struct pid_util *sample_of(unsigned int d, unsigned int pid)
{
    struct pid_util key = {pid, 0};
    return bsearch(&key, per_pid[d], (size_t)per_pid_count[d], sizeof(key), by_pid);
}

static double util_of(unsigned int d, unsigned int pid)
{
    const struct pid_util *hit = sample_of(d, pid);
    return hit ? hit->util : 0;
}

/*
 * What the container's small processes add to its figure.  NVML gives each
 * process's samples in whole percents, so a process with under 1 % of the card
 * reads 0 in most of them, and a container of a hundred such processes summed
 * to far less than it used (100 greedy ones under a 30 % limit held about
 * 50 % of the card).  The card's own utilisation is not rounded per process:
 * its excess over the sum of every process's samples is what the small ones
 * lost, shared out by how many of them each container has: `small` on the card
 * (summing to `all`), `ours` of them in this container.
 */
static double small_processes_lost(unsigned int d, double all, int small, int ours)
{
    nvmlUtilization_t card; /* read every period: each reading covers the time since the last */
    if (!vgpu_nvml.rates || vgpu_nvml.rates(nvml.devices[d], &card) != NVML_SUCCESS ||
        (double)card.gpu <= all || !ours)
        return 0;
    return ((double)card.gpu - all) * ours / small;
}

/*
 * SM utilisation (percent) of one device's new samples: per process the mean
 * of its samples; summed over the container's host pids (`pids`, sorted by
 * host pid), and this process's alone.  O(n log n) in the samples and pids:
 * hundreds of processes poll this.  Returns -1 when NVML has no new sample,
 * -2 when it has none to give (not supported, e.g. MIG).
 */
static int device_util(unsigned int d, const struct vgpu_pid *pids, int npids, unsigned self,
                       struct util *out)
{
    static int logged;
    static nvmlProcessUtilizationSample_t samples[MAX_SAMPLES]; /* controller thread only */
    unsigned int n = MAX_SAMPLES;
    per_pid_count[d] = 0;
    nvmlReturn_t rc = vgpu_nvml.utilization(nvml.devices[d], samples, &n, nvml.last_seen[d]);
    if (rc == NVML_ERROR_NOT_SUPPORTED)
        return -2;
    if (rc != NVML_SUCCESS || n == 0)
        return -1;
    n = n < MAX_SAMPLES ? n : MAX_SAMPLES;
    struct pid_util *agg = per_pid[d];
    unsigned int counts[MAX_SAMPLES];
    for (unsigned int i = 0; i < n; i++) {
        if (samples[i].timeStamp > nvml.last_seen[d])
            nvml.last_seen[d] = samples[i].timeStamp;
        agg[i] = (struct pid_util){samples[i].pid, samples[i].smUtil};
    }
    qsort(agg, n, sizeof(*agg), by_pid);
    int m = 0;
    for (unsigned int i = 0; i < n; i++) { /* sum per pid, then the mean */
        if (m && agg[m - 1].pid == agg[i].pid) {
            agg[m - 1].util += agg[i].util;
            counts[m - 1]++;
        } else {
            agg[m] = agg[i];
            counts[m++] = 1;
        }
    }
    double all = 0;
    int small = 0, ours = 0; /* processes under 1 % of the card, and the container's */
    *out = (struct util){0, 0, 0};
    for (int i = 0; i < m; i++) {
        agg[i].util /= counts[i];
        all += agg[i].util;
        small += agg[i].util < 1;
    }
    per_pid_count[d] = m;
    int known = 0;
    for (int i = 0; i < npids; i++) { /* each host pid once (sorted) */
        if (!pids[i].host_pid || (i && pids[i].host_pid == pids[i - 1].host_pid))
            continue;
        known = 1;
        const struct pid_util *hit = sample_of(d, pids[i].host_pid);
        if (hit) {
            out->container += hit->util;
            ours += hit->util < 1;
        }
    }
    if (known) {
        out->container += small_processes_lost(d, all, small, ours);
        if (out->container > 100)
            out->container = 100;
    }
    if (self)
        out->self = util_of(d, self);
    if (!known) {
        /* The node daemon tells this container's first host pid within its
         * next period: until then, no sample.  The whole card's utilisation
         * would engage the throttle on the neighbours' work, and charge each
         * of this process's kernels with theirs (a newcomer held to a
         * fraction of its share for as long as the gain took to recover). */
        if (vgpu_device_host_pid_awaiting())
            return -1;
        if (!vgpu_device_host_pid_pending()) /* else said once that is settled */
            vgpu_log(&logged, "no host pid of this container is known (no context seen); "
                     "throttling on the whole card's utilisation");
        out->container = all;
    }
    if (!self) {
        out->self = out->container;
        out->self_unknown = 1;
    }
    return 0;
}

/* The busiest device's figures; -1 without new samples, -2 if unsupported everywhere,
 * -3 without NVML.
 * `publish`: this process is the container's poller and writes what it saw. */
static int container_util(struct util *u, int publish)
{
    static struct vgpu_pid pids[VGPU_MAX_SLOTS]; /* controller thread only */
    if (nvml_ready() != 0)
        return -3;
    int npids = vgpu_budget_peek_pids(pids, VGPU_MAX_SLOTS);
    qsort(pids, (size_t)npids, sizeof(pids[0]), by_host_pid);
    unsigned self = vgpu_budget_host_pid();
    int rc = -2, busiest = -1;
    *u = (struct util){-1, -1, 0};
    /* Only the cards the container uses (its budget file's entries): each
     * query is O(processes on the card) in the driver, and a card it has no
     * context on tells nothing about it.  Every card while no entry names one
     * NVML shows (none yet, or entries under other names, e.g. "device-N"
     * where the driver gave no UUID). */
    unsigned char used[VGPU_MAX_DEVICES];
    int any = 0;
    for (unsigned int d = 0; d < nvml.device_count; d++) {
        int known = nvml.uuids[d][0] ? vgpu_budget_uses_card(nvml.uuids[d]) : -1;
        used[d] = known != 0;
        any |= known == 1;
    }
    for (unsigned int d = 0; d < nvml.device_count; d++) {
        if (any && !used[d])
            continue;
        struct util du;
        int r = device_util(d, pids, npids, self, &du);
        if (r == -1 && rc == -2)
            rc = -1;
        if (r == 0) {
            rc = 0;
            if (du.container > u->container) {
                *u = du;
                busiest = (int)d;
            }
        }
    }
    if (publish) {
        vgpu_budget_poll_begin();
        for (int i = 0; busiest >= 0 && i < npids; i++)
            if (pids[i].host_pid)
                vgpu_budget_poll_slot(pids[i].slot, util_of((unsigned)busiest, pids[i].host_pid));
        vgpu_budget_poll_end(rc == 0 ? VGPU_POLL_OK : rc == -1 ? VGPU_POLL_NO_SAMPLE
                                                               : VGPU_POLL_UNSUPPORTED,
                             rc == 0 ? u->container : 0, vgpu_now_ns());
    }
    return rc;
}

/*
 * The container's utilisation for this control period.  One process of the
 * container (the poller) queries NVML and publishes what it saw in the budget
 * file; the others read that, so a container of hundreds of processes runs one
 * NVML query per period, not hundreds.  A publication that stops (the poller
 * died or hangs) is taken over by the next process that finds it stale; a
 * process without a shared file polls for itself.
 */
static struct {
    uint32_t seq;      /* the publication last used */
    long long stale_since;
} followed;

static int sampled_util(struct util *u)
{
    int role = vgpu_budget_poll_take();
    if (role != 0) /* the poller publishes; a process without a shared file polls alone */
        return container_util(u, role > 0);
    struct vgpu_poll p;
    long long t = vgpu_now_ns();
    int have = vgpu_budget_poll_read(&p) == 0;
    if (have && t - p.at_ns <= VGPU_POLL_STALE_MS * 1000000ll && p.at_ns <= t + 1000000000ll) {
        followed.stale_since = 0;
        if (p.seq == followed.seq)
            return -1; /* nothing new since the last period */
        followed.seq = p.seq;
        if (p.rc != VGPU_POLL_OK)
            return p.rc == VGPU_POLL_UNSUPPORTED ? -2 : -1;
        unsigned self = vgpu_budget_host_pid();
        *u = (struct util){self ? p.self : p.container, p.container, !self};
        return 0;
    }
    /* No poller, or a stale one that still holds the lock (hung, or starved of
     * CPU): after as long again, poll for ourselves without publishing. */
    if (!followed.stale_since)
        followed.stale_since = t;
    if (t - followed.stale_since < VGPU_POLL_STALE_MS * 1000000ll)
        return -1;
    return container_util(u, 0);
}

static double clamp(double v, double lo, double hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

/*
 * The limit in force: the allowed share the node daemon's arbiter writes into
 * the budget file while its sequence keeps moving, else the guarantee
 * (VGPU_CORE_LIMIT) as a fixed cap.  A stopped daemon is noticed once the
 * sequence has not moved for VGPU_ARBITER_STALE_MS.
 */

static double current_limit(void)
{
    static int said_stale;
    double guarantee = vgpu_cfg.core_percent;
    uint64_t word = vgpu_budget_arbiter();
    uint64_t seq = word >> VGPU_ARBITER_SEQ_SHIFT, centi = word & VGPU_ARBITER_SHARE_MASK;
    long long t = vgpu_now_ns();
    if (seq && seq != arb.seq) {
        arb.seq = seq;
        arb.seen_at = t;
    }
    int fresh = arb.seq && t - arb.seen_at <= VGPU_ARBITER_STALE_MS * 1000000ll && centi <= 10000;
    if (fresh != arb.following) {
        arb.following = fresh;
        if (fresh)
            VGPU_TRACE("following the node's compute arbiter (allowed %.2f%%)", centi / 100.0);
        else if (arb.seq)
            vgpu_log(&said_stale, "the node's compute arbiter stopped updating the budget "
                     "file: back to the guarantee of %d%% as a fixed cap", vgpu_cfg.core_percent);
    }
    if (!fresh)
        return guarantee;
    double allowed = centi / 100.0;
    return allowed < 0.5 ? 0.5 : allowed;
}

static void *controller(void *arg)
{
    static int logged;
    (void)arg;
    double limit = 0, gain = 1;
    unsigned long long seen = __atomic_load_n(&kernel_launches, __ATOMIC_RELAXED), waits_seen = 0;
    long long since = vgpu_now_ns();
    int unsupported = 0;
    if (!vgpu_cfg.shared_dir && nvml_ready() != 0) { /* it would poll for itself: no NVML, no limit */
        __atomic_store_n(&state, OFF, __ATOMIC_RELEASE);
        return NULL;
    }
    /* A window of WINDOW control periods: utilisation averaged over it
     * steers the gain and the kernel cost estimate. */
    struct window {
        double util_ns, self_ns, limit_ns; /* utilisation (and the limit in force) x time */
        double limit_lo, limit_hi;         /* the limit's range over the window */
        long long dt, graphs_ns;
        unsigned long long launches;
        int periods;
        int self_unknown; /* in some period its host pid was not known */
    } w = {0};
    for (;;) {
        sleep_ns(CONTROL_NS); /* launches refill the bucket themselves */
        limit = current_limit();
        if (__atomic_load_n(&engaged, __ATOMIC_ACQUIRE))
            set_rate(limit, gain); /* the arbiter's share moves every period */
        long long t = vgpu_now_ns(), dt = t - since;
        unsigned long long count = __atomic_load_n(&kernel_launches, __ATOMIC_RELAXED);
        unsigned long long launched = count - seen;
        long long graphs = __atomic_exchange_n(&graph_ns, 0, __ATOMIC_RELAXED);
        seen = count;
        since = t;
        vgpu_device_retry_host_pid();
        struct util u;
        int rc = sampled_util(&u);
        if (rc == -3) { /* no NVML in this process either: said by nvml_devices */
            disengage();
            __atomic_store_n(&state, OFF, __ATOMIC_RELEASE);
            return NULL;
        }
        unsupported = rc == -2 ? unsupported + 1 : 0;
        if (unsupported >= 3) {
            vgpu_log(&logged, "NVML has no per-process utilisation for this device (MIG or "
                     "unsupported): compute limit of %d%% not enforced", vgpu_cfg.core_percent);
            disengage();
            __atomic_store_n(&state, OFF, __ATOMIC_RELEASE);
            return NULL;
        }
        if (rc != 0)
            continue;
        /* The window holds the launches of the periods it has samples for, so
         * that busy time / launches is a kernel's cost (a period without a new
         * sample, like the first, counted its launches against no busy time). */
        w.launches += launched;
        w.graphs_ns += graphs;
        w.util_ns += u.container * (double)dt;
        w.self_ns += u.self * (double)dt;
        w.self_unknown |= u.self_unknown;
        w.limit_ns += limit * (double)dt;
        if (!w.dt || limit < w.limit_lo)
            w.limit_lo = limit;
        if (!w.dt || limit > w.limit_hi)
            w.limit_hi = limit;
        w.dt += dt;
        int is_engaged = __atomic_load_n(&engaged, __ATOMIC_RELAXED);
        if (limit >= 99.5) { /* the arbiter lets it have the card: nothing to hold back */
            if (is_engaged) {
                disengage();
                VGPU_TRACE("throttle disengaged: the whole card is allowed");
            }
            w = (struct window){0};
            continue;
        }
        if (!is_engaged && u.container > limit) { /* engage at once */
            /* The cost of a kernel from the window so far: its busy time and its
             * launches over the same periods (the busy time of the last period
             * alone over the whole window's launches under-counted it, up to
             * WINDOW times, and the bucket started far too generous). */
            long long k = w.launches ? (long long)(w.self_ns / 100) / (long long)w.launches : 0;
            if (k > 1000)
                __atomic_store_n(&kernel_cost_ns, k, __ATOMIC_RELAXED);
            /* Its part of the container's work so far: N busy processes start
             * at a bucket of limit / N each, not N buckets of the whole limit
             * (the gain's steps took 2 s to bring 40 of them down to it, and
             * a floor of 0.02 let a container of 100 hold 64 % at a limit of
             * 30 %).  Without a measure of its own (its host pid not known
             * yet, or no busy time of its own in the samples so far): an equal
             * part of the container's live processes. */
            double part = 1;
            if (!w.self_unknown && w.self_ns > 0) {
                part = w.util_ns > w.self_ns ? w.self_ns / w.util_ns : 1;
            } else {
                int live = vgpu_budget_peek_pids(NULL, VGPU_MAX_SLOTS);
                part = live > 1 ? 1.0 / live : 1;
            }
            gain = clamp(part, GAIN_MIN, 1);
            __atomic_store_n(&rate_fp, 0, __ATOMIC_RELAXED);
            __atomic_store_n(&refilled_at, vgpu_now_ns(), __ATOMIC_RELEASE);
            __atomic_store_n(&tokens, 0, __ATOMIC_RELAXED);
            set_rate(limit, gain);
            __atomic_store_n(&engaged, 1, __ATOMIC_RELEASE);
            VGPU_TRACE("throttle engaged: utilisation %.1f%% > %d%%, kernel cost %lld ns",
                       u.container, vgpu_cfg.core_percent,
                       __atomic_load_n(&kernel_cost_ns, __ATOMIC_RELAXED));
            w = (struct window){0};
            continue;
        }
        if (++w.periods < WINDOW)
            continue;
        double util = w.util_ns / (double)w.dt, self = w.self_ns / (double)w.dt;
        /* What the utilisation is held against: the limit as it was over the
         * window (the arbiter may have moved it in between), not the new one. */
        double held = w.limit_ns / (double)w.dt, gain_was = gain;
        long long busy = (long long)(self / 100 * (double)w.dt);
        /* A window with launches but no busy time of its own measured says
         * nothing of a kernel's cost: NVML gives whole percents, and a process
         * with a small part of a busy container reads 0 % in most windows
         * (taken as a cost, it halved the estimate window after window). */
        if (w.launches > 0 && w.self_ns > 0) {
            long long k = (busy - w.graphs_ns) / (long long)w.launches;
            k = k > 1000 ? k : 1000;
            long long prev = __atomic_load_n(&kernel_cost_ns, __ATOMIC_RELAXED);
            long long next = (prev + k) / 2;
            /* The gain already corrects the old estimate's error: keep the bucket's
             * launches per second as they were, so that the step below (from
             * what they achieved) is the only correction, not applied twice;
             * where the gain is at a bound, the estimate moves only as far as
             * the gain can follow. */
            if (is_engaged && prev > 0) {
                double scaled = gain * (double)next / (double)prev;
                double bounded = clamp(scaled, GAIN_MIN, GAIN_MAX);
                next = (long long)((double)next * bounded / scaled);
                gain = bounded;
            }
            __atomic_store_n(&kernel_cost_ns, next, __ATOMIC_RELAXED);
        }
        if (is_engaged) {
            long long spent = (long long)w.launches *
                                  __atomic_load_n(&kernel_cost_ns, __ATOMIC_RELAXED) +
                              w.graphs_ns;
            double allowed = limit / 100 * gain * (double)w.dt;
            double step = clamp(held / (util > 0.5 ? util : 0.5), 0.7, 1.4);
            unsigned long long waits = __atomic_load_n(&bucket_waits, __ATOMIC_RELAXED);
            /* Raise the gain only when the bucket held launches back: below
             * the limit for another reason (neighbours on the card, the
             * program itself) a raise would wind up and overshoot later.
             * Keep it over a window in which the arbiter moved the limit (a
             * neighbour came, left or burst): its utilisation measured the
             * card's re-division, not this throttle's error, and a tenant cut
             * from 60 % to 30 % while a newcomer's kernels crowded it would
             * otherwise raise its gain and hold on to 40 % for a window. */
            double moved = w.limit_hi - w.limit_lo, tolerance = w.limit_hi / 10;
            if (moved <= (tolerance > 2 ? tolerance : 2) && (step < 1 || waits != waits_seen))
                gain = clamp(gain * step, GAIN_MIN, GAIN_MAX);
            if (gain != gain_was)
                set_rate(limit, gain);
            waits_seen = waits;
            if (util < limit && (double)spent * 4 < allowed &&
                __atomic_load_n(&tokens, __ATOMIC_RELAXED) >= 0) {
                disengage();
                VGPU_TRACE("throttle disengaged: utilisation %.1f%%", util);
            }
            VGPU_TRACE("throttle: utilisation %.1f%% (this process %.1f%%), gain %.3f, "
                       "kernel cost %lld ns", util, self, gain,
                       __atomic_load_n(&kernel_cost_ns, __ATOMIC_RELAXED));
        }
        w = (struct window){0};
    }
    return NULL;
}

static void start(void)
{
    pthread_mutex_lock(&start_lock);
    if (__atomic_load_n(&state, __ATOMIC_ACQUIRE) == OFF_UNKNOWN) {
        int next = OFF;
        { /* NVML is loaded by the thread, when it must poll (nvml_ready) */
            sigset_t all, old;
            pthread_t thread;
            pthread_attr_t attr;
            sigfillset(&all);
            pthread_sigmask(SIG_SETMASK, &all, &old); /* no program signal lands on our thread */
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            if (pthread_create(&thread, &attr, controller, NULL) == 0)
                next = RUNNING;
            pthread_attr_destroy(&attr);
            pthread_sigmask(SIG_SETMASK, &old, NULL);
        }
        __atomic_store_n(&state, next, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&start_lock);
}

/* 1 if launches are being controlled (and counted). */
static inline int controlled(void)
{
    vgpu_init();
    if (!vgpu_cfg.core_percent)
        return 0;
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (__builtin_expect(s == OFF_UNKNOWN, 0)) {
        start();
        s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    }
    return s == RUNNING;
}

/* Waits for tokens, then takes `cost` ns of them (cost 0: a kernel's estimate). */
static inline void wait_tokens(long long cost)
{
    if (__builtin_expect(!__atomic_load_n(&engaged, __ATOMIC_ACQUIRE), 1))
        return;
    long long since = 0;
    for (;;) {
        uint32_t seq = __atomic_load_n(&wake_seq, __ATOMIC_SEQ_CST);
        if (!__atomic_load_n(&engaged, __ATOMIC_ACQUIRE))
            break;
        long long have = __atomic_load_n(&tokens, __ATOMIC_ACQUIRE);
        if (have <= 0) { /* empty: credit the time since the last refill */
            refill(vgpu_now_ns());
            have = __atomic_load_n(&tokens, __ATOMIC_ACQUIRE);
        }
        if (have > 0) {
            __atomic_fetch_sub(&tokens,
                               cost ? cost : __atomic_load_n(&kernel_cost_ns, __ATOMIC_RELAXED),
                               __ATOMIC_ACQ_REL);
            break;
        }
        if (!since) {
            since = vgpu_now_ns();
            vgpu_budget_note_wait();
            __atomic_fetch_add(&bucket_waits, 1, __ATOMIC_RELAXED);
        }
        /* Sleep until the debt is earned back at this rate, or until woken. */
        long long rate = __atomic_load_n(&rate_fp, __ATOMIC_RELAXED);
        double need = rate > 0 ? (double)(1 - have) * (double)(1ll << RATE_SHIFT) / (double)rate
                               : (double)MAX_WAIT_NS;
        long long ns = need < (double)MIN_WAIT_NS   ? MIN_WAIT_NS
                       : need > (double)MAX_WAIT_NS ? MAX_WAIT_NS
                                                    : (long long)need + 1;
        struct timespec ts = {ns / 1000000000ll, ns % 1000000000ll};
        __atomic_fetch_add(&sleepers, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&wake_seq, __ATOMIC_SEQ_CST) == seq)
            syscall(SYS_futex, &wake_seq, FUTEX_WAIT_PRIVATE, seq, &ts, NULL, 0);
        __atomic_fetch_sub(&sleepers, 1, __ATOMIC_SEQ_CST);
    }
    if (since)
        VGPU_TRACE("launch waited %lld us for tokens", (vgpu_now_ns() - since) / 1000);
}

static inline void kernel_launch(void)
{
    if (!controlled())
        return;
    __atomic_fetch_add(&kernel_launches, 1, __ATOMIC_RELAXED);
    wait_tokens(0);
}

/* ---- graphs: charged by their measured duration ---- */

static void *driver_fn(void **cache, const char *name)
{
    void *f = __atomic_load_n(cache, __ATOMIC_ACQUIRE);
    if (!f) {
        f = vgpu_cuda_sym(name);
        __atomic_store_n(cache, f, __ATOMIC_RELEASE);
    }
    return f;
}

/* Before a graph launch: its cost, and the record to measure it into (or NULL). */
static long long graph_cost(CUgraphExec exec, struct graph **measure)
{
    static void *fq, *fe;
    event_query_fn query = (event_query_fn)driver_fn(&fq, "cuEventQuery");
    event_elapsed_fn elapsed = (event_elapsed_fn)driver_fn(&fe, "cuEventElapsedTime");
    pthread_mutex_lock(&graph_lock);
    struct graph *g = NULL;
    for (int i = 0; i < MAX_GRAPHS && !g; i++)
        if (graphs[i].exec == exec)
            g = &graphs[i];
    if (!g) { /* a new one takes the next record in turn, keeping its events */
        g = &graphs[graph_victim];
        graph_victim = (graph_victim + 1) % MAX_GRAPHS;
        g->exec = exec;
        g->cost_ns = 0;
        g->pending = 0;
        g->launches = 0;
    }
    float ms;
    if (g->pending && query && elapsed && query(g->end) == CUDA_SUCCESS) {
        g->pending = 0;
        if (elapsed(&ms, g->start, g->end) == CUDA_SUCCESS && ms >= 0) {
            long long measured = (long long)(ms * 1e6);
            g->cost_ns = g->cost_ns ? (g->cost_ns + measured) / 2 : measured;
            VGPU_TRACE("graph %p measured at %lld us", (void *)exec, measured / 1000);
        }
    }
    long long cost = g->cost_ns;
    *measure = !g->broken && !g->pending && g->launches++ % MEASURE_EVERY == 0 ? g : NULL;
    pthread_mutex_unlock(&graph_lock);
    return cost ? cost : __atomic_load_n(&kernel_cost_ns, __ATOMIC_RELAXED);
}

static int record(struct graph *g, CUevent *event, CUstream stream)
{
    static void *fc, *fr;
    event_create_fn create = (event_create_fn)driver_fn(&fc, "cuEventCreate");
    event_record_fn rec = (event_record_fn)driver_fn(&fr, "cuEventRecord");
    if (!create || !rec || (!*event && create(event, 0) != CUDA_SUCCESS) ||
        rec(*event, stream) != CUDA_SUCCESS) {
        g->broken = 1; /* e.g. the stream is another context's: charged as kernels */
        return -1;
    }
    return 0;
}

#define GRAPH(exec, stream, call)                                                                \
    do {                                                                                         \
        VGPU_TRACE("%s(%p)", __func__, (void *)(exec));                                          \
        if (!controlled())                                                                       \
            return (call);                                                                       \
        struct graph *g_;                                                                        \
        long long cost_ = graph_cost(exec, &g_);                                                 \
        __atomic_fetch_add(&graph_ns, cost_, __ATOMIC_RELAXED);                                  \
        wait_tokens(cost_);                                                                      \
        if (g_ && record(g_, &g_->start, stream) != 0)                                           \
            g_ = NULL;                                                                           \
        CUresult rc_ = (call);                                                                   \
        if (g_ && rc_ == CUDA_SUCCESS && record(g_, &g_->end, stream) == 0) {                    \
            pthread_mutex_lock(&graph_lock);                                                     \
            g_->pending = g_->exec == (exec);                                                    \
            pthread_mutex_unlock(&graph_lock);                                                   \
        }                                                                                        \
        return rc_;                                                                              \
    } while (0)

void vgpu_throttle_after_fork(void)
{
    /* The controller thread did not survive the fork; start it again lazily. */
    pthread_mutex_init(&start_lock, NULL);
    pthread_mutex_init(&graph_lock, NULL);
    memset(graphs, 0, sizeof(graphs)); /* their events are the parent's */
    if (state == RUNNING)
        state = OFF_UNKNOWN;
    engaged = 0;
    rate_fp = 0;
    sleepers = 0; /* the parent's other threads, asleep for tokens, are not here */
    memset(&arb, 0, sizeof(arb));
    memset(&followed, 0, sizeof(followed));
}

/* ---- launch wrappers ---- */

#define THROTTLED(call)                                                                          \
    do {                                                                                         \
        kernel_launch();                                                                         \
        CUresult rc_ = (call);                                                                   \
        VGPU_TRACE("%s = %d", __func__, rc_);                                                    \
        return rc_;                                                                              \
    } while (0)

VGPU_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                    unsigned int bx, unsigned int by, unsigned int bz,
                                    unsigned int shmem, CUstream s, void **params, void **extra)
{
    THROTTLED(VGPU_REAL(cuLaunchKernel, f, gx, gy, gz, bx, by, bz, shmem, s, params, extra));
}

VGPU_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                         unsigned int gz, unsigned int bx, unsigned int by,
                                         unsigned int bz, unsigned int shmem, CUstream s,
                                         void **params, void **extra)
{
    THROTTLED(VGPU_REAL(cuLaunchKernel_ptsz, f, gx, gy, gz, bx, by, bz, shmem, s, params, extra));
}

VGPU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params,
                                      void **extra)
{
    THROTTLED(VGPU_REAL(cuLaunchKernelEx, config, f, params, extra));
}

VGPU_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                           void **params, void **extra)
{
    THROTTLED(VGPU_REAL(cuLaunchKernelEx_ptsz, config, f, params, extra));
}

VGPU_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                               unsigned int gz, unsigned int bx, unsigned int by,
                                               unsigned int bz, unsigned int shmem, CUstream s,
                                               void **params)
{
    THROTTLED(VGPU_REAL(cuLaunchCooperativeKernel, f, gx, gy, gz, bx, by, bz, shmem, s, params));
}

VGPU_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                                    unsigned int gz, unsigned int bx,
                                                    unsigned int by, unsigned int bz,
                                                    unsigned int shmem, CUstream s, void **params)
{
    THROTTLED(
        VGPU_REAL(cuLaunchCooperativeKernel_ptsz, f, gx, gy, gz, bx, by, bz, shmem, s, params));
}

VGPU_EXPORT CUresult cuLaunch(CUfunction f)
{
    THROTTLED(VGPU_REAL(cuLaunch, f));
}

VGPU_EXPORT CUresult cuLaunchGrid(CUfunction f, int width, int height)
{
    THROTTLED(VGPU_REAL(cuLaunchGrid, f, width, height));
}

VGPU_EXPORT CUresult cuLaunchGridAsync(CUfunction f, int width, int height, CUstream s)
{
    THROTTLED(VGPU_REAL(cuLaunchGridAsync, f, width, height, s));
}

VGPU_EXPORT CUresult cuGraphLaunch(CUgraphExec exec, CUstream s)
{
    GRAPH(exec, s, VGPU_REAL(cuGraphLaunch, exec, s));
}

VGPU_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec exec, CUstream s)
{
    GRAPH(exec, s, VGPU_REAL(cuGraphLaunch_ptsz, exec, s));
}
