/* Tests of the command-line tool: `sparge bench` options, its table and its CSV; `sparge check`'s usage errors. */
#define _POSIX_C_SOURCE 200809L /* mkstemp */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#define BENCH SPARGE_CLI " bench --backend cpu-ref --H 1 --N 300 --Nk 200 --D 16 --dtype f32 --reps 2 --warmup 1"

static int run(const char *command)
{
    int status = system(command);
    assert_true(status != -1 && WIFEXITED(status));
    return WEXITSTATUS(status);
}

/* Both timing modes time every column; fwd+mask is a timing of its own for masked levels, and so is the step
 * (prediction, forward and backward as one operation; no prediction on the dense level). */
static void test_bench_csv(void **state)
{
    (void)state;
    const char *modes[2] = {"queued", "each"};
    for (int m = 0; m < 2; m++) {
        char csv[] = "/tmp/sparge-test-cli-XXXXXX", command[512], line[1024];
        int fd = mkstemp(csv);
        assert_true(fd >= 0);
        close(fd);
        snprintf(command, sizeof command, BENCH " --sparsity dense,0.5 --timing %s --output %s >/dev/null", modes[m],
                 csv);
        assert_int_equal(run(command), 0);
        FILE *f = fopen(csv, "r");
        assert_non_null(f);
        assert_non_null(fgets(line, sizeof line, f));
        assert_non_null(strstr(line, ",level,sparsity,token_density,mask_ms,fwd_ms,fwd_mask_ms,bwd_ms,"));
        assert_non_null(strstr(line, ",fwd_tflops,bwd_tflops,step_ms\n"));
        for (int row = 0; row < 2; row++) {
            assert_non_null(fgets(line, sizeof line, f));
            const char *level = strstr(line, row ? ",0.5," : ",dense,");
            assert_non_null(level);
            double v[5];
            char *cursor = strchr((char *)level + 1, ',') + 1; /* sparsity */
            for (int i = 0; i < 5; i++, cursor++) /* sparsity, density, mask, fwd, fwd+mask */
                v[i] = strtod(cursor, &cursor);
            double bwd = strtod(cursor, NULL);
            const double step = strtod(strrchr(line, ',') + 1, NULL);
            print_message("--timing %s, level %s: sparsity %.3f mask %.4g fwd %.4g fwd+mask %.4g bwd %.4g step %.4g ms\n",
                          modes[m], row ? "0.5" : "dense", v[0], v[2], v[3], v[4], bwd, step);
            assert_true(v[3] > 0 && v[4] > 0 && bwd > 0 && step > 0);
            if (row) {
                assert_true(v[0] > 0.3 && v[0] < 0.7 && v[2] > 0);
            } else {
                assert_true(v[0] == 0 && isnan(v[2]));
                assert_true(v[4] == v[3]); /* dense: no prediction */
            }
        }
        fclose(f);
        unlink(csv);
    }
}

/* The rows of --output state the run's grouped heads, causal flag and packed sequences: the attendable pairs and
 * so the TFLOP/s depend on them. */
static void test_bench_output_layout(void **state)
{
    (void)state;
    static const char *const ext[2] = {"csv", "json"};
    static const char *const want[2][2] = {{",kv_heads,causal,varlen,level,", ",1,1,\"100,200\",0.5,"},
                                           {"\"kv_heads\": 1, \"causal\": true, \"varlen\": [100,200], \"level\": \"0.5\""}};
    for (int e = 0; e < 2; e++) {
        char out[64], command[512], text[4096] = {0};
        snprintf(out, sizeof out, "/tmp/sparge-test-cli-%d.%s", (int)getpid(), ext[e]);
        snprintf(command, sizeof command,
                 SPARGE_CLI " bench --backend cpu-ref --H 2 --kv-heads 1 --N 300 --D 16 --causal --varlen 100,200 "
                            "--reps 1 --warmup 0 --sparsity 0.5 --output %s >/dev/null",
                 out);
        assert_int_equal(run(command), 0);
        FILE *f = fopen(out, "r");
        assert_non_null(f);
        assert_true(fread(text, 1, sizeof text - 1, f) > 0);
        fclose(f);
        unlink(out);
        for (int i = 0; i < 2 && want[e][i]; i++)
            if (!strstr(text, want[e][i]))
                fail_msg("--output %s lacks %s:\n%s", ext[e], want[e][i], text);
    }
}

/* --settle idles before each timed operation (here the dense and the 50 % forward: two) and says so. */
static void test_bench_settle(void **state)
{
    (void)state;
    char out[] = "/tmp/sparge-test-cli-XXXXXX", command[512], line[512];
    int fd = mkstemp(out);
    assert_true(fd >= 0);
    close(fd);
    snprintf(command, sizeof command, BENCH " --sparsity dense,0.5 --ops fwd --settle 0.3 > %s", out);
    struct timespec t0, t1;
    assert_int_equal(timespec_get(&t0, TIME_UTC), TIME_UTC);
    assert_int_equal(run(command), 0);
    assert_int_equal(timespec_get(&t1, TIME_UTC), TIME_UTC);
    const double wall = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    print_message("--settle 0.3 with two timed operations: %.2f s\n", wall);
    assert_true(wall >= 0.6);
    FILE *f = fopen(out, "r");
    assert_non_null(f);
    int said = 0;
    while (fgets(line, sizeof line, f))
        said |= strstr(line, "each after 0.3 s idle") != NULL;
    fclose(f);
    unlink(out);
    assert_true(said);
}

static void test_bench_rejects_bad_options(void **state)
{
    (void)state;
    assert_int_equal(run(BENCH " --timing sometimes 2>/dev/null"), 2);
    assert_int_equal(run(BENCH " --reps 0 2>/dev/null"), 2);
    assert_int_equal(run(BENCH " --layout nhbd 2>/dev/null"), 2);
    assert_int_equal(run(BENCH " --no-such-option 2>/dev/null"), 2);
    assert_int_equal(run(BENCH " --settle -1 2>/dev/null"), 2);
    assert_int_equal(run(BENCH " --settle soon 2>/dev/null"), 2);
}

/* sparge check: unknown options, modes, backends and case names are usage errors; one quick case passes. */
static void test_check_usage(void **state)
{
    (void)state;
    assert_int_equal(run(SPARGE_CLI " check --backend foo >/dev/null 2>&1"), 2);
    assert_int_equal(run(SPARGE_CLI " check --backend cpu-ref >/dev/null 2>&1"), 2);
    assert_int_equal(run(SPARGE_CLI " check --no-such-option >/dev/null 2>&1"), 2);
    assert_int_equal(run(SPARGE_CLI " check --mode sometimes >/dev/null 2>&1"), 2);
    assert_int_equal(run(SPARGE_CLI " check --reps 0 >/dev/null 2>&1"), 2);
    assert_int_equal(run(SPARGE_CLI " check --case no-such-case >/dev/null 2>&1"), 2);
    assert_int_equal(run(SPARGE_CLI " check --backend cpu --case ragged/f32/bhnd >/dev/null"), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bench_csv),
        cmocka_unit_test(test_bench_output_layout),
        cmocka_unit_test(test_bench_settle),
        cmocka_unit_test(test_bench_rejects_bad_options),
        cmocka_unit_test(test_check_usage),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
