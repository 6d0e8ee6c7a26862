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

enum vgpu_key_kind {
    VGPU_KEY_PTR = 1,
    VGPU_KEY_HANDLE,  /* aux: mappings of it (low 32 bits), VGPU_HANDLE_RELEASED */
    VGPU_KEY_ARRAY,
    VGPU_KEY_MIPMAP,
    VGPU_KEY_MAPPING, /* a cuMemMap'ed range; aux: its handle */
    VGPU_KEY_POOLPTR, /* a pool allocation (charged through its pool); aux: the pool */
};
#define VGPU_HANDLE_RELEASED (1ull << 63)

struct vgpu_map_entry {
    uint64_t key;
    uint64_t size;
    uint64_t aux;
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
/* A VMM handle's mappings and release, as one step: adds `maps` (+1/-1) to
 * its mapping count and marks it released when `release`.  Returns 0 if the
 * handle is unknown, 1 if it stays, 2 if it is gone now (released, no
 * mapping left: *out tells what it held). */
int vgpu_map_handle(struct vgpu_map *m, uint64_t handle, int maps, int release,
                    struct vgpu_map_entry *out);
/* Forget everything without locking (a forked child: other threads are gone). */
void vgpu_map_reset(struct vgpu_map *m);

#endif
