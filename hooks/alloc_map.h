/*
 * Thread-safe map (kind, key) -> (device, size): which allocation took how
 * many bytes, so that its free gives back exactly that.  Open addressing
 * with linear probing and backward-shift deletion: no allocation per
 * insert, only when the table grows.
 */
#ifndef VGPU_ALLOC_MAP_H
#define VGPU_ALLOC_MAP_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

enum vgpu_key_kind { VGPU_KEY_PTR = 1, VGPU_KEY_HANDLE, VGPU_KEY_ARRAY, VGPU_KEY_MIPMAP };

struct vgpu_map_entry {
    uint64_t key;
    uint64_t size;
    int32_t dev;
    uint8_t kind; /* 0 = empty */
};

struct vgpu_map {
    pthread_mutex_t lock;
    struct vgpu_map_entry *slots;
    size_t cap; /* power of two, or 0 before the first insert */
    size_t count;
};

#define VGPU_MAP_INITIALIZER { PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0 }

/* Inserts; if the key was present, *old gets its entry and 1 is returned,
 * else 0; -1 when out of memory (nothing stored). */
int vgpu_map_put(struct vgpu_map *m, struct vgpu_map_entry e, struct vgpu_map_entry *old);
/* Removes the key; 1 and *out filled if it was there, else 0. */
int vgpu_map_take(struct vgpu_map *m, int kind, uint64_t key, struct vgpu_map_entry *out);
/* Forget everything without locking (a forked child: other threads are gone). */
void vgpu_map_reset(struct vgpu_map *m);

#endif
