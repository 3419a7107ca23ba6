#!/bin/sh
# Counts the bad-input cases of the test suite by category, for docs/RELIABILITY.md: prints a Markdown table.
#
# An API case is one assertion that a call fails with a given status: an EXPECT_FAIL(SPARGE_ERR_...) or
# EXPECT(SPARGE_ERR_...) line, or an assertion line ending in "SPARGE_ERR_...);" (tests/*.c). It is filed by its
# status, except that a case whose line or test function mentions alias/overlap is aliasing and one whose line or
# function mentions align is misalignment. Threads: the
# CMocka tests of tests/test_threads.c. CLI: the `bad` lines of tests/cli_errors.sh and the exit-status-2
# assertions of tests/test_cli.c. Fuzzing: the committed corpus, and the refusals the fuzz decoder expects
# (BIT(SPARGE_ERR_...) in tests/fuzz/fuzz_mask.c).
cd "$(dirname "$0")" || exit 1
# One line per case: its test function's name, then the line.
api=$(awk '/^static void test_[a-z0-9_]*\(/ { fn = $3 }
           /EXPECT(_FAIL)?\(SPARGE_ERR_[A-Z_]+|SPARGE_ERR_[A-Z_]+\);/ { print fn, $0 }' ./*.c)
count() { printf '%s\n' "$api" | grep -c -i -E "$1"; }
count_plain() { printf '%s\n' "$api" | grep -v -i -E 'alias|overlap|align' | grep -c -E "$1"; }

printf '| category | status | cases |\n|---|---|---|\n'
printf '| NULL pointers | SPARGE_ERR_NULL | %d |\n' "$(count_plain 'SPARGE_ERR_NULL')"
printf '| invalid values (ranges, NaN, zero sizes, negative strides, names) | SPARGE_ERR_INVALID | %d |\n' \
    "$(count_plain 'SPARGE_ERR_INVALID')"
printf '| shapes that disagree | SPARGE_ERR_SHAPE | %d |\n' "$(count_plain 'SPARGE_ERR_SHAPE')"
printf '| dtypes that disagree or are unknown | SPARGE_ERR_DTYPE | %d |\n' "$(count_plain 'SPARGE_ERR_DTYPE')"
printf '| size overflow | SPARGE_ERR_OVERFLOW | %d |\n' "$(count_plain 'SPARGE_ERR_OVERFLOW')"
printf '| aliasing (outputs overlapping themselves or inputs) | any | %d |\n' "$(count 'alias|overlap')"
printf '| misalignment | any | %d |\n' "$(printf '%s\n' "$api" | grep -v -i -E 'alias|overlap' | grep -c -i 'align')"
printf '| handles and lifetimes: masks (empty, other device, other shape) | SPARGE_ERR_MASK | %d |\n' \
    "$(count_plain 'SPARGE_ERR_MASK')"
printf '| handles: devices that do not exist | SPARGE_ERR_NO_DEVICE | %d |\n' "$(count_plain 'SPARGE_ERR_NO_DEVICE')"
printf '| beyond a tier'"'"'s limits | SPARGE_ERR_UNSUPPORTED | %d |\n' "$(count_plain 'SPARGE_ERR_UNSUPPORTED')"
printf '| threads (tests of test_threads.c, each on every device present) | - | %d |\n' \
    "$(grep -c 'cmocka_unit_test(' test_threads.c)"
printf '| command line: bad invocations (cli_errors.sh, test_cli.c) | exit 1 or 2 | %d |\n' \
    "$(( $(grep -c '^bad ' cli_errors.sh) + $(grep -c 'run(.*), 2);' test_cli.c) ))"
printf '| command line: valid invocations (cli_errors.sh) | exit 0 | %d |\n' "$(grep -c '^good ' cli_errors.sh)"
printf '| fuzzing: committed seed inputs (fuzz/corpus) | - | %d |\n' "$(find fuzz/corpus -type f | wc -l)"
printf '| fuzzing: refusals the decoder produces and expects | any | %d |\n' \
    "$(grep -o 'BIT(SPARGE_ERR_[A-Z_]*)' fuzz/fuzz_mask.c | wc -l)"
