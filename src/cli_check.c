/* sparge check: the conformance harness (check.h) on the devices of this machine. */
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "cli.h"

static const char help[] =
    "usage: sparge check [--backend NAME] [--full] [--mode test|grad|perf] [--case TEXT] [--reps N]\n"
    "\n"
    "Runs the conformance table on every device of this machine (every compiled-in backend's devices but cpu-ref,\n"
    "the fp64 reference), or on those of one backend (--backend cuda) or one device (--backend cuda:1). Each\n"
    "case has fresh seeded random inputs, a shape, dtype, layout, mask and, for some, device options (a device\n"
    "without one of them skips the case). One line per case and device: PASS, FAIL, unsupported (a clean\n"
    "refusal: SPARGE_ERR_UNSUPPORTED, a message, nothing written) or skipped, the tier that ran it, and the\n"
    "errors measured.\n"
    "\n"
    "  --full         the whole table (default: its quick grid, a few ragged shapes in every dtype and layout and\n"
    "                 small cases of grouped K/V heads, causal masks and packed varlen sequences)\n"
    "  --mode test    compare against cpu-ref: pooling, pooled map, mask prediction and selection (exact but for\n"
    "                 rows within rounding of the cut, docs/DESIGN.md 2.2), forward O and LSE, backward dQ, dK, dV\n"
    "                 within sparge_dtype_tolerance (default)\n"
    "  --mode grad    each device's gradients against finite differences of the fp64 forward (small cases)\n"
    "  --mode perf    the median time of each op and the effective TFLOP/s\n"
    "  --case TEXT    only the cases whose name contains TEXT\n"
    "  --reps N       perf: timed runs per op (default 5)\n"
    "\n"
    "Exit status: 0 when nothing failed, 1 on any failure (or when the named backend has no device here),\n"
    "2 on bad usage (an unknown option or backend, or no case matching --case).\n";

int cli_check(int argc, char **argv)
{
    check_config cfg = {.mode = CHECK_MODE_TEST};
    const char *v;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(help, stdout);
            return 0;
        }
        if (!strcmp(argv[i], "--full"))
            cfg.full = 1;
        else if ((v = cli_opt(argc, argv, &i, "--backend")))
            cfg.backend = v;
        else if ((v = cli_opt(argc, argv, &i, "--case")))
            cfg.filter = v;
        else if ((v = cli_opt(argc, argv, &i, "--reps"))) {
            const int64_t n = cli_int(v, "--reps", 1, 100000);
            cfg.reps = (int)n;
        } else if ((v = cli_opt(argc, argv, &i, "--mode"))) {
            if (!strcmp(v, "test"))
                cfg.mode = CHECK_MODE_TEST;
            else if (!strcmp(v, "grad"))
                cfg.mode = CHECK_MODE_GRAD;
            else if (!strcmp(v, "perf"))
                cfg.mode = CHECK_MODE_PERF;
            else {
                fprintf(stderr, "sparge check: --mode must be test, grad or perf, got '%s'\n", v);
                return 2;
            }
        } else {
            fprintf(stderr, "sparge check: unknown option '%s' (see sparge check --help)\n", argv[i]);
            return 2;
        }
    }
    return check_run(&cfg, NULL);
}
