/*
 * A stand-in libnvidia-ml.so.1: one device whose every process utilisation
 * sample says FAKE_NVML_SM_UTIL percent (default 0) for pid FAKE_NVML_PID
 * (default: the calling process), stamped now.
 */
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "../nvml_types.h"

nvmlReturn_t nvmlInit_v2(void) { return NVML_SUCCESS; }
nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) { *n = 1; return NVML_SUCCESS; }
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d)
{
    *d = (nvmlDevice_t)(uintptr_t)(i + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *s,
                                             unsigned int *count, unsigned long long last_seen)
{
    struct timespec ts;
    (void)d;
    (void)last_seen;
    if (!s || *count < 1) {
        *count = 1;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    clock_gettime(CLOCK_REALTIME, &ts);
    const char *util = getenv("FAKE_NVML_SM_UTIL"), *pid = getenv("FAKE_NVML_PID");
    s[0].pid = pid ? (unsigned int)atoi(pid) : (unsigned int)getpid();
    s[0].timeStamp = (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000;
    s[0].smUtil = util ? (unsigned int)atoi(util) : 0;
    s[0].memUtil = s[0].encUtil = s[0].decUtil = 0;
    *count = 1;
    return NVML_SUCCESS;
}
