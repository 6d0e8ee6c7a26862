/* Logging and the limits: the mounted config, $VGPU_CONFIG (JSON), else environment
 * variables (precedence and fail-safe: vgpu.h). */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "vgpu.h"

#define CONFIG_MAX_BYTES 65536
#define JSON_MAX_DEPTH 32
#define MEMORY_LIMIT_MAX_MIB (1ll << 30) /* 1 EiB: anything above is a typo */

int vgpu_trace_on;

/* One line "<prefix>...\n" on stderr, in a single write. */
static void emit(const char *prefix, const char *fmt, va_list ap)
{
    char buf[512];
    int n = snprintf(buf, sizeof(buf), "%s", prefix);
    n += vsnprintf(buf + n, sizeof(buf) - (size_t)n - 1, fmt, ap);
    if (n > (int)sizeof(buf) - 2)
        n = (int)sizeof(buf) - 2;
    buf[n++] = '\n';
    ssize_t rc = write(STDERR_FILENO, buf, (size_t)n);
    (void)rc;
}

void vgpu_trace(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    emit("vgpu trace: ", fmt, ap);
    va_end(ap);
}

void vgpu_log(int *once, const char *fmt, ...)
{
    if (once && __atomic_exchange_n(once, 1, __ATOMIC_RELAXED))
        return;
    va_list ap;
    va_start(ap, fmt);
    emit("vgpu: ", fmt, ap);
    va_end(ap);
}

/* ---- a tolerant reader of one top-level JSON object ---- */

static const char *json_ws(const char *p)
{
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
        p++;
    return p;
}

static const char *json_string_end(const char *p) /* p at '"' */
{
    for (p++; *p && *p != '"'; p++)
        if (*p == '\\' && *++p == '\0')
            return NULL;
    return *p == '"' ? p + 1 : NULL;
}

static const char *json_skip_value(const char *p, int depth)
{
    p = json_ws(p);
    if (*p == '"')
        return json_string_end(p);
    if (*p == '{' || *p == '[') {
        char close = *p == '{' ? '}' : ']';
        if (depth >= JSON_MAX_DEPTH)
            return NULL;
        p = json_ws(p + 1);
        if (*p == close)
            return p + 1;
        for (;;) {
            if (close == '}') {
                if (*p != '"' || !(p = json_string_end(p)))
                    return NULL;
                p = json_ws(p);
                if (*p++ != ':')
                    return NULL;
            }
            if (!(p = json_skip_value(p, depth + 1)))
                return NULL;
            p = json_ws(p);
            if (*p == close)
                return p + 1;
            if (*p++ != ',')
                return NULL;
            p = json_ws(p);
        }
    }
    /* number, true, false, null */
    const char *start = p;
    while (*p && strchr("+-.0123456789eEtruefalsn", *p))
        p++;
    return p > start ? p : NULL;
}

/* Strict integer: optional '-', digits, no fraction or exponent. */
static int parse_int(const char *p, const char **end, long long *out)
{
    int neg = *p == '-';
    const char *d = p + neg;
    if (*d < '0' || *d > '9')
        return -1;
    long long v = 0;
    for (; *d >= '0' && *d <= '9'; d++) {
        if (v > (MEMORY_LIMIT_MAX_MIB * 1024))
            return -1;
        v = v * 10 + (*d - '0');
    }
    *out = neg ? -v : v;
    *end = d;
    return 0;
}

/* One top-level key of a JSON object text: 1 and where its value starts, 0
 * if absent, -1 if the text is not a JSON object (as far as it was read). */
static int json_find(const char *text, const char *key, const char **value)
{
    size_t keylen = strlen(key);
    const char *p = json_ws(text);
    if (*p++ != '{')
        return -1;
    p = json_ws(p);
    if (*p == '}')
        return 0;
    for (;;) {
        if (*p != '"')
            return -1;
        const char *kstart = p + 1, *kend = json_string_end(p);
        if (!kend)
            return -1;
        int match = (size_t)(kend - 1 - kstart) == keylen && memcmp(kstart, key, keylen) == 0;
        p = json_ws(kend);
        if (*p++ != ':')
            return -1;
        p = json_ws(p);
        if (match) {
            *value = p;
            return 1;
        }
        if (!(p = json_skip_value(p, 1)))
            return -1;
        p = json_ws(p);
        if (*p == '}')
            return 0;
        if (*p++ != ',')
            return -1;
        p = json_ws(p);
    }
}

/* One top-level key of a JSON object text: 1 and the integer, 0 if absent
 * or null, -1 if not an integer or the text is not a JSON object. */
static int json_int(const char *text, const char *key, long long *out)
{
    const char *p;
    int found = json_find(text, key, &p);
    if (found <= 0)
        return found;
    if (strncmp(p, "null", 4) == 0)
        return 0;
    const char *end;
    if (parse_int(p, &end, out) != 0)
        return -1;
    end = json_ws(end);
    return (*end == ',' || *end == '}') ? 1 : -1;
}

/* A top-level array of plain strings (no escapes) as "a,b,c" in out; 1 if
 * it fits, else 0 (absent, not such an array, too long). */
static int json_string_list(const char *text, const char *key, char *out, size_t size)
{
    const char *p;
    if (json_find(text, key, &p) <= 0 || *p++ != '[')
        return 0;
    size_t n = 0;
    p = json_ws(p);
    while (*p != ']') {
        if (*p != '"')
            return 0;
        const char *start = p + 1, *end = start;
        while (*end && *end != '"' && *end != '\\' && *end != ',')
            end++;
        if (*end != '"' || (size_t)(end - start) + 2 > size - n)
            return 0;
        if (n)
            out[n++] = ',';
        memcpy(out + n, start, (size_t)(end - start));
        n += (size_t)(end - start);
        p = json_ws(end + 1);
        if (*p == ',')
            p = json_ws(p + 1);
        else if (*p != ']')
            return 0;
    }
    out[n] = '\0';
    return 1;
}

/* ---- the limits ---- */

/* Reads a config file that the tenant may have replaced by anything: no
 * link followed, no blocking on a FIFO or device, at most CONFIG_MAX_BYTES.
 * NULL and the text (to free), or why it cannot be used. */
static const char *read_config_file(const char *path, char **text)
{
    *text = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
    if (fd < 0)
        return errno == ELOOP ? "it is a symbolic link" : strerror(errno);
    struct stat st;
    const char *why = NULL;
    char *buf = NULL;
    size_t n = 0;
    if (syscall(SYS_fstat, fd, &st) != 0) /* fstat without the GLIBC_2.33 symbol */
        why = strerror(errno);
    else if (!S_ISREG(st.st_mode))
        why = "not a regular file";
    else if (st.st_size > CONFIG_MAX_BYTES)
        why = "larger than 64 KiB";
    else if (!(buf = malloc(CONFIG_MAX_BYTES + 2)))
        why = "out of memory";
    while (!why && n <= CONFIG_MAX_BYTES) {
        ssize_t r = read(fd, buf + n, CONFIG_MAX_BYTES + 1 - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            why = strerror(errno);
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    if (!why && n > CONFIG_MAX_BYTES)
        why = "larger than 64 KiB"; /* it grew while read */
    close(fd);
    if (why) {
        free(buf);
        return why;
    }
    buf[n] = '\0';
    *text = buf;
    return NULL;
}

/* The two limits of a config text; NULL, or why the text is unusable. */
static const char *config_limits(const char *text, long long *mem, int *mem_found, long long *core,
                                 int *core_found)
{
    *mem_found = json_int(text, "memory_limit_mib", mem);
    *core_found = json_int(text, "core_percent", core);
    if (*mem_found < 0 || (*mem_found && (*mem < 1 || *mem > MEMORY_LIMIT_MAX_MIB)))
        return "memory_limit_mib is not an integer in [1, 1073741824], or not in a JSON object";
    if (*core_found < 0 || (*core_found && (*core < 1 || *core > 100)))
        return "core_percent is not an integer in [1, 100], or not in a JSON object";
    return NULL;
}

/* Environment integer: 1 = value, 0 = unset/empty/null, -1 = not an integer. */
static int env_int(const char *name, long long *out)
{
    const char *s = getenv(name);
    if (!s)
        return 0;
    const char *p = json_ws(s);
    if (*p == '\0' || strcmp(p, "null") == 0)
        return 0;
    const char *end;
    if (parse_int(p, &end, out) != 0 || *json_ws(end) != '\0')
        return -1;
    return 1;
}

/* Applies one looked-up value: keeps it if in [lo, hi], else logs once. */
static int checked(int found, long long v, long long lo, long long hi, const char *what,
                   const char *source, int *logged)
{
    if (found == 0)
        return 0;
    if (found > 0 && v >= lo && v <= hi)
        return 1;
    vgpu_log(logged, "%s: %s is not an integer in [%lld, %lld]; ignored (no limit for it)", source,
             what, lo, hi);
    return 0;
}

/* VGPU_LOG_LEVEL: trace or debug switches tracing on; the others keep it off. */
static void load_log_level(void)
{
    static int logged;
    const char *level = getenv("VGPU_LOG_LEVEL");
    if (!level || !*level)
        return;
    if (!strcasecmp(level, "trace") || !strcasecmp(level, "debug")) {
        vgpu_trace_on = 1;
        return;
    }
    if (strcasecmp(level, "info") && strcasecmp(level, "warning") && strcasecmp(level, "error"))
        vgpu_log(&logged, "VGPU_LOG_LEVEL=%s is not one of trace, debug, info, warning, error; "
                 "tracing stays off", level);
}

/* Whether this is a container with vgpu's files mounted (see vgpu.h). */
static int mounted(void)
{
    return access(VGPU_MOUNT_DIR, F_OK) == 0 || (errno != ENOENT && errno != ENOTDIR);
}

void vgpu_config_load(struct vgpu_config *cfg)
{
    static int logged_mem, logged_core, logged_overhead, logged_file;
    static char cards[VGPU_MAX_DEVICES * VGPU_UUID_BYTES];
    load_log_level();
    long long mem = 0, core = 0, overhead = 0;
    int mem_found = 0, core_found = 0, overhead_found = 0;
    const char *source = "environment", *mem_name = "VGPU_MEMORY_LIMIT_MIB",
               *core_name = "VGPU_CORE_LIMIT";
    int in_mount = mounted();
    const char *path = in_mount ? VGPU_MOUNT_CONFIG : getenv("VGPU_CONFIG");
    const char *shared = in_mount ? VGPU_MOUNT_SHARED_DIR : getenv("VGPU_SHARED_DIR");
    cfg->visible = getenv("NVIDIA_VISIBLE_DEVICES");
    cfg->shared_dir = shared && *shared ? shared : NULL;
    cfg->refuse = 0;
    const char *why = NULL;
    if (path && *path) {
        char *text;
        why = read_config_file(path, &text);
        if (!why)
            why = config_limits(text, &mem, &mem_found, &core, &core_found);
        if (!why) {
            source = path;
            mem_name = "memory_limit_mib";
            core_name = "core_percent";
            overhead_found = json_int(text, "context_overhead_mib", &overhead);
            if (in_mount) /* the names the daemon gave, not the environment's */
                cfg->visible = json_string_list(text, "cards", cards, sizeof(cards)) ? cards : NULL;
        }
        free(text);
    }
    if (!path || !*path || why) {
        mem_found = env_int("VGPU_MEMORY_LIMIT_MIB", &mem);
        core_found = env_int("VGPU_CORE_LIMIT", &core);
    }
    int mem_ok = checked(mem_found, mem, 1, MEMORY_LIMIT_MAX_MIB, mem_name, source, &logged_mem);
    int core_ok = checked(core_found, core, 1, 100, core_name, source, &logged_core);
    if (why && !mem_ok && !(core_ok && core < 100)) { /* 100 % is no limit either */
        vgpu_log(&logged_file, "%s is unusable (%s) and the environment has no limits: failing "
                 "safe, this process gets no GPU context and no GPU memory", path, why);
        cfg->refuse = 1;
    } else if (why) {
        vgpu_log(&logged_file, "%s is unusable (%s); using the limits in the environment", path,
                 why);
    }
    cfg->memory_limit = cfg->refuse ? 0 : mem_ok ? (uint64_t)mem * VGPU_MIB : VGPU_NO_LIMIT;
    cfg->core_percent = cfg->refuse ? 1 : core_ok && core < 100 ? (int)core : 0;
    /* The per-card context estimate (not a limit): the config's, else the
     * Allocate answer's environment. */
    if (overhead_found <= 0) {
        overhead_found = env_int("VGPU_CONTEXT_OVERHEAD_MIB", &overhead);
        source = "environment";
    }
    cfg->context_overhead = checked(overhead_found, overhead, 0, 65536, "VGPU_CONTEXT_OVERHEAD_MIB",
                                    source, &logged_overhead)
                                ? (uint64_t)overhead * VGPU_MIB
                                : 0;
    VGPU_TRACE("limits from %s: memory %llu MiB per card, core %d%%, context estimate %llu MiB%s",
               why ? "environment" : path && *path ? path : "environment",
               cfg->memory_limit == VGPU_NO_LIMIT ? 0ull : (unsigned long long)(cfg->memory_limit / VGPU_MIB),
               cfg->core_percent, (unsigned long long)(cfg->context_overhead / VGPU_MIB),
               cfg->refuse ? " (refused: fail-safe)" : "");
}
