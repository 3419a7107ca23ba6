/* The `sparge` command line tool: info, bench, check. */
#ifndef SPARGE_CLI_H
#define SPARGE_CLI_H

#include <stdint.h>

#include "sparge.h"

int cli_bench(int argc, char **argv);
int cli_check(int argc, char **argv);

/* Option parsing: "--name value" or "--name=value". Returns the value for
 * --name at argv[*i] (advancing *i), or NULL if argv[*i] is another option. */
const char *cli_opt(int argc, char **argv, int *i, const char *name);
/* The value of flag `name` parsed and range-checked; on a bad value a message naming the flag and exit(2). */
int64_t cli_int(const char *s, const char *name, int64_t min, int64_t max);
double cli_double(const char *s, const char *name, double min, double max);
sparge_dtype cli_dtype(const char *s, const char *name);
/* Print a failed call's status and message to stderr; returns 1. */
int cli_fail(const char *what, sparge_status s);

/* `label`, then the device's options in force as " name=value", then a newline. */
void cli_print_options(sparge_device *dev, const char *label);

/* Seeded unit-variance values rounded to the dtype, written to a device tensor. */
sparge_status cli_fill_random(sparge_device *dev, const sparge_tensor *t, uint64_t seed);

#endif
