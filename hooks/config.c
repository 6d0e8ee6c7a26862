/* Logging and the limits: $VGPU_CONFIG (JSON), else environment variables. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
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

/* One top-level key of a JSON object text: 1 and the integer, 0 if absent
 * or null, -1 if not an integer or the text is not a JSON object. */
static int json_int(const char *text, const char *key, long long *out)
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
            if (strncmp(p, "null", 4) == 0)
                return 0;
            const char *end;
            if (parse_int(p, &end, out) != 0)
                return -1;
            end = json_ws(end);
            return (*end == ',' || *end == '}') ? 1 : -1;
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

/* ---- the limits ---- */

static char *read_small_file(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    char *buf = malloc(CONFIG_MAX_BYTES + 1);
    size_t n = 0;
    while (buf && n < CONFIG_MAX_BYTES) {
        ssize_t r = read(fd, buf + n, CONFIG_MAX_BYTES - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    close(fd);
    if (buf)
        buf[n] = '\0';
    return buf;
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

void vgpu_config_load(struct vgpu_config *cfg)
{
    static int logged_mem, logged_core, logged_overhead;
    load_log_level();
    long long mem = 0, core = 0;
    int mem_found, core_found;
    const char *source, *mem_name = "memory_limit_mib", *core_name = "core_percent";
    const char *path = getenv("VGPU_CONFIG");
    char *text = NULL;
    if (path && *path) {
        source = path;
        text = read_small_file(path);
        if (!text) {
            static int logged;
            vgpu_log(&logged, "cannot read VGPU_CONFIG file %s: %s; no limits enforced", path,
                     strerror(errno));
            mem_found = core_found = 0;
        } else {
            mem_found = json_int(text, "memory_limit_mib", &mem);
            core_found = json_int(text, "core_percent", &core);
        }
        free(text);
    } else {
        source = "environment";
        mem_name = "VGPU_MEMORY_LIMIT_MIB";
        core_name = "VGPU_CORE_LIMIT";
        mem_found = env_int("VGPU_MEMORY_LIMIT_MIB", &mem);
        core_found = env_int("VGPU_CORE_LIMIT", &core);
    }
    cfg->memory_limit = checked(mem_found, mem, 1, MEMORY_LIMIT_MAX_MIB, mem_name, source, &logged_mem)
                            ? (uint64_t)mem * VGPU_MIB
                            : VGPU_NO_LIMIT;
    cfg->core_percent = checked(core_found, core, 1, 100, core_name, source, &logged_core) && core < 100
                            ? (int)core
                            : 0;
    /* The per-card context estimate comes from the Allocate answer's
     * environment in both modes (it is not a limit). */
    long long overhead = 0;
    int overhead_found = env_int("VGPU_CONTEXT_OVERHEAD_MIB", &overhead);
    cfg->context_overhead = checked(overhead_found, overhead, 0, 65536, "VGPU_CONTEXT_OVERHEAD_MIB",
                                    "environment", &logged_overhead)
                                ? (uint64_t)overhead * VGPU_MIB
                                : 0;
    VGPU_TRACE("limits: memory %llu MiB per card, core %d%%, context estimate %llu MiB",
               cfg->memory_limit == VGPU_NO_LIMIT ? 0ull : (unsigned long long)(cfg->memory_limit / VGPU_MIB),
               cfg->core_percent, (unsigned long long)(cfg->context_overhead / VGPU_MIB));
}
