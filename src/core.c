/* Backend registry, device handles and device memory. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, CLOCK_MONOTONIC, environ */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "config.h"
#include "core.h"

static const sparge_backend *const registry[] = {
#ifdef SPARGE_HAVE_CUDA
    &sparge_backend_cuda,
    &sparge_backend_cuda_generic,
#endif
#ifdef SPARGE_HAVE_HIP
    &sparge_backend_hip,
#endif
    &sparge_backend_cpu,
    &sparge_backend_cpu_ref,
};
enum { REGISTRY_LEN = sizeof registry / sizeof registry[0] };

int sparge_backend_count(void) { return REGISTRY_LEN; }

const char *sparge_backend_name(int i) { return i >= 0 && i < REGISTRY_LEN ? registry[i]->name : NULL; }

static const sparge_backend *find_backend(const char *name, size_t len)
{
    for (int i = 0; i < REGISTRY_LEN; i++)
        if (strlen(registry[i]->name) == len && strncmp(registry[i]->name, name, len) == 0)
            return registry[i];
    return NULL;
}

int sparge_backend_device_count(const char *backend)
{
    const sparge_backend *be = backend ? find_backend(backend, strlen(backend)) : NULL;
    return be ? be->device_count() : 0;
}

static const sparge_option_def strict_option = {
    "strict", "SPARGE_STRICT", "auto|off|on",
    "on: a call the device's first tier cannot run is refused instead of running on the next tier"};

/* Definition of option i of dev: 0 is "strict", then the first tier's. */
static const sparge_option_def *option_def(const sparge_device *dev, int i)
{
    return i == 0 ? &strict_option : &dev->be->options[i - 1];
}

int sparge_device_option_count(const sparge_device *dev) { return dev ? 1 + dev->be->n_options : 0; }

static sparge_status set_option_at(sparge_device *dev, int i, const char *value, const char *fn)
{
    const sparge_option_def *def = option_def(dev, i);
    if (strlen(value) >= SPARGE_OPTION_LEN)
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: value of option %s is too long (accepted: %s)", fn, def->name,
                           def->values);
    sparge_status s = SPARGE_OK;
    if (i == 0) {
        if (strcmp(value, "auto") && strcmp(value, "off") && strcmp(value, "on"))
            return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: option strict must be auto, off or on, got \"%s\"", fn, value);
        dev->strict = !strcmp(value, "on");
    } else if ((s = dev->be->set_option(dev->impl, i - 1, value)))
        return s;
    snprintf(dev->option_values[i], SPARGE_OPTION_LEN, "%s", value);
    return SPARGE_OK;
}

/* Every option's default, then the environment's value where its variable is set. */
static sparge_status init_options(sparge_device *dev)
{
    sparge_status s;
    for (int i = 0; i < sparge_device_option_count(dev); i++) {
        const sparge_option_def *def = option_def(dev, i);
        const char *env = def->env ? getenv(def->env) : NULL;
        if ((s = set_option_at(dev, i, "auto", "sparge_device_open")))
            return s;
        if (env && set_option_at(dev, i, env, "sparge_device_open"))
            return SPARGE_FAIL(SPARGE_ERR_INVALID, "sparge_device_open: %s=\"%s\" is not a value of option %s (%s)",
                               def->env, env, def->name, def->values);
    }
    return SPARGE_OK;
}

extern char **environ;

/* A tuning variable (SPARGE_CPU_*, SPARGE_CUDA_*, SPARGE_HIP_*) that no backend of this build reads is an error, not
 * a setting silently ignored. */
static sparge_status check_environment(void)
{
    static const char *const prefixes[] = {"SPARGE_CPU_", "SPARGE_CUDA_", "SPARGE_HIP_"};
    for (char **e = environ; e && *e; e++) {
        int ours = 0, read = 0;
        for (size_t p = 0; p < sizeof prefixes / sizeof prefixes[0]; p++)
            ours |= strncmp(*e, prefixes[p], strlen(prefixes[p])) == 0;
        if (!ours)
            continue;
        const size_t len = strcspn(*e, "=");
        for (int i = 0; i < REGISTRY_LEN && !read; i++)
            for (int o = 0; o < registry[i]->n_options && !read; o++) {
                const char *env = registry[i]->options[o].env;
                read = env && strlen(env) == len && strncmp(env, *e, len) == 0;
            }
        if (!read)
            return SPARGE_FAIL(SPARGE_ERR_INVALID,
                               "sparge_device_open: %.*s is set, but no backend of this build reads it (unset it; "
                               "sparge info lists each device's options and their variables)", (int)len, *e);
    }
    return SPARGE_OK;
}

static sparge_status open_on(const sparge_backend *be, int index, sparge_device **out)
{
    sparge_status s = check_environment();
    if (s)
        return s;
    int n = be->device_count();
    if (index < 0 || index >= n)
        return SPARGE_FAIL(SPARGE_ERR_NO_DEVICE, "sparge_device_open: device %s:%d: backend '%s' sees %d device(s)",
                           be->name, index, be->name, n);
    if (1 + be->n_options > SPARGE_MAX_OPTIONS)
        return SPARGE_FAIL(SPARGE_ERR_RUNTIME, "device %s:%d: backend declares too many options", be->name, index);
    sparge_device *dev = calloc(1, sizeof *dev);
    if (!dev)
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "device %s:%d: out of host memory", be->name, index);
    dev->be = be;
    dev->index = index;
    s = be->open(index, &dev->impl, dev->description, sizeof dev->description);
    if (s != SPARGE_OK) {
        free(dev);
        return s;
    }
    if ((s = init_options(dev)) ||
        (pthread_mutex_init(&dev->lock, NULL) != 0 &&
         (s = SPARGE_FAIL(SPARGE_ERR_RUNTIME, "device %s:%d: cannot create its lock", be->name, index)))) {
        if (be->close)
            be->close(dev->impl);
        free(dev);
        return s;
    }
    dev->serialized = be->set_stream != NULL;
    atomic_init(&dev->refs, 1);
    if (strncmp(be->name, "cpu", 3) == 0)
        snprintf(dev->name, sizeof dev->name, "%s", be->name);
    else
        snprintf(dev->name, sizeof dev->name, "%s:%d", be->name, index);
    *out = dev;
    return SPARGE_OK;
}

sparge_status sparge_device_option(const sparge_device *dev, int i, const char **name, const char **value,
                                   const char **values, const char **env, const char **help)
{
    if (!dev)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "sparge_device_option: device is NULL");
    if (i < 0 || i >= sparge_device_option_count(dev))
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "sparge_device_option: index %d is outside [0, %d)", i,
                           sparge_device_option_count(dev));
    const sparge_option_def *def = option_def(dev, i);
    if (name) *name = def->name;
    if (value) *value = dev->option_values[i];
    if (values) *values = def->values;
    if (env) *env = def->env;
    if (help) *help = def->help;
    return SPARGE_OK;
}

static int find_option(const sparge_device *dev, const char *name)
{
    for (int i = 0; i < sparge_device_option_count(dev); i++)
        if (!strcmp(option_def(dev, i)->name, name))
            return i;
    return -1;
}

static sparge_status unknown_option(const sparge_device *dev, const char *name, const char *fn)
{
    char known[256] = "";
    for (int i = 0; i < sparge_device_option_count(dev); i++) {
        strncat(known, option_def(dev, i)->name, sizeof known - strlen(known) - 1);
        strncat(known, i + 1 < sparge_device_option_count(dev) ? ", " : "", sizeof known - strlen(known) - 1);
    }
    return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: %s has no option \"%s\" (it has: %s)", fn, dev->name, name, known);
}

sparge_status sparge_device_get_option(const sparge_device *dev, const char *name, const char **value)
{
    if (!dev || !name || !value)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "sparge_device_get_option: %s is NULL",
                           !dev ? "device" : !name ? "name" : "value");
    int i = find_option(dev, name);
    if (i < 0)
        return unknown_option(dev, name, "sparge_device_get_option");
    *value = dev->option_values[i];
    return SPARGE_OK;
}

sparge_status sparge_device_set_option(sparge_device *dev, const char *name, const char *value)
{
    static const char fn[] = "sparge_device_set_option";
    if (!dev || !name || !value)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "%s: %s is NULL", fn, !dev ? "device" : !name ? "name" : "value");
    int i = find_option(dev, name);
    if (i < 0)
        return unknown_option(dev, name, fn);
    /* Queued work may read the state an option selects (a kernel variant's workspace): let it finish. */
    sparge_status s = sparge_synchronize(dev);
    if (s)
        return s;
    sparge_dev_lock(dev);
    s = set_option_at(dev, i, value, fn);
    sparge_dev_unlock(dev);
    return s;
}

const char *sparge_op_name(sparge_op op)
{
    static const char *const names[SPARGE_OP_COUNT] = {
        [SPARGE_OP_POOL] = "pool",           [SPARGE_OP_POOLED_MAP] = "pooled map",
        [SPARGE_OP_MASK_SELECT] = "mask selection", [SPARGE_OP_MASK_PREDICT] = "mask prediction",
        [SPARGE_OP_FORWARD] = "forward",     [SPARGE_OP_BACKWARD] = "backward"};
    return op >= 0 && op < SPARGE_OP_COUNT ? names[op] : "?";
}

sparge_status sparge_pick_tier(sparge_device *dev, const sparge_op_desc *d, const char *fn,
                               const sparge_backend **tier)
{
    char why[768] = "";
    for (const sparge_backend *be = dev->be; be; be = dev->strict ? NULL : be->next) {
        if (be->supports(dev->impl, d) == SPARGE_OK) {
            *tier = be;
            return SPARGE_OK;
        }
        size_t n = strlen(why);
        snprintf(why + n, sizeof why - n, "%s%s", n ? "; " : "", sparge_last_error());
    }
    return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "%s: %s cannot run this %s%s: %s", fn, dev->name, sparge_op_name(d->op),
                       dev->strict && dev->be->next ? " (strict=on: no fallback)" : "", why);
}

sparge_status sparge_device_supports(sparge_device *dev, const sparge_op_desc *d, const char **tier)
{
    static const char fn[] = "sparge_device_supports";
    if (!dev || !d)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "%s: %s is NULL", fn, dev ? "desc" : "device");
    if ((unsigned)d->op >= SPARGE_OP_COUNT)
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: unknown op %d", fn, (int)d->op);
    if (d->head_dim < 0 || d->block_q < 0 || d->block_k < 0 || d->B < 0 || d->H < 0 || d->Nq < 0 || d->Nk < 0 ||
        d->kv_heads < 0)
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: negative size in the description (head_dim %lld, blocks %d x %d, "
                           "B %lld H %lld Nq %lld Nk %lld kv_heads %lld)", fn, (long long)d->head_dim, d->block_q,
                           d->block_k, (long long)d->B, (long long)d->H, (long long)d->Nq, (long long)d->Nk,
                           (long long)d->kv_heads);
    if (!sparge_dtype_size(d->dtype))
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: unknown dtype %d", fn, (int)d->dtype);
    /* Causal attention aligns the last query with the last key: no call has more queries than keys. */
    if (d->causal && !d->varlen && d->Nq > d->Nk &&
        (d->op == SPARGE_OP_FORWARD || d->op == SPARGE_OP_BACKWARD || d->op == SPARGE_OP_MASK_PREDICT))
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: causal with Nq %lld > Nk %lld", fn, (long long)d->Nq,
                           (long long)d->Nk);
    /* No call has K/V heads that do not divide the query heads: such a description has no answer. */
    if (d->kv_heads > 0 && d->H > 0 && d->H % d->kv_heads)
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: kv_heads %lld does not divide H %lld", fn, (long long)d->kv_heads,
                           (long long)d->H);
    const sparge_backend *be;
    sparge_status s = sparge_pick_tier(dev, d, fn, &be);
    if (!s && tier)
        *tier = be->name;
    return s;
}

double sparge_dtype_tolerance(sparge_dtype t)
{
    switch (t) {
    case SPARGE_F32: return 1e-5;
    case SPARGE_F16: return 3e-3;
    case SPARGE_BF16: return 1e-2;
    case SPARGE_F64: return 1e-12;
    }
    return 0.0;
}

sparge_status sparge_device_open(const char *name, sparge_device **out)
{
    if (!name || !out)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "sparge_device_open: %s is NULL", name ? "out" : "name");
    if (strcmp(name, "auto") == 0) {
        for (int i = 0; i < REGISTRY_LEN; i++)
            if (registry[i]->device_count() > 0)
                return open_on(registry[i], 0, out);
        return SPARGE_FAIL(SPARGE_ERR_NO_DEVICE, "sparge_device_open: no backend has a device");
    }
    const char *colon = strchr(name, ':');
    size_t len = colon ? (size_t)(colon - name) : strlen(name);
    const sparge_backend *be = find_backend(name, len);
    if (!be) {
        char known[256] = "";
        for (int i = 0; i < REGISTRY_LEN; i++) {
            strncat(known, registry[i]->name, sizeof known - strlen(known) - 1);
            strncat(known, i + 1 < REGISTRY_LEN ? ", " : "", sizeof known - strlen(known) - 1);
        }
        return SPARGE_FAIL(SPARGE_ERR_NO_DEVICE,
                           "sparge_device_open: unknown or not compiled-in backend '%.*s' (this build has: %s)",
                           (int)len, name, known);
    }
    int index = 0;
    if (colon) {
        char *end;
        long v = strtol(colon + 1, &end, 10);
        if (!isdigit((unsigned char)colon[1]) || *end || v > 1024) /* digits only: no sign, no space */
            return SPARGE_FAIL(SPARGE_ERR_INVALID, "sparge_device_open: bad device index in '%s'", name);
        index = (int)v;
    }
    return open_on(be, index, out);
}

void sparge_device_release(sparge_device *dev)
{
    if (atomic_fetch_sub(&dev->refs, 1) != 1)
        return;
    if (dev->be->close)
        dev->be->close(dev->impl);
    pthread_mutex_destroy(&dev->lock);
    free(dev);
}

void sparge_device_close(sparge_device *dev)
{
    if (!dev || dev->closed)
        return;
    dev->closed = 1;
    sparge_device_release(dev);
}

const char *sparge_device_name(const sparge_device *dev) { return dev ? dev->name : ""; }
const char *sparge_device_backend(const sparge_device *dev) { return dev ? dev->be->name : ""; }
const char *sparge_device_description(const sparge_device *dev) { return dev ? dev->description : ""; }

#define NEED_DEV(fn)                                                                                                   \
    do {                                                                                                               \
        if (!dev)                                                                                                      \
            return SPARGE_FAIL(SPARGE_ERR_NULL, fn ": device is NULL");                                                 \
    } while (0)

sparge_status sparge_malloc(sparge_device *dev, size_t bytes, void **ptr)
{
    NEED_DEV("sparge_malloc");
    if (!ptr)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "sparge_malloc: ptr is NULL");
    if (bytes == 0)
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "sparge_malloc: 0 bytes requested");
    return dev->be->alloc(dev->impl, bytes, ptr);
}

sparge_status sparge_free(sparge_device *dev, void *ptr)
{
    NEED_DEV("sparge_free");
    return ptr ? dev->be->free(dev->impl, ptr) : SPARGE_OK;
}

static sparge_status copy(sparge_device *dev, void *dst, const void *src, size_t bytes, sparge_copy_kind kind,
                          const char *fn)
{
    if (!dev || !dst || !src)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "%s: %s is NULL", fn, !dev ? "device" : !dst ? "dst" : "src");
    return bytes ? dev->be->copy(dev->impl, dst, src, bytes, kind) : SPARGE_OK;
}

sparge_status sparge_memcpy_to_device(sparge_device *dev, void *dst, const void *src, size_t bytes)
{
    return copy(dev, dst, src, bytes, SPARGE_COPY_H2D, "sparge_memcpy_to_device");
}

sparge_status sparge_memcpy_to_host(sparge_device *dev, void *dst, const void *src, size_t bytes)
{
    return copy(dev, dst, src, bytes, SPARGE_COPY_D2H, "sparge_memcpy_to_host");
}

sparge_status sparge_memset(sparge_device *dev, void *dst, int byte, size_t bytes)
{
    NEED_DEV("sparge_memset");
    if (!dst)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "sparge_memset: dst is NULL");
    return bytes ? dev->be->fill(dev->impl, dst, byte, bytes) : SPARGE_OK;
}

sparge_status sparge_synchronize(sparge_device *dev)
{
    NEED_DEV("sparge_synchronize");
    return dev->be->synchronize ? dev->be->synchronize(dev->impl) : SPARGE_OK;
}

sparge_status sparge_set_stream(sparge_device *dev, void *stream)
{
    NEED_DEV("sparge_set_stream");
    if (!dev->be->set_stream)
        return stream ? SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "sparge_set_stream: backend '%s' has no streams",
                                    dev->be->name)
                      : SPARGE_OK;
    sparge_dev_lock(dev);
    sparge_status s = dev->be->set_stream(dev->impl, stream);
    sparge_dev_unlock(dev);
    return s;
}

static double wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

sparge_status sparge_timer_start(sparge_device *dev)
{
    NEED_DEV("sparge_timer_start");
    sparge_status s;
    sparge_dev_lock(dev);
    if (dev->be->timer_start)
        s = dev->be->timer_start(dev->impl);
    else if (!(s = dev->be->synchronize ? dev->be->synchronize(dev->impl) : SPARGE_OK))
        dev->timer_t0 = wall_ms();
    dev->timer_running = s == SPARGE_OK;
    sparge_dev_unlock(dev);
    return s;
}

sparge_status sparge_timer_stop(sparge_device *dev, double *ms)
{
    NEED_DEV("sparge_timer_stop");
    if (!ms)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "sparge_timer_stop: ms is NULL");
    sparge_status s = SPARGE_OK;
    double t = 0.0;
    sparge_dev_lock(dev);
    if (!dev->timer_running)
        s = SPARGE_FAIL(SPARGE_ERR_INVALID, "sparge_timer_stop: the timer of %s is not running (call "
                        "sparge_timer_start first)", dev->name);
    else if (dev->be->timer_stop)
        s = dev->be->timer_stop(dev->impl, &t);
    else if (!(s = dev->be->synchronize ? dev->be->synchronize(dev->impl) : SPARGE_OK))
        t = wall_ms() - dev->timer_t0;
    if (!s) {
        dev->timer_running = 0;
        *ms = t;
    }
    sparge_dev_unlock(dev);
    return s;
}
