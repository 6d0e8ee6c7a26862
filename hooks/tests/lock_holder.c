/*
 * Takes the budget lock of $VGPU_SHARED_DIR/vgpu.shm, leaves the totals
 * inconsistent (as a process killed mid-update would), says "ready" and
 * waits to be killed: the next locker must get EOWNERDEAD and recover.
 */
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
               : mmap(NULL, sizeof(*s), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (s == MAP_FAILED || s->magic != VGPU_SHARED_MAGIC) {
        perror(path);
        return 1;
    }
    pthread_mutex_lock(&s->lock);
    s->used[0] += 512ull << 20; /* charged to no slot: must disappear on recovery */
    printf("ready\n");
    fflush(stdout);
    pause();
    return 0;
}
