/*
 * Layout of the budget file shared by all processes of one container
 * ($VGPU_SHARED_DIR/vgpu.shm, mmap'ed MAP_SHARED).  The file has one fixed
 * size, VGPU_SHARED_FILE_BYTES, which the daemon also knows
 * (vgpu/adapters/budget.py; a test ties the two).  Bump VGPU_SHARED_VERSION
 * on any change; a process that finds another version, size or garbage
 * falls back to a per-process budget rather than misread the file.
 *
 * Every field has a fixed width and no pointer or pthread object lives here,
 * so the layout is the same on every architecture and host-side readers
 * need no knowledge of libc internals.
 *
 * Concurrency:
 *  - `lock` is a futex word guarding `used`, `devices` and all slots:
 *    0 = free, else the owner's slot index + 1 (VGPU_LOCK_NO_SLOT for an
 *    owner without a slot), VGPU_LOCK_WAITERS set while someone sleeps on it.
 *    A waiter that finds the owner's slot dead (below) takes the lock over and
 *    rebuilds `used` from the slots.
 *  - Each live process holds an open-file-description (OFD) write lock on
 *    byte VGPU_SLOT_LOCK_BASE + slot index.  A slot whose lock can be taken
 *    belongs to a dead process (the kernel drops the lock when the last
 *    descriptor of that open file goes, zombie or not; closing some other
 *    descriptor of the same file does not drop it), and its bytes are given
 *    back.
 *  - One hook process of the container at a time polls NVML for the
 *    container's utilisation (the poller: it holds an OFD write lock on byte
 *    VGPU_POLLER_LOCK, dropped by the kernel when it dies) and publishes it in
 *    `poll_*` under a sequence lock (`poll_seq` odd while it writes); the
 *    other processes read it instead of each querying NVML.  A publication
 *    older than VGPU_POLL_STALE_MS lets another process take over.
 *  - Each process with a slot also holds a classic POSIX (process-owned)
 *    write lock on byte VGPU_PID_LOCK_BASE + slot index.  The kernel lists
 *    its owner in /proc/locks with the pid of the namespace that procfs
 *    belongs to: the node daemon reads the host's /proc/locks, finds the
 *    host pid of every slot, and tells it in `told` (the slot's own pid in
 *    the high half, so that a slot taken over meanwhile never adopts another
 *    process's pid); `teller_at_ns` is its heartbeat.  While the heartbeat is
 *    fresh (VGPU_TELLER_STALE_MS) a new context does not list the card's
 *    processes to find its host pid: the daemon tells it within a period,
 *    and measures the context's memory (`awaiting` -> `measured`).
 *  - The file is sized, allocated and initialised under an OFD lock on
 *    byte 0.  A zero-filled file (magic 0), as the daemon pre-creates it, is
 *    initialised by the first process.
 */
#ifndef VGPU_SHARED_H
#define VGPU_SHARED_H

#include <stdint.h>

#define VGPU_SHARED_MAGIC 0x76475055u /* "UPGv" */
#define VGPU_SHARED_VERSION 5u
#define VGPU_SHARED_FILE "vgpu.shm"
/* The file's one size: sizeof(struct vgpu_shared) rounded up to 4 KiB. */
#define VGPU_SHARED_FILE_BYTES 163840u
#define VGPU_MAX_DEVICES 16
#define VGPU_MAX_SLOTS 1024
#define VGPU_UUID_BYTES 48 /* "GPU-" or "MIG-" + 36 hex/dash, NUL-padded */
/* OFD lock byte offsets: 0 = init lock, BASE + i = slot i liveness lock. */
#define VGPU_SLOT_LOCK_BASE 4096
#define VGPU_LOCK_NO_SLOT 0xffffu
#define VGPU_LOCK_WAITERS 0x80000000u
/* OFD lock byte a process without a slot holds while it owns the budget lock
 * (dies with it, so its death is seen at once). */
#define VGPU_SLOTLESS_LOCK (VGPU_SLOT_LOCK_BASE - 1)
/* OFD lock byte the container's utilisation poller holds while it lives. */
#define VGPU_POLLER_LOCK (VGPU_SLOT_LOCK_BASE - 2)
/* A poller publication older than this (ms): another process takes over. */
#define VGPU_POLL_STALE_MS 200
/* poll_rc: the poller's last NVML answer */
#define VGPU_POLL_OK 0
#define VGPU_POLL_NO_SAMPLE 1
#define VGPU_POLL_UNSUPPORTED 2
/* arbiter word: sequence << 16 | allowed share in 1/100 % (<= 10000) */
#define VGPU_ARBITER_SHARE_MASK 0xffffull
#define VGPU_ARBITER_SEQ_SHIFT 16
#define VGPU_ARBITER_STALE_MS 500
/* POSIX lock byte of slot i: VGPU_PID_LOCK_BASE + i (its owner's host pid, in
 * the host's /proc/locks). */
#define VGPU_PID_LOCK_BASE (VGPU_SLOT_LOCK_BASE + VGPU_MAX_SLOTS)
/* A teller heartbeat older than this (ms): the hook finds its host pid itself. */
#define VGPU_TELLER_STALE_MS 1000

struct vgpu_slot {
    int32_t pid;       /* 0 = free; the pid as seen inside the container */
    uint32_t host_pid; /* the pid NVML reports for it (0 = not known) */
    uint64_t used[VGPU_MAX_DEVICES]; /* bytes this process holds, per device entry */
};

struct vgpu_shared {
    uint32_t magic; /* written last, once initialised */
    uint32_t version;
    uint32_t file_bytes;   /* VGPU_SHARED_FILE_BYTES */
    uint32_t slot_count;   /* VGPU_MAX_SLOTS */
    uint32_t slot_hwm;     /* slots [0, slot_hwm) have ever been used */
    uint32_t device_count; /* entries of `devices` in use */
    uint32_t lock;         /* futex word, see above */
    uint32_t flags;
    uint64_t limit_bytes;  /* limit of the process that initialised it (informational) */
    /* ---- written by the node daemon's compute arbiter only ---- */
    uint64_t arbiter;          /* seq << 16 | allowed share (1/100 %); seq 0 = none yet */
    uint32_t guarantee_centi;  /* the container's guarantee (1/100 %), informational */
    uint32_t cap_centi;        /* its burst cap (1/100 %), informational */
    uint32_t achieved_centi;   /* what it achieved over the last period, informational */
    uint32_t throttle_waits;   /* written by the hooks: launches that waited for tokens
                                  (wrapping); the arbiter's sign that the container
                                  wants more than it is allowed */
    uint64_t used[VGPU_MAX_DEVICES]; /* sum of the slots' `used` */
    char devices[VGPU_MAX_DEVICES][VGPU_UUID_BYTES]; /* card UUID of each device entry */
    struct vgpu_slot slots[VGPU_MAX_SLOTS];
    /* ---- v4: written by the container's utilisation poller (one hook process) ---- */
    uint32_t poll_seq;             /* sequence lock: odd while being written */
    uint32_t poll_rc;              /* VGPU_POLL_* */
    uint64_t poll_at_ns;           /* CLOCK_MONOTONIC of the publication */
    uint32_t poll_container_centi; /* the container's SM utilisation (busiest card), 1/100 % */
    uint32_t poll_reserved;
    uint16_t poll_slot_centi[VGPU_MAX_SLOTS]; /* each slot's own share of it, 1/100 % */
    /* ---- v5: written by the node daemon (host pids from the host's /proc/locks) ---- */
    uint64_t teller_at_ns;         /* CLOCK_MONOTONIC of its last pass; 0 = never */
    uint64_t told[VGPU_MAX_SLOTS]; /* slot pid << 32 | host pid; 0 = nothing told */
    /* A told process's context overhead, measured by the daemon from one NVML
     * list per card per period rather than one list per process: */
    uint32_t awaiting[VGPU_MAX_SLOTS]; /* hook: device entry + 1 it waits for; 0 = none */
    uint64_t measured[VGPU_MAX_SLOTS]; /* daemon: slot pid << 32 | (entry + 1) << 24 | MiB */
};

_Static_assert(sizeof(struct vgpu_shared) <= VGPU_SHARED_FILE_BYTES &&
                   sizeof(struct vgpu_shared) + 4096 > VGPU_SHARED_FILE_BYTES,
               "VGPU_SHARED_FILE_BYTES must be sizeof(struct vgpu_shared) rounded up to 4 KiB");

#endif
