/*
 * Keeps libvgpu.so loadable on glibc 2.28 (UBI 8) and 2.31 (Ubuntu 20.04)
 * when it is built on a newer glibc.  glibc 2.34 moved libdl and libpthread
 * into libc and gave their functions new symbol versions; binding to the
 * base version instead makes the loader find them in libc (2.34+) or in
 * libdl.so.2 / libpthread.so.0 (older; both are DT_NEEDED).  Included into
 * every source of the library (-include); tests/hooks checks the highest
 * GLIBC_x.y the built library needs.
 */
#ifndef VGPU_GLIBC_FLOOR_H
#define VGPU_GLIBC_FLOOR_H

#if defined(__x86_64__)
#define VGPU_GLIBC_BASE "GLIBC_2.2.5"
#elif defined(__aarch64__)
#define VGPU_GLIBC_BASE "GLIBC_2.17"
#else
#error "set VGPU_GLIBC_BASE: the first glibc symbol version of this architecture"
#endif

#define VGPU_BASE_VERSION(sym) __asm__(".symver " #sym "," #sym "@" VGPU_GLIBC_BASE)
VGPU_BASE_VERSION(dlopen);
VGPU_BASE_VERSION(dlclose);
VGPU_BASE_VERSION(dlvsym);
VGPU_BASE_VERSION(dladdr);
VGPU_BASE_VERSION(pthread_create);
VGPU_BASE_VERSION(pthread_once);
VGPU_BASE_VERSION(pthread_sigmask);
VGPU_BASE_VERSION(pthread_attr_init);
VGPU_BASE_VERSION(pthread_attr_destroy);
VGPU_BASE_VERSION(pthread_attr_setdetachstate);
VGPU_BASE_VERSION(pthread_mutex_init);
VGPU_BASE_VERSION(pthread_mutex_lock);
VGPU_BASE_VERSION(pthread_mutex_unlock);
#undef VGPU_BASE_VERSION

#endif
