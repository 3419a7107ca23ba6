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
int64_t cli_int(const char *s, const char *name);
double cli_double(const char *s, const char *name);
sparge_dtype cli_dtype(const char *s);
/* Print a failed call's status and message to stderr; returns 1. */
int cli_fail(const char *what, sparge_status s);

/* Seeded unit-variance values rounded to the dtype, written to a device tensor. */
sparge_status cli_fill_random(sparge_device *dev, const sparge_tensor *t, uint64_t seed);

#endif
