/* sparge-train: train the tiny video DiT of issue 8 (README.md beside this file).
 *   sparge-train [CONFIG.cfg] [key=value ...]
 * The config file is read first, then each key=value overrides it. */
#include <stdio.h>
#include <string.h>

#include "trainer.h"

int main(int argc, char **argv)
{
    tr_config cfg;
    char err[1024];
    tr_config_defaults(&cfg);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: %s [CONFIG.cfg] [key=value ...]\n"
                   "Trains a small video DiT (rectified flow) with sparge attention; keys in README.md.\n"
                   "  e.g. %s experiments/trainer/configs/tiny.cfg steps=200 out=teacher.safetensors\n",
                   argv[0], argv[0]);
            return 0;
        }
        int rc = strchr(argv[i], '=') ? tr_config_set(&cfg, argv[i], err, sizeof err)
                                      : tr_config_load(&cfg, argv[i], err, sizeof err);
        if (rc) {
            fprintf(stderr, "sparge-train: %s\n", err);
            return 2;
        }
    }
    if (tr_train(&cfg, err, sizeof err)) {
        fprintf(stderr, "sparge-train: %s\n", err);
        return 1;
    }
    return 0;
}
