/* sparge-train: train the tiny video DiT (README.md beside this file).
 *   sparge-train [CONFIG.cfg] [key=value ...]
 * Arguments apply in order (a config file, then key=value overrides). mode=eval prints one CSV
 * row of held-out metrics of init= (README.md, "Evaluation") instead of training; mode=calibrate
 * prints the Top-p p for target_sparsity; mode=dump writes Q/K/V per layer to dump_dir. */
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
                   "Trains a small video DiT (rectified flow) with sparge attention (mode=train), or with mode=eval\n"
                   "prints one CSV row of held-out metrics of init=, mode=calibrate the Top-p p for target_sparsity,\n"
                   "mode=dump every layer's Q/K/V to dump_dir. Arguments apply in order: a config file of\n"
                   "key = value lines, then key=value overrides. Exit status 2 for a refused argument, 1 for a\n"
                   "failed run. The keys (experiments/trainer/README.md), with the values the arguments before --help\n"
                   "left them at (the defaults when there are none):\n",
                   argv[0]);
            char keys[16384];
            tr_config_string(&cfg, keys, sizeof keys);
            int col = 0;
            for (char *kv = strtok(keys, " "); kv; kv = strtok(NULL, " ")) {
                int len = (int)strlen(kv);
                if (col && col + 1 + len > 100)
                    printf("\n"), col = 0;
                col += printf("%s%s", col ? " " : "  ", kv);
            }
            printf("\n  e.g. %s experiments/trainer/configs/tiny.cfg steps=200 out=teacher.safetensors\n", argv[0]);
            return 0;
        }
        int rc = strchr(argv[i], '=') ? tr_config_set(&cfg, argv[i], err, sizeof err)
                                      : tr_config_load(&cfg, argv[i], err, sizeof err);
        if (rc) {
            fprintf(stderr, "sparge-train: %s\n", err);
            return 2;
        }
    }
    if (tr_config_check(&cfg, err, sizeof err)) {
        fprintf(stderr, "sparge-train: %s\n", err);
        return 2;
    }
    if (cfg.mode == TR_MODE_EVAL && !cfg.init[0]) { /* a refused argument, before any work */
        fprintf(stderr, "sparge-train: mode=eval needs the model to evaluate: init=CKPT\n");
        return 2;
    }
    if (cfg.mode == TR_MODE_CALIBRATE) {
        double p, sparsity;
        if (tr_calibrate(&cfg, &p, &sparsity, err, sizeof err)) {
            fprintf(stderr, "sparge-train: %s\n", err);
            return 1;
        }
        printf("p,sparsity\n%.6f,%.6f\n", p, sparsity);
        return 0;
    }
    if (cfg.mode == TR_MODE_DUMP) {
        if (tr_dump(&cfg, err, sizeof err)) {
            fprintf(stderr, "sparge-train: %s\n", err);
            return 1;
        }
        return 0;
    }
    if (cfg.mode == TR_MODE_EVAL) {
        tr_eval_result r;
        if (tr_evaluate(&cfg, &r, err, sizeof err)) {
            fprintf(stderr, "sparge-train: %s\n", err);
            return 1;
        }
        printf("velocity_mse,velocity_rel_l2,diffusion_loss,sparsity,attention_rel_l1,"
               "sample_sharpness,sample_temporal_change,sample_temporal_jitter,sample_mean_c0,"
               "ref_sharpness,ref_temporal_change,ref_temporal_jitter,ref_mean_c0,"
               "class_accuracy,ref_class_accuracy,frechet,frechet_floor,imaging_quality,ref_imaging_quality,"
               "temporal_consistency,ref_temporal_consistency,attention_entropy,attention_top5_mass\n");
        printf("%.6g,%.6g,%.6g,%.4f,%.5f,%.5f,%.5f,%.5f,%.5f,%.5f,%.5f,%.5f,%.5f,", r.velocity_mse, r.velocity_rel_l2,
               r.diffusion_loss, r.sparsity, r.attention_rel_l1, r.sample.sharpness, r.sample.temporal_change,
               r.sample.temporal_jitter, r.sample.mean_c0, r.reference.sharpness, r.reference.temporal_change,
               r.reference.temporal_jitter, r.reference.mean_c0);
        printf("%.4f,%.4f,%.5g,%.5g,%.4f,%.4f,%.4f,%.4f,%.6f,%.6f\n", r.class_accuracy, r.reference_class_accuracy,
               r.frechet, r.frechet_floor, r.imaging_quality, r.reference_imaging_quality, r.temporal_consistency,
               r.reference_temporal_consistency, r.attention_entropy, r.attention_top5_mass);
        return 0;
    }
    if (tr_train(&cfg, err, sizeof err)) {
        fprintf(stderr, "sparge-train: %s\n", err);
        return 1;
    }
    return 0;
}
