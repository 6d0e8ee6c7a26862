#include "alloc_map.h"

#include <stdlib.h>

#define MAP_MIN_CAP 1024

static size_t map_home(uint64_t key, int kind, size_t cap)
{
    uint64_t h = (key ^ ((uint64_t)kind << 59)) * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 32) & (cap - 1);
}

static size_t map_find(const struct vgpu_map *m, int kind, uint64_t key)
{
    size_t i = map_home(key, kind, m->cap);
    while (m->slots[i].kind != 0 && (m->slots[i].kind != kind || m->slots[i].key != key))
        i = (i + 1) & (m->cap - 1);
    return i;
}

static int map_grow(struct vgpu_map *m)
{
    size_t cap = m->cap ? m->cap * 2 : MAP_MIN_CAP;
    struct vgpu_map_entry *slots = calloc(cap, sizeof(*slots));
    if (!slots)
        return -1;
    struct vgpu_map old = *m;
    m->slots = slots;
    m->cap = cap;
    for (size_t i = 0; i < old.cap; i++)
        if (old.slots[i].kind != 0)
            m->slots[map_find(m, old.slots[i].kind, old.slots[i].key)] = old.slots[i];
    free(old.slots);
    return 0;
}

int vgpu_map_put(struct vgpu_map *m, struct vgpu_map_entry e, struct vgpu_map_entry *old)
{
    int ret = -1;
    pthread_mutex_lock(&m->lock);
    if ((m->count + 1) * 2 > m->cap && map_grow(m) != 0)
        goto out;
    size_t i = map_find(m, e.kind, e.key);
    ret = m->slots[i].kind != 0;
    if (ret)
        *old = m->slots[i];
    else
        m->count++;
    m->slots[i] = e;
out:
    pthread_mutex_unlock(&m->lock);
    return ret;
}

/* Removes slot i (occupied).  Lock held. */
static void map_remove(struct vgpu_map *m, size_t i)
{
    m->count--;
    /* Backward-shift deletion keeps every probe chain unbroken. */
    size_t mask = m->cap - 1;
    for (size_t j = (i + 1) & mask; m->slots[j].kind != 0; j = (j + 1) & mask) {
        size_t home = map_home(m->slots[j].key, m->slots[j].kind, m->cap);
        /* Move j into the hole at i unless its home lies cyclically in (i, j]. */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            m->slots[i] = m->slots[j];
            i = j;
        }
    }
    m->slots[i].kind = 0;
}

int vgpu_map_take(struct vgpu_map *m, int kind, uint64_t key, struct vgpu_map_entry *out)
{
    int found = 0;
    pthread_mutex_lock(&m->lock);
    if (m->cap == 0)
        goto out;
    size_t i = map_find(m, kind, key);
    if (m->slots[i].kind == 0)
        goto out;
    found = 1;
    *out = m->slots[i];
    map_remove(m, i);
out:
    pthread_mutex_unlock(&m->lock);
    return found;
}

int vgpu_map_handle(struct vgpu_map *m, uint64_t handle, int maps, int release,
                    struct vgpu_map_entry *out)
{
    int state = 0;
    pthread_mutex_lock(&m->lock);
    if (m->cap == 0)
        goto out;
    size_t i = map_find(m, VGPU_KEY_HANDLE, handle);
    struct vgpu_map_entry *e = &m->slots[i];
    if (e->kind == 0)
        goto out;
    uint64_t count = e->aux & 0xffffffffull;
    count = maps < 0 ? (count ? count - 1 : 0) : count + (uint64_t)maps;
    e->aux = (e->aux & ~0xffffffffull) | count | (release ? VGPU_HANDLE_RELEASED : 0);
    state = 1;
    if ((e->aux & VGPU_HANDLE_RELEASED) && count == 0) {
        state = 2;
        *out = *e;
        map_remove(m, i);
    }
out:
    pthread_mutex_unlock(&m->lock);
    return state;
}

void vgpu_map_reset(struct vgpu_map *m)
{
    pthread_mutex_init(&m->lock, NULL);
    free(m->slots);
    m->slots = NULL;
    m->cap = 0;
    m->count = 0;
}
