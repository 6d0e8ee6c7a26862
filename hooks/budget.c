/*
 * The container-wide memory budget, kept in $VGPU_SHARED_DIR/vgpu.shm
 * (layout and locking rules: vgpu_shared.h).  Without VGPU_SHARED_DIR the
 * same structure lives in private memory and the budget is per process.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "vgpu.h"
#include "vgpu_shared.h"

#define NO_SLOT (-1)
#define SLOTLESS (-2) /* every slot taken: tracked in the totals only */

static struct vgpu_shared *shm;
static int shm_fd = -1;
static int my_slot = NO_SLOT;
static pthread_mutex_t attach_lock = PTHREAD_MUTEX_INITIALIZER;

static int lock_byte(off_t offset, short type, int wait)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = offset, .l_len = 1};
    int rc;
    do
        rc = fcntl(shm_fd, wait ? F_SETLKW : F_SETLK, &fl);
    while (rc != 0 && errno == EINTR);
    return rc;
}

static void init_header(struct vgpu_shared *s, int pshared)
{
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    if (pshared)
        pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_mutex_init(&s->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    s->version = VGPU_SHARED_VERSION;
    s->header_size = sizeof(*s);
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
    init_header(p, 0);
    return p;
}

/* Maps the shared file (created and initialised by the first comer), or NULL. */
static struct vgpu_shared *map_shared(const char *dir)
{
    static int logged;
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, VGPU_SHARED_FILE);
    shm_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (shm_fd < 0) {
        vgpu_log(&logged, "cannot open %s: %s; the memory limit applies per process", path,
                 strerror(errno));
        return NULL;
    }
    struct vgpu_shared *s = NULL;
    struct stat st;
    if (lock_byte(0, F_WRLCK, 1) != 0) /* no fcntl locks here: liveness unknowable */
        goto fail;
    if (fstat(shm_fd, &st) != 0)
        goto fail;
    if (st.st_size == 0) {
        fchmod(shm_fd, 0666); /* processes of the container may run as other users */
        if (ftruncate(shm_fd, sizeof(*s)) != 0)
            goto fail;
    } else if ((size_t)st.st_size != sizeof(*s)) {
        goto fail; /* another layout: do not read it */
    }
    s = mmap(NULL, sizeof(*s), PROT_READ | PROT_WRITE, MAP_SHARED, shm_fd, 0);
    if (s == MAP_FAILED) {
        s = NULL;
        goto fail;
    }
    if (s->magic == 0)
        init_header(s, 1);
    else if (s->magic != VGPU_SHARED_MAGIC || s->version != VGPU_SHARED_VERSION ||
             s->header_size != sizeof(*s))
        goto fail;
    lock_byte(0, F_UNLCK, 0);
    return s;
fail:
    vgpu_log(&logged, "%s is unusable (another layout version or I/O error); the memory limit "
             "applies per process", path);
    if (s)
        munmap(s, sizeof(*s));
    close(shm_fd); /* we hold no slot lock yet, only the init lock */
    shm_fd = -1;
    return NULL;
}

static struct vgpu_shared *budget(void)
{
    struct vgpu_shared *s = __atomic_load_n(&shm, __ATOMIC_ACQUIRE);
    if (s)
        return s;
    pthread_mutex_lock(&attach_lock);
    if (!shm) {
        static int logged;
        const char *dir = getenv("VGPU_SHARED_DIR");
        if (!dir || !*dir)
            vgpu_log(&logged, "VGPU_SHARED_DIR is not set; the memory limit applies per process");
        s = dir && *dir ? map_shared(dir) : NULL;
        __atomic_store_n(&shm, s ? s : map_private(), __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&attach_lock);
    return shm;
}

/* Totals from the slots: after a holder of the lock died mid-update. */
static void rebuild_totals(struct vgpu_shared *s)
{
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        uint64_t sum = 0;
        for (uint32_t i = 0; i < s->slot_hwm && i < VGPU_MAX_SLOTS; i++)
            sum += s->slots[i].used[d];
        s->used[d] = sum;
    }
}

static int lock_shared(struct vgpu_shared *s)
{
    static int logged;
    int rc = pthread_mutex_lock(&s->lock);
    if (rc == EOWNERDEAD) {
        rebuild_totals(s);
        pthread_mutex_consistent(&s->lock);
        rc = 0;
    }
    if (rc != 0)
        vgpu_log(&logged, "budget lock unusable (%s); accounting without it", strerror(rc));
    return rc == 0;
}

static void unlock_shared(struct vgpu_shared *s, int locked)
{
    if (locked)
        pthread_mutex_unlock(&s->lock);
}

/* Gives back everything slot i holds and frees it.  Lock held. */
static void clear_slot(struct vgpu_shared *s, int i)
{
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        uint64_t u = s->slots[i].used[d];
        s->used[d] -= u < s->used[d] ? u : s->used[d];
        s->slots[i].used[d] = 0;
    }
    s->slots[i].pid = 0;
}

/* Reclaims the slots of dead processes: those whose fcntl lock we can take. */
static void sweep_dead(struct vgpu_shared *s)
{
    if (shm_fd < 0)
        return;
    for (uint32_t i = 0; i < s->slot_hwm && i < VGPU_MAX_SLOTS; i++) {
        if ((int)i == my_slot || s->slots[i].pid == 0)
            continue;
        if (lock_byte(VGPU_SLOT_LOCK_BASE + i, F_WRLCK, 0) == 0) {
            clear_slot(s, (int)i);
            lock_byte(VGPU_SLOT_LOCK_BASE + i, F_UNLCK, 0);
        }
    }
}

/* Takes a slot for this process (a free one or a dead one's).  Lock held. */
static void claim_slot(struct vgpu_shared *s)
{
    static int logged;
    if (shm_fd < 0) {
        my_slot = 0;
        s->slots[0].pid = getpid();
        s->slot_hwm = 1;
        return;
    }
    for (int i = 0; i < VGPU_MAX_SLOTS; i++) {
        if (lock_byte(VGPU_SLOT_LOCK_BASE + i, F_WRLCK, 0) != 0)
            continue; /* a live process holds it */
        clear_slot(s, i);
        s->slots[i].pid = getpid();
        if ((uint32_t)i >= s->slot_hwm)
            s->slot_hwm = (uint32_t)i + 1;
        my_slot = i;
        return;
    }
    vgpu_log(&logged, "all %d process slots are taken; this process's share is not returned "
             "if it dies", VGPU_MAX_SLOTS);
    my_slot = SLOTLESS;
}

static struct vgpu_shared *lock_with_slot(int *locked)
{
    struct vgpu_shared *s = budget();
    *locked = lock_shared(s);
    if (my_slot == NO_SLOT)
        claim_slot(s);
    return s;
}

static void add_used(struct vgpu_shared *s, int dev, uint64_t bytes)
{
    if (my_slot >= 0)
        s->slots[my_slot].used[dev] += bytes;
    s->used[dev] += bytes;
}

static int fits(const struct vgpu_shared *s, int dev, uint64_t bytes)
{
    uint64_t limit = vgpu_cfg.memory_limit;
    return s->used[dev] <= limit && bytes <= limit - s->used[dev];
}

int vgpu_budget_reserve(int dev, uint64_t bytes)
{
    int locked;
    struct vgpu_shared *s = lock_with_slot(&locked);
    int ok = fits(s, dev, bytes);
    if (!ok) {
        sweep_dead(s);
        ok = fits(s, dev, bytes);
    }
    if (ok)
        add_used(s, dev, bytes);
    unlock_shared(s, locked);
    return ok ? 0 : -1;
}

void vgpu_budget_release(int dev, uint64_t bytes)
{
    int locked;
    struct vgpu_shared *s = lock_with_slot(&locked);
    if (my_slot >= 0) {
        uint64_t mine = s->slots[my_slot].used[dev];
        bytes = bytes < mine ? bytes : mine; /* never below zero */
        s->slots[my_slot].used[dev] -= bytes;
    }
    s->used[dev] -= bytes < s->used[dev] ? bytes : s->used[dev];
    unlock_shared(s, locked);
}

uint64_t vgpu_budget_used(int dev)
{
    int locked;
    struct vgpu_shared *s = lock_with_slot(&locked);
    sweep_dead(s);
    uint64_t used = s->used[dev];
    unlock_shared(s, locked);
    return used;
}

int vgpu_budget_pids(int *pids, int max)
{
    int locked, n = 0;
    struct vgpu_shared *s = lock_with_slot(&locked);
    sweep_dead(s);
    for (uint32_t i = 0; i < s->slot_hwm && i < VGPU_MAX_SLOTS && n < max; i++)
        if (s->slots[i].pid != 0)
            pids[n++] = s->slots[i].pid;
    unlock_shared(s, locked);
    return n;
}

void vgpu_budget_after_fork(void)
{
    /* fcntl locks are not inherited: the child needs a slot of its own. */
    pthread_mutex_init(&attach_lock, NULL);
    my_slot = NO_SLOT;
    if (shm && shm_fd < 0) { /* a private budget: the child starts from zero */
        memset(shm->used, 0, sizeof(shm->used));
        memset(shm->slots, 0, sizeof(shm->slots));
    }
}
