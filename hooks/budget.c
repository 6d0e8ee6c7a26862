/*
 * The container-wide memory budget, kept in /var/run/vgpu/vgpu.shm (the
 * fixed mount) or $VGPU_SHARED_DIR/vgpu.shm (layout and locking rules:
 * vgpu_shared.h).  Without either, or
 * when the file is unusable, the same structure lives in private memory and
 * the budget is per process.
 *
 * The file is tenant-writable ground: it is opened without following links
 * and without blocking, must be a regular file of exactly
 * VGPU_SHARED_FILE_BYTES (or empty, when this process creates it), has its
 * blocks allocated before it is mapped (a full disk then cannot SIGBUS a
 * process that touches it), and every index read from it is bounded.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "vgpu.h"

#define NO_SLOT (-1)
#define SLOTLESS (-2) /* every slot taken: tracked in the totals only */
#define WAIT_NS 5000000l          /* a waiter sleeps at most 5 ms at a time */
#define DEAD_CHECK_NS 20000000ll  /* and checks every 20 ms whether the owner died */

#if defined(__x86_64__)
#define cpu_relax() __builtin_ia32_pause()
#else
#define cpu_relax() __asm__ __volatile__("yield")
#endif

static struct vgpu_shared *shm;
static int shm_private; /* shm is this process's own memory */
static int shm_fd = -1;
static char shm_path[4096];
static int my_slot = NO_SLOT;
static unsigned my_host_pid;
static pthread_mutex_t attach_lock = PTHREAD_MUTEX_INITIALIZER;
static int poller; /* this process holds VGPU_POLLER_LOCK (controller thread only) */

static int ofd_lock(int fd, off_t offset, short type, int wait)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = offset, .l_len = 1};
    int rc;
    do
        rc = fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &fl);
    while (rc != 0 && errno == EINTR);
    return rc;
}

/* This process's classic POSIX write lock on slot i's pid byte: the kernel
 * shows its owner in the host's /proc/locks under its host pid, which the node
 * daemon tells back (vgpu_shared.h).  Process-owned: never inherited by a fork
 * child, gone when the process dies or closes the file. */
static void pid_lock(int fd, int i)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET,
                       .l_start = VGPU_PID_LOCK_BASE + i, .l_len = 1};
    int rc;
    do
        rc = fcntl(fd, F_SETLK, &fl);
    while (rc != 0 && errno == EINTR);
    if (rc != 0)
        VGPU_TRACE("budget: no pid lock on slot %d (errno %d)", i, errno);
}

/* 1 if no open file holds slot i's liveness lock: its process is gone.
 * Never asked for our own slot (our own lock does not conflict with us). */
static int slot_dead(int i)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET,
                       .l_start = VGPU_SLOT_LOCK_BASE + i, .l_len = 1};
    if (shm_fd < 0 || fcntl(shm_fd, F_OFD_GETLK, &fl) != 0)
        return 0;
    return fl.l_type == F_UNLCK;
}

/* 1 if no process without a slot holds the budget lock (see lock_budget). */
static int slotless_dead(void)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET,
                       .l_start = VGPU_SLOTLESS_LOCK, .l_len = 1};
    if (shm_fd < 0 || fcntl(shm_fd, F_OFD_GETLK, &fl) != 0)
        return 0;
    return fl.l_type == F_UNLCK;
}

/* fstat without the GLIBC_2.33 symbol; the kernel's struct stat is libc's
 * on x86_64 and aarch64. */
static int file_stat(int fd, struct stat *st)
{
    return (int)syscall(SYS_fstat, fd, st);
}

/* ---- the budget lock (a futex word in the file) ---- */

static uint32_t my_lock_id(void)
{
    return my_slot >= 0 ? (uint32_t)my_slot + 1 : VGPU_LOCK_NO_SLOT;
}

/* Totals from the slots: after a holder of the lock died mid-update. */
static void rebuild_totals(struct vgpu_shared *s)
{
    uint32_t hwm = s->slot_hwm < VGPU_MAX_SLOTS ? s->slot_hwm : VGPU_MAX_SLOTS;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        uint64_t sum = 0;
        for (uint32_t i = 0; i < hwm; i++)
            sum += s->slots[i].used[d];
        s->used[d] = sum;
    }
}

static void lock_slow(struct vgpu_shared *s, uint32_t me)
{
    static int logged;
    long long check_at = vgpu_now_ns() + DEAD_CHECK_NS;
    for (int spin = 0;; spin++) {
        uint32_t v = __atomic_load_n(&s->lock, __ATOMIC_RELAXED);
        if (v == 0) { /* keep the waiters bit: others may still sleep */
            if (__atomic_compare_exchange_n(&s->lock, &v, me | VGPU_LOCK_WAITERS, 0,
                                            __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
                return;
            continue;
        }
        if (spin < 64) {
            cpu_relax();
            continue;
        }
        if (!(v & VGPU_LOCK_WAITERS)) {
            if (!__atomic_compare_exchange_n(&s->lock, &v, v | VGPU_LOCK_WAITERS, 0,
                                             __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                continue;
            v |= VGPU_LOCK_WAITERS;
        }
        struct timespec ts = {0, WAIT_NS};
        syscall(SYS_futex, &s->lock, FUTEX_WAIT, v, &ts, NULL, 0);
        if (vgpu_now_ns() < check_at)
            continue;
        check_at = vgpu_now_ns() + DEAD_CHECK_NS;
        uint32_t owner = v & ~VGPU_LOCK_WAITERS;
        /* An owner without a slot (over 1024 processes) holds the slotless
         * OFD byte while it owns the lock: free byte, dead owner. */
        int dead = owner == VGPU_LOCK_NO_SLOT
                       ? me != VGPU_LOCK_NO_SLOT && slotless_dead()
                       : owner != me && owner != 0 && owner <= VGPU_MAX_SLOTS &&
                             slot_dead((int)owner - 1);
        if (!dead)
            continue;
        if (__atomic_compare_exchange_n(&s->lock, &v, me | VGPU_LOCK_WAITERS, 0,
                                        __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
            vgpu_log(&logged, "the budget lock's holder (slot %d) died holding it; totals rebuilt",
                     owner == VGPU_LOCK_NO_SLOT ? -1 : (int)owner - 1);
            rebuild_totals(s);
            return;
        }
    }
}

/* A process without a slot first takes the slotless OFD byte (the kernel
 * drops it when the process dies, so waiters see a dead owner at once). */
static pthread_mutex_t slotless_lock = PTHREAD_MUTEX_INITIALIZER;
static int slotless_holders; /* this process's threads holding or taking the budget lock */

static void slotless_hold(uint32_t me, short type)
{
    if (__builtin_expect(me != VGPU_LOCK_NO_SLOT || shm_fd < 0, 1))
        return;
    /* Threads of one process share the byte: it is dropped with the last. */
    pthread_mutex_lock(&slotless_lock);
    if (type == F_WRLCK ? slotless_holders++ == 0 : --slotless_holders == 0)
        ofd_lock(shm_fd, VGPU_SLOTLESS_LOCK, type, 1);
    pthread_mutex_unlock(&slotless_lock);
}

static inline void lock_budget(struct vgpu_shared *s)
{
    uint32_t me = my_lock_id(), expected = 0;
    slotless_hold(me, F_WRLCK);
    if (!__atomic_compare_exchange_n(&s->lock, &expected, me, 0, __ATOMIC_ACQUIRE,
                                     __ATOMIC_RELAXED))
        lock_slow(s, me);
}

static inline void unlock_budget(struct vgpu_shared *s)
{
    uint32_t me = my_lock_id();
    if (__atomic_exchange_n(&s->lock, 0, __ATOMIC_RELEASE) & VGPU_LOCK_WAITERS)
        syscall(SYS_futex, &s->lock, FUTEX_WAKE, 1, NULL, NULL, 0);
    slotless_hold(me, F_UNLCK);
}

/* ---- attaching the file ---- */

static void init_header(struct vgpu_shared *s)
{
    s->version = VGPU_SHARED_VERSION;
    s->file_bytes = VGPU_SHARED_FILE_BYTES;
    s->slot_count = VGPU_MAX_SLOTS;
    s->limit_bytes = vgpu_cfg.memory_limit;
    __atomic_store_n(&s->magic, VGPU_SHARED_MAGIC, __ATOMIC_RELEASE);
}

static struct vgpu_shared *map_private(void)
{
    void *p = mmap(NULL, sizeof(struct vgpu_shared), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        abort(); /* a few hundred KiB at start-up: nothing sane to fall back to */
    init_header(p);
    shm_private = 1;
    return p;
}

/* Opens the budget file without following a link or blocking; creates it
 * (exclusively) when it does not exist. */
static int open_file(const char *path)
{
    int flags = O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = open(path, flags);
        if (fd >= 0 || errno != ENOENT)
            return fd;
        fd = open(path, flags | O_CREAT | O_EXCL, 0666);
        if (fd >= 0 || errno != EEXIST)
            return fd;
    }
    return -1;
}

/* Gives the file its blocks (a full disk must fail here, never as a SIGBUS
 * later).  0, or an errno. */
static int allocate(int fd, off_t size_now)
{
    if (fallocate(fd, 0, 0, VGPU_SHARED_FILE_BYTES) == 0)
        return 0;
    if (errno != EOPNOTSUPP && errno != ENOSYS)
        return errno;
    if (size_now != 0)
        return 0; /* a full-size file on a file system without fallocate: as it is */
    static const char zeros[4096];
    for (off_t at = 0; at < VGPU_SHARED_FILE_BYTES; at += (off_t)sizeof(zeros))
        if (pwrite(fd, zeros, sizeof(zeros), at) != (ssize_t)sizeof(zeros))
            return errno ? errno : EIO;
    return 0;
}

/* Maps the shared file (sized and initialised by the first comer), or NULL. */
static struct vgpu_shared *map_shared(const char *dir)
{
    static int logged;
    char why[256] = "";
    struct vgpu_shared *s = NULL;
    snprintf(shm_path, sizeof(shm_path), "%s/%s", dir, VGPU_SHARED_FILE);
    int fd = open_file(shm_path);
    if (fd < 0) {
        vgpu_log(&logged, "cannot open %s: %s; the memory limit applies per process", shm_path,
                 strerror(errno));
        return NULL;
    }
    struct stat st;
    if (file_stat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(why, sizeof(why), "not a regular file");
        goto fail;
    }
    /* Joining a file already in use (every process of a start-up storm but
     * the first): at its size, every block allocated and a valid header
     * written (magic last), it needs neither the init lock nor fallocate.
     * Hundreds of processes starting at once queued on that lock one by one,
     * and waited a time slice each behind a holder the scheduler had parked. */
    if (st.st_size == VGPU_SHARED_FILE_BYTES &&
        (uint64_t)st.st_blocks * 512 >= VGPU_SHARED_FILE_BYTES) {
        s = mmap(NULL, VGPU_SHARED_FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (s != MAP_FAILED && __atomic_load_n(&s->magic, __ATOMIC_ACQUIRE) == VGPU_SHARED_MAGIC &&
            s->version == VGPU_SHARED_VERSION && s->file_bytes == VGPU_SHARED_FILE_BYTES &&
            s->slot_count == VGPU_MAX_SLOTS) {
            shm_fd = fd;
            VGPU_TRACE("budget: attached %s (in use)", shm_path);
            return s;
        }
        if (s != MAP_FAILED)
            munmap(s, VGPU_SHARED_FILE_BYTES);
        s = NULL; /* new, or not right: the careful way below */
    }
    if (ofd_lock(fd, 0, F_WRLCK, 1) != 0 || file_stat(fd, &st) != 0) {
        snprintf(why, sizeof(why), "no open-file-description locks: %s", strerror(errno));
        goto fail;
    }
    if (st.st_size != 0 && st.st_size != VGPU_SHARED_FILE_BYTES) {
        snprintf(why, sizeof(why), "size %lld, not %u", (long long)st.st_size,
                 VGPU_SHARED_FILE_BYTES);
        goto fail;
    }
    if (st.st_size == 0 && fchmod(fd, 0666) != 0) /* other users of the container join */
        VGPU_TRACE("budget: fchmod %s: %s", shm_path, strerror(errno));
    int err = allocate(fd, st.st_size);
    if (err) {
        snprintf(why, sizeof(why), "cannot allocate its blocks: %s", strerror(err));
        goto fail;
    }
    s = mmap(NULL, VGPU_SHARED_FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (s == MAP_FAILED) {
        s = NULL;
        snprintf(why, sizeof(why), "mmap: %s", strerror(errno));
        goto fail;
    }
    if (__atomic_load_n(&s->magic, __ATOMIC_ACQUIRE) == 0) { /* new, or pre-created zero-filled */
        /* The node daemon's teller may already beat on the pre-created file:
         * its heartbeat survives, so that this container's first processes
         * leave their host pids to it too. */
        uint64_t teller_at = __atomic_load_n(&s->teller_at_ns, __ATOMIC_ACQUIRE);
        memset(s, 0, sizeof(*s));
        init_header(s);
        __atomic_store_n(&s->teller_at_ns, teller_at, __ATOMIC_RELEASE);
    } else if (s->magic != VGPU_SHARED_MAGIC) {
        snprintf(why, sizeof(why), "not a budget file: garbage where the magic number goes");
        goto fail;
    } else if (s->version != VGPU_SHARED_VERSION) {
        snprintf(why, sizeof(why),
                 "budget file format version %u, this hook reads only version %u: the file "
                 "was written by another vgpu release; restart the pod so that the node "
                 "daemon creates a new one", s->version, VGPU_SHARED_VERSION);
        goto fail;
    } else if (s->file_bytes != VGPU_SHARED_FILE_BYTES || s->slot_count != VGPU_MAX_SLOTS) {
        snprintf(why, sizeof(why), "garbage in its header");
        goto fail;
    }
    ofd_lock(fd, 0, F_UNLCK, 0);
    shm_fd = fd;
    VGPU_TRACE("budget: attached %s", shm_path);
    return s;
fail:
    vgpu_log(&logged, "%s is unusable (%s); the memory limit applies per process", shm_path, why);
    if (s)
        munmap(s, VGPU_SHARED_FILE_BYTES);
    close(fd); /* we hold no slot lock yet, only the init lock */
    return NULL;
}

static struct vgpu_shared *budget(void)
{
    struct vgpu_shared *s = __atomic_load_n(&shm, __ATOMIC_ACQUIRE);
    if (__builtin_expect(s != NULL, 1))
        return s;
    pthread_mutex_lock(&attach_lock);
    if (!shm) {
        static int logged;
        vgpu_init();
        const char *dir = vgpu_cfg.shared_dir; /* fixed mount, else $VGPU_SHARED_DIR (config.c) */
        if (!dir) /* no container-wide budget: each process is held to the limits alone */
            vgpu_log(&logged, "VGPU_SHARED_DIR is not set; the %s per process",
                     vgpu_cfg.memory_limit == VGPU_NO_LIMIT ? "compute limit applies"
                     : vgpu_cfg.core_percent ? "memory and compute limits apply"
                                             : "memory limit applies");
        long long t0 = vgpu_trace_on ? vgpu_now_ns() : 0;
        s = dir ? map_shared(dir) : NULL;
        VGPU_TRACE("profile: budget attach %lld us", (vgpu_now_ns() - t0) / 1000);
        __atomic_store_n(&shm, s ? s : map_private(), __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&attach_lock);
    return shm;
}

/* ---- slots ---- */

/* Gives back everything slot i holds and frees it.  Lock held. */
static void clear_slot(struct vgpu_shared *s, int i)
{
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        uint64_t u = s->slots[i].used[d];
        s->used[d] -= u < s->used[d] ? u : s->used[d];
        s->slots[i].used[d] = 0;
    }
    s->slots[i].pid = 0;
    s->slots[i].host_pid = 0;
    __atomic_store_n(&s->told[i], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&s->awaiting[i], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&s->measured[i], 0, __ATOMIC_RELAXED);
}

/* Reclaims the slots of dead processes: those whose liveness lock we can take. */
static void sweep_dead(struct vgpu_shared *s)
{
    if (shm_fd < 0)
        return;
    uint32_t hwm = s->slot_hwm < VGPU_MAX_SLOTS ? s->slot_hwm : VGPU_MAX_SLOTS;
    for (uint32_t i = 0; i < hwm; i++) {
        if ((int)i == my_slot || s->slots[i].pid == 0)
            continue;
        if (ofd_lock(shm_fd, VGPU_SLOT_LOCK_BASE + i, F_WRLCK, 0) == 0) {
            VGPU_TRACE("budget: reclaimed slot %u of dead pid %d", i, s->slots[i].pid);
            clear_slot(s, (int)i);
            ofd_lock(shm_fd, VGPU_SLOT_LOCK_BASE + i, F_UNLCK, 0);
        }
    }
}

/* Takes a free slot's liveness lock (no budget lock needed: the kernel
 * arbitrates between processes) and shows it taken at once (its pid; the rest
 * is set under the budget lock), so that others starting at the same moment
 * skip it without a lock attempt each.  The slot index, or SLOTLESS. */
static int claim_slot(struct vgpu_shared *s)
{
    static int logged;
    if (shm_fd < 0)
        return 0;
    /* Free-looking slots first (one lock attempt each, not one per live
     * neighbour: hundreds start at once), then all (a dead owner's). */
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < VGPU_MAX_SLOTS; i++)
            if ((pass || __atomic_load_n(&s->slots[i].pid, __ATOMIC_RELAXED) == 0) &&
                ofd_lock(shm_fd, VGPU_SLOT_LOCK_BASE + i, F_WRLCK, 0) == 0) {
                __atomic_store_n(&s->told[i], 0, __ATOMIC_RELAXED);
                __atomic_store_n(&s->awaiting[i], 0, __ATOMIC_RELAXED);
                __atomic_store_n(&s->measured[i], 0, __ATOMIC_RELAXED);
                __atomic_store_n(&s->slots[i].host_pid, 0, __ATOMIC_RELAXED);
                __atomic_store_n(&s->slots[i].pid, getpid(), __ATOMIC_RELEASE);
                return i;
            }
    vgpu_log(&logged, "all %d process slots are taken; this process's share is not returned "
             "if it dies", VGPU_MAX_SLOTS);
    return SLOTLESS;
}

/* The budget, locked, with this process's slot in place.  The first call
 * claims the slot; other threads wait on attach_lock until it is set up. */
static struct vgpu_shared *lock_with_slot(void)
{
    struct vgpu_shared *s = budget();
    if (__builtin_expect(__atomic_load_n(&my_slot, __ATOMIC_ACQUIRE) != NO_SLOT, 1)) {
        lock_budget(s);
        return s;
    }
    pthread_mutex_lock(&attach_lock);
    if (my_slot != NO_SLOT) {
        pthread_mutex_unlock(&attach_lock);
        lock_budget(s);
        return s;
    }
    long long t0 = vgpu_trace_on ? vgpu_now_ns() : 0;
    int slot = claim_slot(s);
    long long t1 = vgpu_trace_on ? vgpu_now_ns() : 0;
    uint32_t id = slot >= 0 ? (uint32_t)slot + 1 : VGPU_LOCK_NO_SLOT, expected = 0;
    slotless_hold(id, F_WRLCK);
    if (!__atomic_compare_exchange_n(&s->lock, &expected, id, 0, __ATOMIC_ACQUIRE,
                                     __ATOMIC_RELAXED))
        lock_slow(s, id);
    VGPU_TRACE("profile: slot claim %lld us, budget lock %lld us", (t1 - t0) / 1000,
               (vgpu_now_ns() - t1) / 1000);
    if (slot >= 0) {
        clear_slot(s, slot); /* what a dead predecessor left */
        s->slots[slot].pid = getpid();
        s->slots[slot].host_pid = my_host_pid;
        if ((uint32_t)slot >= s->slot_hwm || s->slot_hwm > VGPU_MAX_SLOTS)
            s->slot_hwm = (uint32_t)slot + 1;
        pid_lock(shm_fd, slot);
        VGPU_TRACE("budget: pid %d took slot %d", getpid(), slot);
    }
    __atomic_store_n(&my_slot, slot, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&attach_lock);
    return s;
}

/* ---- the budget ---- */

static inline int valid(int e)
{
    return e >= 0 && e < VGPU_MAX_DEVICES;
}

/* Two UUID texts name one card when the part after the prefix ("GPU-",
 * "MIG-") matches, case aside. */
static int same_card(const char *a, const char *b)
{
    const char *da = memchr(a, '-', VGPU_UUID_BYTES), *db = memchr(b, '-', VGPU_UUID_BYTES);
    if (!da || !db)
        return strncmp(a, b, VGPU_UUID_BYTES) == 0;
    size_t la = strnlen(da, VGPU_UUID_BYTES - (size_t)(da - a)),
           lb = strnlen(db, VGPU_UUID_BYTES - (size_t)(db - b));
    return la == lb && strncasecmp(da, db, la) == 0;
}

int vgpu_budget_entry(const char *uuid, int add)
{
    static int logged;
    struct vgpu_shared *s = lock_with_slot();
    uint32_t n = s->device_count < VGPU_MAX_DEVICES ? s->device_count : VGPU_MAX_DEVICES;
    int found = -1;
    for (uint32_t i = 0; i < n && found < 0; i++)
        if (same_card(s->devices[i], uuid))
            found = (int)i;
    if (found < 0 && add) {
        if (n < VGPU_MAX_DEVICES) {
            memset(s->devices[n], 0, VGPU_UUID_BYTES);
            strncpy(s->devices[n], uuid, VGPU_UUID_BYTES - 1);
            __atomic_store_n(&s->device_count, n + 1, __ATOMIC_RELEASE); /* name first */
            found = (int)n;
        } else {
            vgpu_log(&logged, "more than %d cards: %s shares the last budget entry",
                     VGPU_MAX_DEVICES, uuid);
            found = VGPU_MAX_DEVICES - 1;
        }
    }
    unlock_budget(s);
    return found;
}

int vgpu_budget_uses_card(const char *uuid)
{
    struct vgpu_shared *s = budget();
    uint32_t n = __atomic_load_n(&s->device_count, __ATOMIC_ACQUIRE);
    if (n == 0)
        return -1;
    n = n < VGPU_MAX_DEVICES ? n : VGPU_MAX_DEVICES; /* tenant-writable: bounded */
    for (uint32_t i = 0; i < n; i++)
        if (same_card(s->devices[i], uuid))
            return 1;
    return 0;
}

static void add_used(struct vgpu_shared *s, int e, uint64_t bytes)
{
    if (my_slot >= 0)
        s->slots[my_slot].used[e] += bytes;
    s->used[e] += bytes;
}

static int fits(const struct vgpu_shared *s, int e, uint64_t bytes)
{
    uint64_t limit = vgpu_cfg.memory_limit, used = s->used[e];
    return used <= limit && bytes <= limit - used;
}

int vgpu_budget_reserve(int e, uint64_t bytes)
{
    if (!valid(e))
        return -1;
    struct vgpu_shared *s = lock_with_slot();
    int ok = fits(s, e, bytes);
    if (!ok) {
        sweep_dead(s);
        ok = fits(s, e, bytes);
    }
    if (ok)
        add_used(s, e, bytes);
    unlock_budget(s);
    return ok ? 0 : -1;
}

void vgpu_budget_charge(int e, uint64_t bytes)
{
    if (!valid(e))
        return;
    struct vgpu_shared *s = lock_with_slot();
    add_used(s, e, bytes);
    unlock_budget(s);
}

void vgpu_budget_release(int e, uint64_t bytes)
{
    if (!valid(e))
        return;
    struct vgpu_shared *s = lock_with_slot();
    if (my_slot >= 0) {
        uint64_t mine = s->slots[my_slot].used[e];
        bytes = bytes < mine ? bytes : mine; /* never below zero */
        s->slots[my_slot].used[e] -= bytes;
    }
    s->used[e] -= bytes < s->used[e] ? bytes : s->used[e];
    unlock_budget(s);
}

uint64_t vgpu_budget_used(int e)
{
    if (!valid(e))
        return 0;
    struct vgpu_shared *s = lock_with_slot();
    sweep_dead(s);
    uint64_t used = s->used[e];
    unlock_budget(s);
    return used;
}

int vgpu_budget_pids(struct vgpu_pid *out, int max)
{
    int n = 0;
    struct vgpu_shared *s = lock_with_slot();
    sweep_dead(s);
    uint32_t hwm = s->slot_hwm < VGPU_MAX_SLOTS ? s->slot_hwm : VGPU_MAX_SLOTS;
    for (uint32_t i = 0; i < hwm && n < max; i++)
        if (s->slots[i].pid != 0) {
            out[n].pid = s->slots[i].pid;
            out[n].host_pid = s->slots[i].host_pid;
            out[n].slot = (int)i;
            n++;
        }
    unlock_budget(s);
    return n;
}

int vgpu_budget_peek_pids(struct vgpu_pid *out, int max)
{
    struct vgpu_shared *s = budget();
    int n = 0;
    uint32_t hwm = __atomic_load_n(&s->slot_hwm, __ATOMIC_ACQUIRE);
    hwm = hwm < VGPU_MAX_SLOTS ? hwm : VGPU_MAX_SLOTS;
    for (uint32_t i = 0; i < hwm && n < max; i++) {
        int32_t pid = __atomic_load_n(&s->slots[i].pid, __ATOMIC_RELAXED);
        if (pid == 0)
            continue;
        if (out) { /* NULL: only counted */
            out[n].pid = pid;
            out[n].host_pid = __atomic_load_n(&s->slots[i].host_pid, __ATOMIC_RELAXED);
            out[n].slot = (int)i;
        }
        n++;
    }
    return n;
}

void vgpu_budget_set_host_pid(unsigned host_pid)
{
    struct vgpu_shared *s = lock_with_slot();
    my_host_pid = host_pid;
    if (my_slot >= 0)
        s->slots[my_slot].host_pid = host_pid;
    unlock_budget(s);
}

/* The host pid the node daemon told for our slot, adopted once (0 = none yet).
 * The told word carries the slot's pid: a word meant for the slot's previous
 * process is never taken. */
static unsigned adopt_told(void)
{
    struct vgpu_shared *s = __atomic_load_n(&shm, __ATOMIC_ACQUIRE);
    int slot = __atomic_load_n(&my_slot, __ATOMIC_ACQUIRE);
    if (!s || shm_private || slot < 0)
        return 0;
    uint64_t word = __atomic_load_n(&s->told[slot], __ATOMIC_ACQUIRE);
    int32_t pid = __atomic_load_n(&s->slots[slot].pid, __ATOMIC_RELAXED);
    unsigned host = (unsigned)(word & 0xffffffffu);
    if (!host || pid <= 0 || (uint32_t)(word >> 32) != (uint32_t)pid)
        return 0;
    unsigned expected = 0;
    if (__atomic_compare_exchange_n(&my_host_pid, &expected, host, 0, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED)) {
        __atomic_store_n(&s->slots[slot].host_pid, host, __ATOMIC_RELEASE);
        VGPU_TRACE("budget: the node daemon told host pid %u", host);
        return host;
    }
    return expected;
}

unsigned vgpu_budget_host_pid(void)
{
    unsigned host = __atomic_load_n(&my_host_pid, __ATOMIC_RELAXED);
    return host ? host : adopt_told();
}

void vgpu_budget_await_overhead(int entry)
{
    struct vgpu_shared *s = __atomic_load_n(&shm, __ATOMIC_ACQUIRE);
    int slot = __atomic_load_n(&my_slot, __ATOMIC_ACQUIRE);
    if (s && !shm_private && slot >= 0)
        __atomic_store_n(&s->awaiting[slot], entry >= 0 ? (uint32_t)entry + 1 : 0,
                         __ATOMIC_RELEASE);
}

long long vgpu_budget_measured_overhead(int entry)
{
    struct vgpu_shared *s = __atomic_load_n(&shm, __ATOMIC_ACQUIRE);
    int slot = __atomic_load_n(&my_slot, __ATOMIC_ACQUIRE);
    if (!s || shm_private || slot < 0 || entry < 0)
        return -1;
    uint64_t word = __atomic_load_n(&s->measured[slot], __ATOMIC_ACQUIRE);
    int32_t pid = __atomic_load_n(&s->slots[slot].pid, __ATOMIC_RELAXED);
    if (!word || pid <= 0 || (uint32_t)(word >> 32) != (uint32_t)pid ||
        ((word >> 24) & 0xff) != (uint64_t)entry + 1)
        return -1;
    return (long long)(word & 0xffffff) * (long long)VGPU_MIB;
}

int vgpu_budget_teller_alive(void)
{
    if (!vgpu_cfg.shared_dir) /* no file to be told through */
        return 0;
    struct vgpu_shared *s = budget();
    if (shm_private)
        return 0;
    uint64_t at = __atomic_load_n(&s->teller_at_ns, __ATOMIC_ACQUIRE);
    long long now = vgpu_now_ns();
    return at && (long long)at <= now + 1000000000ll &&
           now - (long long)at <= VGPU_TELLER_STALE_MS * 1000000ll;
}

void vgpu_budget_after_fork(void)
{
    pthread_mutex_init(&attach_lock, NULL);
    pthread_mutex_init(&slotless_lock, NULL);
    slotless_holders = 0;
    my_slot = NO_SLOT; /* a slot of its own, under its own liveness lock */
    poller = 0;        /* the parent's poller lock goes with the parent's descriptor */
    my_host_pid = 0;
    if (shm && !shm_private) {
        /* The parent's open file, held by our descriptor and by our mapping,
         * carries the parent's liveness lock: keeping either would keep the
         * parent "alive" after it died.  The child attaches afresh if it uses
         * the budget. */
        munmap(shm, VGPU_SHARED_FILE_BYTES);
        shm = NULL;
        if (shm_fd >= 0)
            close(shm_fd);
        shm_fd = -1;
    } else if (shm && shm_private) { /* a private budget: the child starts from zero */
        memset(shm->used, 0, sizeof(shm->used));
        memset(shm->slots, 0, sizeof(shm->slots));
        shm->lock = 0;
    }
}

uint64_t vgpu_budget_arbiter(void)
{
    struct vgpu_shared *s = budget();
    return shm_private ? 0 : __atomic_load_n(&s->arbiter, __ATOMIC_ACQUIRE);
}

void vgpu_budget_note_wait(void)
{
    struct vgpu_shared *s = __atomic_load_n(&shm, __ATOMIC_ACQUIRE);
    if (s && !shm_private)
        __atomic_fetch_add(&s->throttle_waits, 1, __ATOMIC_RELAXED);
}

/* ---- the container's utilisation poller (vgpu_shared.h) ---- */

/* A percent as the file keeps it: 1/100 %, clamped to 0-10000. */
static uint32_t to_centi(double percent)
{
    return percent <= 0 ? 0 : percent >= 100 ? 10000 : (uint32_t)(percent * 100 + 0.5);
}

/* Back to a percent; the file is tenant-writable, so bounded before use. */
static double from_centi(uint32_t centi)
{
    return (centi <= 10000 ? centi : 10000) / 100.0;
}

int vgpu_budget_poll_read(struct vgpu_poll *out)
{
    struct vgpu_shared *s = budget();
    if (shm_private)
        return -1;
    for (int attempt = 0; attempt < 4; attempt++) {
        uint32_t seq = __atomic_load_n(&s->poll_seq, __ATOMIC_ACQUIRE);
        if (seq == 0)
            return -1; /* nobody published yet */
        if (seq & 1)
            continue; /* being written (or its writer died mid-way: stale soon) */
        out->seq = seq;
        out->at_ns = (long long)__atomic_load_n(&s->poll_at_ns, __ATOMIC_RELAXED);
        out->rc = (int)__atomic_load_n(&s->poll_rc, __ATOMIC_RELAXED);
        uint32_t c = __atomic_load_n(&s->poll_container_centi, __ATOMIC_RELAXED);
        int slot = __atomic_load_n(&my_slot, __ATOMIC_RELAXED);
        uint32_t self = slot >= 0 && slot < VGPU_MAX_SLOTS
                            ? __atomic_load_n(&s->poll_slot_centi[slot], __ATOMIC_RELAXED)
                            : 0;
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&s->poll_seq, __ATOMIC_RELAXED) != seq)
            continue;
        out->container = from_centi(c);
        out->self = from_centi(self);
        if (out->rc < VGPU_POLL_OK || out->rc > VGPU_POLL_UNSUPPORTED)
            out->rc = VGPU_POLL_NO_SAMPLE;
        return 0;
    }
    return -1;
}

int vgpu_budget_poll_take(void)
{
    if (poller)
        return 1;
    struct vgpu_shared *s = budget();
    if (shm_private || shm_fd < 0)
        return -1; /* no shared file: each process polls for itself */
    /* A fresh publication: a poller lives, and its lock is not tried (a
     * system call per process and period, each against the file's hundreds
     * of slot locks in a storm).  A stale one is tried as before. */
    uint32_t seq = __atomic_load_n(&s->poll_seq, __ATOMIC_ACQUIRE);
    long long at = (long long)__atomic_load_n(&s->poll_at_ns, __ATOMIC_RELAXED),
              now = vgpu_now_ns();
    if (seq != 0 && at <= now + 1000000000ll && now - at <= VGPU_POLL_STALE_MS * 1000000ll)
        return 0;
    poller = ofd_lock(shm_fd, VGPU_POLLER_LOCK, F_WRLCK, 0) == 0;
    if (poller)
        VGPU_TRACE("budget: this process polls NVML for the container");
    return poller;
}

static uint32_t poll_writing;

void vgpu_budget_poll_begin(void)
{
    struct vgpu_shared *s = budget();
    uint32_t v = __atomic_load_n(&s->poll_seq, __ATOMIC_RELAXED);
    v = (v + 1) | 1; /* odd; a dead writer's odd value moves on too */
    poll_writing = v;
    __atomic_store_n(&s->poll_seq, v, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    memset(s->poll_slot_centi, 0, sizeof(s->poll_slot_centi));
}

void vgpu_budget_poll_slot(int slot, double percent)
{
    struct vgpu_shared *s = budget();
    if (slot >= 0 && slot < VGPU_MAX_SLOTS)
        s->poll_slot_centi[slot] = (uint16_t)to_centi(percent);
}

void vgpu_budget_poll_end(int rc, double container_percent, long long at_ns)
{
    struct vgpu_shared *s = budget();
    s->poll_rc = (uint32_t)rc;
    s->poll_container_centi = to_centi(container_percent);
    s->poll_at_ns = (uint64_t)at_ns;
    uint32_t next = poll_writing + 1;
    __atomic_store_n(&s->poll_seq, next ? next : 2, __ATOMIC_RELEASE); /* even, never 0 */
}
