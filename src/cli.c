/* sparge: command line entry point and `sparge info`. */
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

int64_t cli_int(const char *s, const char *name)
{
    char *end;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end) {
        fprintf(stderr, "sparge: %s expects an integer, got '%s'\n", name, s);
        exit(2);
    }
    return v;
}

double cli_double(const char *s, const char *name)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end) {
        fprintf(stderr, "sparge: %s expects a number, got '%s'\n", name, s);
        exit(2);
    }
    return v;
}

sparge_dtype cli_dtype(const char *s)
{
    if (!strcmp(s, "f32") || !strcmp(s, "fp32"))
        return SPARGE_F32;
    if (!strcmp(s, "f16") || !strcmp(s, "fp16"))
        return SPARGE_F16;
    if (!strcmp(s, "bf16"))
        return SPARGE_BF16;
    fprintf(stderr, "sparge: unknown dtype '%s' (use f32, f16 or bf16)\n", s);
    exit(2);
}

int cli_fail(const char *what, sparge_status s)
{
    fprintf(stderr, "sparge: %s failed: %s: %s\n", what, sparge_status_name(s), sparge_last_error());
    return 1;
}

static int info(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--help")) {
        printf("usage: sparge info\n\nPrints the build configuration, each compiled-in backend with its devices, and "
               "the CPU topology (hwloc).\n");
        return 0;
    }
    fputs(sparge_build_info(), stdout);
    printf("devices:\n");
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
                continue;
            }
            printf("  %-14s %s\n", dn, sparge_device_description(dev));
            sparge_device_close(dev);
        }
    }
    printf("topology:\n%s", sparge_topology_info());
    return 0;
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
