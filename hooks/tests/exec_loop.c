/*
 * Benchmark driver: `exec_loop N PROGRAM [ARGS...]` starts PROGRAM N times, one
 * after the other (posix_spawn + waitpid, after 10 unmeasured starts), and
 * prints the mean nanoseconds per start: wall clock, and the CPU time (user +
 * system) of the started processes, which a busy machine disturbs less.  Used
 * by preload_bench.sh to measure what /etc/ld.so.preload adds to every exec.
 */
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>

extern char **environ;

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static long long children_cpu_ns(void)
{
    struct rusage ru;
    getrusage(RUSAGE_CHILDREN, &ru);
    return (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000000ll +
           (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1000ll;
}

static int start(char **argv)
{
    pid_t pid;
    int status;
    if (posix_spawn(&pid, argv[0], NULL, NULL, argv, environ) != 0)
        return -1;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        return -1;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3)
        return 2;
    int n = atoi(argv[1]);
    for (int i = 0; i < 10; i++)
        if (start(argv + 2) != 0)
            return 1;
    if (n < 1)
        n = 1;
    long long t0 = now_ns(), c0 = children_cpu_ns();
    for (int i = 0; i < n; i++)
        if (start(argv + 2) != 0)
            return 1;
    printf("%lld %lld\n", (now_ns() - t0) / n, (children_cpu_ns() - c0) / n);
    return 0;
}
