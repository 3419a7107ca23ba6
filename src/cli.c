/* sparge: command line entry point and `sparge info`. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static const char usage[] =
    "usage: sparge <command> [options]\n"
    "\n"
    "commands:\n"
    "  info    build configuration, backends, devices and CPU topology\n"
    "  bench   time pooling, mask prediction, forward and backward (sparge bench --help)\n"
    "  check   quick conformance run of every available backend against cpu-ref\n"
    "\n"
    "Each command takes --help.\n";

const char *cli_opt(int argc, char **argv, int *i, const char *name)
{
    size_t n = strlen(name);
    if (strncmp(argv[*i], name, n) != 0)
        return NULL;
    if (argv[*i][n] == '=')
        return argv[*i] + n + 1;
    if (argv[*i][n] != 0)
        return NULL;
    if (*i + 1 >= argc) {
        fprintf(stderr, "sparge: option %s needs a value\n", name);
        exit(2);
    }
    return argv[++*i];
}

int64_t cli_int(const char *s, const char *name, int64_t min, int64_t max)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end || errno == ERANGE || v < min || v > max) {
        fprintf(stderr, "sparge: %s expects an integer in [%lld, %lld], got '%s'\n", name, (long long)min,
                (long long)max, s);
        exit(2);
    }
    return v;
}

double cli_double(const char *s, const char *name, double min, double max)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || !(v >= min && v <= max)) {
        fprintf(stderr, "sparge: %s expects a number in [%g, %g], got '%s'\n", name, min, max, s);
        exit(2);
    }
    return v;
}

sparge_dtype cli_dtype(const char *s, const char *name)
{
    if (!strcmp(s, "f32") || !strcmp(s, "fp32"))
        return SPARGE_F32;
    if (!strcmp(s, "f16") || !strcmp(s, "fp16"))
        return SPARGE_F16;
    if (!strcmp(s, "bf16"))
        return SPARGE_BF16;
    fprintf(stderr, "sparge: %s expects f32, f16 or bf16, got '%s'\n", name, s);
    exit(2);
}

int cli_fail(const char *what, sparge_status s)
{
    fprintf(stderr, "sparge: %s failed: %s: %s\n", what, sparge_status_name(s), sparge_last_error());
    return 1;
}

/* Which tier of dev runs each op on a representative call (Wan2.1-1.3B-like: bf16 and f32, D 64/96/128). */
static void print_tiers(sparge_device *dev)
{
    static const struct {
        sparge_op op;
        sparge_dtype dtype;
        int64_t D;
    } probes[] = {{SPARGE_OP_MASK_PREDICT, SPARGE_BF16, 128}, {SPARGE_OP_FORWARD, SPARGE_BF16, 128},
                  {SPARGE_OP_FORWARD, SPARGE_BF16, 96},       {SPARGE_OP_FORWARD, SPARGE_F32, 128},
                  {SPARGE_OP_BACKWARD, SPARGE_BF16, 128},     {SPARGE_OP_BACKWARD, SPARGE_F32, 64}};
    printf("    runs on:");
    for (size_t i = 0; i < sizeof probes / sizeof probes[0]; i++) {
        sparge_op_desc d = {.op = probes[i].op, .dtype = probes[i].dtype, .head_dim = probes[i].D, .block_q = 128,
                            .block_k = 64, .B = 1, .H = 12, .Nq = 32760, .Nk = 32760, .rows_aligned = 1};
        const char *tier = NULL;
        printf("%s %s %s D=%lld: %s", i ? "," : "", sparge_op_name(d.op), sparge_dtype_name(d.dtype), (long long)d.head_dim,
               sparge_device_supports(dev, &d, &tier) ? "unsupported" : tier);
    }
    printf("\n");
}

void cli_print_options(sparge_device *dev, const char *label)
{
    printf("%s", label);
    for (int i = 0; i < sparge_device_option_count(dev); i++) {
        const char *name, *value;
        if (!sparge_device_option(dev, i, &name, &value, NULL, NULL, NULL))
            printf(" %s=%s", name, value);
    }
    printf("\n");
}

static int info(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--help")) {
        printf("usage: sparge info\n\nPrints the build configuration, each compiled-in backend with its devices, the "
               "tier that runs each op there and the device's options (sparge_device_set_option; the environment "
               "variables in docs/DESIGN.md set them when a device opens), and the CPU topology (hwloc).\n");
        return 0;
    }
    if (argc > 1) {
        fprintf(stderr, "sparge info: unknown argument '%s' (see sparge info --help)\n", argv[1]);
        return 2;
    }
    fputs(sparge_build_info(), stdout);
    printf("devices:\n");
    int failed = 0;
    for (int b = 0; b < sparge_backend_count(); b++) {
        const char *name = sparge_backend_name(b);
        int n = sparge_backend_device_count(name);
        if (n == 0)
            printf("  %-14s (compiled in, no device present)\n", name);
        for (int i = 0; i < n; i++) {
            char dn[64];
            snprintf(dn, sizeof dn, strncmp(name, "cpu", 3) ? "%s:%d" : "%s", name, i);
            sparge_device *dev;
            sparge_status s = sparge_device_open(dn, &dev);
            if (s) {
                printf("  %-14s error: %s\n", dn, sparge_last_error());
                failed = 1;
                continue;
            }
            printf("  %-14s %s\n", dn, sparge_device_description(dev));
            print_tiers(dev);
            cli_print_options(dev, "    options:");
            sparge_device_close(dev);
        }
    }
    printf("topology:\n%s", sparge_topology_info());
    return failed;
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        fputs(usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "info"))
        return info(argc - 1, argv + 1);
    if (!strcmp(argv[1], "bench"))
        return cli_bench(argc - 1, argv + 1);
    if (!strcmp(argv[1], "check"))
        return cli_check(argc - 1, argv + 1);
    fprintf(stderr, "sparge: unknown command '%s'\n\n%s", argv[1], usage);
    return 2;
}

/* splitmix64 hash: the same stream on every machine and thread count. */
static uint64_t mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

sparge_status cli_fill_random(sparge_device *dev, const sparge_tensor *t, uint64_t seed)
{
    size_t es = sparge_dtype_size(t->dtype), n = sparge_tensor_span_bytes(t) / es, chunk = (size_t)1 << 22;
    unsigned char *host = malloc(chunk * es);
    if (!host)
        return SPARGE_ERR_OUT_OF_MEMORY;
    sparge_status s = SPARGE_OK;
    for (size_t base = 0; base < n && !s; base += chunk) {
        size_t m = n - base < chunk ? n - base : chunk;
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < m; i++) {
            /* uniform on [-√3, √3): unit variance */
            float x = (float)((double)(mix(seed * 0x100000001b3ull + base + i) >> 11) * 0x1.0p-53 * 3.4641016151377544 -
                              1.7320508075688772);
            if (t->dtype == SPARGE_F32)
                ((float *)host)[i] = x;
            else
                ((uint16_t *)host)[i] = t->dtype == SPARGE_F16 ? sparge_f32_to_f16(x) : sparge_f32_to_bf16(x);
        }
        s = sparge_memcpy_to_device(dev, (unsigned char *)t->data + base * es, host, m * es);
    }
    free(host);
    return s;
}
