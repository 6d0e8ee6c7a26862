/*
 * Takes the budget lock of $VGPU_SHARED_DIR/vgpu.shm as the hook does (a
 * slot's liveness lock, then the lock word naming that slot), leaves the
 * totals inconsistent (as a process killed mid-update would), says "ready"
 * and waits to be killed: the next locker must notice the dead owner, take
 * the lock over and rebuild the totals.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../vgpu_shared.h"

int main(void)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", getenv("VGPU_SHARED_DIR"), VGPU_SHARED_FILE);
    int fd = open(path, O_RDWR);
    struct vgpu_shared *s =
        fd < 0 ? MAP_FAILED
               : mmap(NULL, VGPU_SHARED_FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (s == MAP_FAILED || s->magic != VGPU_SHARED_MAGIC) {
        perror(path);
        return 1;
    }
    int slot = VGPU_MAX_SLOTS - 1;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET,
                       .l_start = VGPU_SLOT_LOCK_BASE + slot, .l_len = 1};
    uint32_t zero = 0;
    if (fcntl(fd, F_OFD_SETLK, &fl) != 0 ||
        !__atomic_compare_exchange_n(&s->lock, &zero, (uint32_t)slot + 1, 0, __ATOMIC_ACQUIRE,
                                     __ATOMIC_RELAXED)) {
        fprintf(stderr, "cannot take the lock\n");
        return 1;
    }
    s->used[0] += 512ull << 20; /* charged to no slot: must disappear on recovery */
    printf("ready\n");
    fflush(stdout);
    pause();
    return 0;
}
