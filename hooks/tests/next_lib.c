/*
 * Two tiny libraries (built with -DNEXT_LIB_A / -DNEXT_LIB_B) that check
 * dlsym(RTLD_NEXT) still resolves relative to its real caller under the
 * hook: A's next_value() wraps B's, as interposing libraries do.
 */
#define _GNU_SOURCE
#include <dlfcn.h>

int next_value(void);

#ifdef NEXT_LIB_A
int next_value(void)
{
    int (*next)(void) = (int (*)(void))dlsym(RTLD_NEXT, "next_value");
    if (!next)
        return -1;
    if (next == next_value) /* resolved relative to the wrong object */
        return -2;
    return 100 + next();
}
#else
int next_value(void)
{
    return 2;
}
#endif
