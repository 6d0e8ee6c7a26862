/*
 * The stand-in GPU shared by the stand-in driver and NVML (tests only): one
 * timeline per card on which the kernels of every process run one after
 * another (time-slicing), per-process busy time, contexts and device memory.
 * With FAKE_GPU_STATE=<file> every process of a test shares it, so two
 * "containers" compete for one card; without it, it is per process.
 *   FAKE_PIDNS_OFFSET  the process's "host pid" is its pid plus this: what
 *                      NVML reports, as for a process in a PID namespace
 *   FAKE_CTX_BARRIER   N: context creation waits until N processes have entered
 *                      it, and returns once N hold a context on the card, so
 *                      each sees every other one appear with its own (the race
 *                      of pods starting together); once per state file
 */
#ifndef FAKE_GPU_H
#define FAKE_GPU_H

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define FAKE_CARDS 2
#define FAKE_MAX_DEV 16
#define FAKE_MAX_PROCS 512
#define FAKE_RING 256

struct fake_proc {
    int32_t pid;       /* 0 = free */
    uint32_t host_pid; /* what NVML reports */
    uint32_t ctx_mask; /* cards it has a context on */
    uint32_t head, count;
    uint32_t pad;
    uint64_t used[FAKE_MAX_DEV];     /* device memory it holds, per card */
    int64_t busy_base[FAKE_MAX_DEV]; /* busy time folded out of the ring */
    int64_t stream_end;              /* when its queued work ends */
    struct {
        int64_t start, end;
        int32_t card, pad;
    } ring[FAKE_RING];
};

struct fake_gpu {
    uint32_t lock;
    uint32_t ctx_arrived; /* processes that entered context creation (FAKE_CTX_BARRIER) */
    int64_t free_at[FAKE_MAX_DEV];
    int64_t scheduled_ns[FAKE_MAX_DEV]; /* GPU time of every kernel ever queued */
    struct fake_proc procs[FAKE_MAX_PROCS];
};

static inline int64_t fake_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static inline struct fake_gpu *fake_gpu(void)
{
    static struct fake_gpu *g;
    if (g)
        return g;
    const char *path = getenv("FAKE_GPU_STATE");
    void *p = MAP_FAILED;
    if (path && *path) {
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        if (fd >= 0) {
            struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
            fcntl(fd, F_SETLKW, &fl);
            if (lseek(fd, 0, SEEK_END) < (off_t)sizeof(struct fake_gpu) &&
                ftruncate(fd, sizeof(struct fake_gpu)) != 0)
                abort();
            fl.l_type = F_UNLCK;
            fcntl(fd, F_SETLK, &fl);
            p = mmap(NULL, sizeof(struct fake_gpu), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            close(fd);
        }
    }
    if (p == MAP_FAILED)
        p = mmap(NULL, sizeof(struct fake_gpu), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        abort();
    g = p;
    return g;
}

static inline int fake_alive(int32_t pid);

/* Gone, or a zombie its parent has not reaped yet (a test's child killed -9). */
static inline int fake_gone(int32_t pid)
{
    if (!fake_alive(pid))
        return 1;
    char path[64], buf[256];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    const char *end = strrchr(buf, ')');
    return end && end[1] == ' ' && end[2] == 'Z';
}

/* The lock word holds its owner's pid: one killed holding it (kill -9 in a
 * start-up storm) is seen dead, even as an unreaped zombie, and the lock taken over. */
static uint32_t fake_lock_pid; /* getpid() is a system call: once per process */

static void fake_lock_forget_pid(void)
{
    fake_lock_pid = 0;
}

static inline void fake_lock(struct fake_gpu *g)
{
    if (__builtin_expect(!fake_lock_pid, 0)) {
        static int registered;
        if (!registered) {
            registered = 1;
            pthread_atfork(NULL, NULL, fake_lock_forget_pid);
        }
        fake_lock_pid = (uint32_t)getpid();
    }
    uint32_t seen = 0, me = fake_lock_pid;
    for (unsigned spins = 0;
         !__atomic_compare_exchange_n(&g->lock, &seen, me, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
         spins++) {
        if (seen != 0 && spins % 16 == 15 && fake_gone((int32_t)seen) &&
            __atomic_compare_exchange_n(&g->lock, &seen, me, 0, __ATOMIC_ACQUIRE,
                                        __ATOMIC_RELAXED))
            return;
        seen = 0;
        if (spins < 64) {
            sched_yield();
        } else { /* hundreds of processes at once: sleep rather than spin */
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
        }
    }
}

static inline void fake_unlock(struct fake_gpu *g)
{
    __atomic_store_n(&g->lock, 0, __ATOMIC_RELEASE);
}

static inline int fake_alive(int32_t pid)
{
    return pid > 0 && (kill(pid, 0) == 0 || errno != ESRCH);
}

static struct fake_proc *fake_mine; /* this process's record, once found */

static void fake_forget_mine(void)
{
    fake_mine = NULL; /* a forked child is another process */
}

/* This process's record (lock held): found, or a free/dead one taken. */
static inline struct fake_proc *fake_me(struct fake_gpu *g)
{
    static int registered;
    if (fake_mine)
        return fake_mine;
    if (!registered) {
        registered = 1;
        pthread_atfork(NULL, NULL, fake_forget_mine);
    }
    int32_t pid = getpid();
    struct fake_proc *free_one = NULL;
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        if (g->procs[i].pid == pid) {
            /* Not ours yet in this process image: a dead process's, whose pid
             * the kernel gave us (a busy node recycles pids within minutes).
             * A driver gives a new process no contexts: its record starts over. */
            free_one = &g->procs[i];
            break;
        }
        if (!free_one && !fake_alive(g->procs[i].pid))
            free_one = &g->procs[i];
    }
    if (!free_one)
        abort();
    memset(free_one, 0, sizeof(*free_one));
    free_one->pid = pid;
    const char *offset = getenv("FAKE_PIDNS_OFFSET");
    free_one->host_pid = (uint32_t)(pid + (offset ? atoi(offset) : 0));
    return fake_mine = free_one;
}

/* GPU time the process's kernels ran on `card` before time t. */
static inline int64_t fake_busy(const struct fake_proc *p, int card, int64_t t)
{
    int64_t busy = p->busy_base[card];
    for (uint32_t k = 0; k < p->count; k++) {
        uint32_t i = (p->head + k) % FAKE_RING;
        if (p->ring[i].card != card || p->ring[i].start >= t)
            continue;
        busy += (p->ring[i].end < t ? p->ring[i].end : t) - p->ring[i].start;
    }
    return busy;
}

/* The UUID of stand-in card k: GPU-00000000-0000-4000-8000-00000000000k. */
static inline void fake_uuid_bytes(int card, unsigned char out[16])
{
    memset(out, 0, 16);
    out[6] = 0x40;
    out[8] = 0x80;
    out[15] = (unsigned char)card;
}

#endif
