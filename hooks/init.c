/* Lazy, once-per-process set-up: limits, fork handling. */
#include <pthread.h>

#include "vgpu.h"

struct vgpu_config vgpu_cfg = {.memory_limit = VGPU_NO_LIMIT};
int vgpu_ready;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

/* glibc's registration behind pthread_atfork (which glibc links statically
 * into each object); weak, so that the library loads under musl too. */
extern int __register_atfork(void (*)(void), void (*)(void), void (*)(void), void *)
    __attribute__((weak));
extern void *__dso_handle __attribute__((weak));

static void after_fork_child(void)
{
    vgpu_budget_after_fork();
    vgpu_device_after_fork();
    vgpu_memory_after_fork();
    vgpu_nvml_after_fork();
    vgpu_throttle_after_fork();
}

static void init(void)
{
    vgpu_config_load(&vgpu_cfg);
    if (__register_atfork)
        __register_atfork(NULL, NULL, after_fork_child, &__dso_handle ? __dso_handle : NULL);
    __atomic_store_n(&vgpu_ready, 1, __ATOMIC_RELEASE);
}

void vgpu_init_slow(void)
{
    pthread_once(&init_once, init);
}
