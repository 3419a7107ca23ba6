/* Runs the fuzz target once on each input, without libFuzzer: `make check` replays the committed corpus
 * through the library as built (OpenMP and every SIMD tier), and a crash file from tests/fuzz/run.sh can be
 * replayed under a debugger. Arguments: files or directories (default: the corpus). */
#define _POSIX_C_SOURCE 200809L /* opendir, stat */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: cannot open %s\n", path);
        return 0;
    }
    uint8_t *buf = NULL;
    size_t len = 0, cap = 0, n;
    do {
        if (len == cap) {
            cap = cap ? 2 * cap : 4096;
            uint8_t *grown = realloc(buf, cap);
            if (!grown)
                abort();
            buf = grown;
        }
        n = fread(buf + len, 1, cap - len, f);
        len += n;
    } while (n > 0);
    fclose(f);
    printf("replay: %s (%zu bytes)\n", path, len);
    fflush(stdout);
    LLVMFuzzerTestOneInput(buf, len);
    free(buf);
    return 1;
}

/* Every regular file of a directory, or the file itself; returns how many ran. */
static int run_path(const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "replay: no such file or directory: %s\n", path);
        return 0;
    }
    if (!S_ISDIR(st.st_mode))
        return run_file(path);
    DIR *d = opendir(path);
    if (!d)
        return 0;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        char child[4096];
        snprintf(child, sizeof child, "%s/%s", path, e->d_name);
        if (e->d_name[0] != '.' && stat(child, &st) == 0 && S_ISREG(st.st_mode))
            n += run_file(child);
    }
    closedir(d);
    return n;
}

int main(int argc, char **argv)
{
    int n = 0;
    if (argc > 1)
        for (int i = 1; i < argc; i++)
            n += run_path(argv[i]);
#ifdef SPARGE_FUZZ_CORPUS
    else
        n = run_path(SPARGE_FUZZ_CORPUS);
#endif
    printf("replay: %d input(s), no violation\n", n);
    return n > 0 ? 0 : 1; /* an empty corpus is a broken setup, not a pass */
}
