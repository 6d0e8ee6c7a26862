/*
 * Layout of the file shared by all processes of one container
 * ($VGPU_SHARED_DIR/vgpu.shm, mmap'ed MAP_SHARED).  Bump VGPU_SHARED_VERSION
 * on any change; a process that finds another version falls back to a
 * per-process budget rather than misread the file.
 *
 * Concurrency:
 *  - `lock` is a process-shared, robust pthread mutex guarding `used` and all
 *    slots.  A holder killed inside the critical section leaves it
 *    EOWNERDEAD; the next locker rebuilds `used` from the slots.
 *  - Each live process holds an fcntl write lock on byte
 *    VGPU_SLOT_LOCK_BASE + slot index of the file.  A slot whose lock can be
 *    taken belongs to a dead process (the kernel drops fcntl locks when the
 *    process dies, zombie or not), and its bytes are given back.
 *  - The file is created and initialised under an fcntl lock on byte 0.
 */
#ifndef VGPU_SHARED_H
#define VGPU_SHARED_H

#include <pthread.h>
#include <stdint.h>

#define VGPU_SHARED_MAGIC 0x76475055u /* "UPGv" */
#define VGPU_SHARED_VERSION 1u
#define VGPU_SHARED_FILE "vgpu.shm"
#define VGPU_MAX_DEVICES 16
#define VGPU_MAX_SLOTS 1024
/* fcntl byte offsets: 0 = init lock, BASE + i = slot i liveness lock. */
#define VGPU_SLOT_LOCK_BASE 4096

struct vgpu_slot {
    int32_t pid;       /* 0 = free; the pid as seen inside the container */
    uint32_t reserved;
    uint64_t used[VGPU_MAX_DEVICES]; /* bytes this process holds, per device */
};

struct vgpu_shared {
    uint32_t magic;        /* written last, once initialised */
    uint32_t version;
    uint32_t header_size;  /* sizeof(struct vgpu_shared) */
    uint32_t slot_count;   /* VGPU_MAX_SLOTS */
    uint64_t limit_bytes;  /* limit of the process that created it (informational) */
    uint32_t slot_hwm;     /* slots [0, slot_hwm) have ever been used */
    uint32_t pad;
    pthread_mutex_t lock;
    uint64_t used[VGPU_MAX_DEVICES]; /* sum of the slots' `used` */
    struct vgpu_slot slots[VGPU_MAX_SLOTS];
};

#endif
