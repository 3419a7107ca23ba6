# The training tables' arms, the paper's claims and how each is tested (sourced by train.sh and gpu_train.sh).
# Every verdict comes from experiments/exp_stats: Welch's t-test over the runs of two arms (seeds, and teachers
# where there are several), or a one-sample test where an arm has one run; sample metrics that fail the sanity
# check on the teacher (against an untrained model's noise samples and the real videos) get no verdict.
# shellcheck shell=bash

ARM_TEACHER_T3="teacher (no fine-tuning)"
ARM_FULL_B="full attention + diffusion loss on B"
ARM_FULL_A="full attention + diffusion loss on A (control)"
ARM_TEACHER_T6="full attention (teacher)"
ARM_FREE="hybrid training-free"
ARM_HYB_VD="hybrid + L_VD"
ARM_TOPK_VD="Top-k only + L_VD"
ARM_TOPP_VD="Top-p only + L_VD"
ARM_HYB_DIFF="hybrid + diffusion loss"
ARM_NULL="null model (untrained: its samples are noise)"
ARM_T2_BEFORE="before: teacher (dense training)"
ARM_T2_HYB="after: hybrid + L_VD fine-tuning on B"
ARM_T2_DENSE="after: dense fine-tuning on B (control)"
T2_P=0.6         # Table 2: the paper's Top-p
T2_PS="0.3 0.6 0.9" # and the p values Table 2 is taken at here
# t2_arm ARM P: a Table 2 arm's label at p = P (the paper's p keeps the plain label)
t2_arm() { if [ "$2" = "$T2_P" ]; then echo "$1"; else echo "$1 (p = $2)"; fi; }

SAMPLE_METRICS="frechet class_accuracy imaging_quality temporal_consistency"
SANITY=(--sanity frechet:frechet_floor:log --sanity class_accuracy:ref_class_accuracy
        --sanity imaging_quality:ref_imaging_quality --sanity temporal_consistency:ref_temporal_consistency)

# The paper's statements, written at the top of each table's Markdown.
PAPER_T3="Paper (Table 3, Wan2.1-1.3B, VBench): fine-tuning *full* attention with the diffusion loss on data unlike the
pretraining data lowers the pretrained model's generation quality. Our metrics are not VBench's and this repository
holds no transcription of the paper's Table 3 values, so the comparison is by direction only.
Here: the teacher trained on A, fine-tuned on B (blurred, noisy, colour-shifted, jerky), evaluated against A; the
control arm (not in the paper) fine-tunes on A itself."
PAPER_T6="Paper (Table 6, Wan2.1-1.3B at ≈ 95 % sparsity, VBench): the hybrid mask beats Top-k only and Top-p only,
training-free sparse attention collapses, velocity distillation (L_VD against the frozen full-attention teacher) beats
the diffusion loss, and the model fine-tuned with the hybrid mask and L_VD matches full attention (the paper's
headline: 95 % sparsity without loss of quality). Our metrics are not VBench's and this repository holds no
transcription of the paper's Table 6 values, so the comparison is by direction (and, for the headline, by a margin)."
PAPER_T2="Paper (Table 2, Top-p at p = 0.6): sparse fine-tuning concentrates attention — sparsity 51.3 % → 56.9 %,
attention rel. L1 0.4901 → 0.4119 (before → after). The paper reports no entropy; here the concentration is also
measured directly on the model's exact attention (token-level entropy and the mass of a row's top 5 % of keys)."

# stats_table CSV TABLE MD ARGS...: append exp_stats' sections for TABLE of CSV to MD.
stats_table() {
    local csv=$1 table=$2 md=$3
    shift 3
    "$expdir/exp_stats" --quiet --in "$csv" --table "$table" "$@" >>"$md"
}

stats_table3() { # CSV MD
    stats_table "$1" table3 "$2" --reference "$ARM_TEACHER_T3" --null "$ARM_NULL" "${SANITY[@]}" \
        --metrics diffusion_loss,velocity_rel_l2,frechet,class_accuracy,imaging_quality,temporal_consistency \
        --claim "diffusion_loss|$ARM_FULL_B|>|$ARM_TEACHER_T3|mismatched fine-tuning hurts (held-out loss)" \
        --claim "frechet|$ARM_FULL_B|>|$ARM_TEACHER_T3|mismatched fine-tuning hurts (Fréchet)" \
        --claim "imaging_quality|$ARM_FULL_B|<|$ARM_TEACHER_T3|mismatched fine-tuning hurts (imaging quality)" \
        --claim "class_accuracy|$ARM_FULL_B|<|$ARM_TEACHER_T3|mismatched fine-tuning hurts (class accuracy)" \
        --claim "temporal_consistency|$ARM_FULL_B|<|$ARM_TEACHER_T3|mismatched fine-tuning hurts (temporal consistency)" \
        --claim "diffusion_loss|$ARM_FULL_A|<|$ARM_TEACHER_T3|control: fine-tuning on A helps (held-out loss)" \
        --claim "imaging_quality|$ARM_FULL_A|>|$ARM_TEACHER_T3|control: fine-tuning on A helps (imaging quality)" \
        --claim "diffusion_loss|$ARM_FULL_B|>|$ARM_FULL_A|B fine-tuning worse than the control (held-out loss)"
}

stats_table6() { # CSV MD
    stats_table "$1" table6 "$2" --reference "$ARM_TEACHER_T6" --null "$ARM_NULL" "${SANITY[@]}" \
        --metrics sparsity,velocity_rel_l2,diffusion_loss,attention_rel_l1,frechet,class_accuracy,imaging_quality,temporal_consistency \
        --claim "velocity_rel_l2|$ARM_HYB_VD|<|$ARM_TOPK_VD|hybrid beats Top-k only" \
        --claim "velocity_rel_l2|$ARM_HYB_VD|<|$ARM_TOPP_VD|hybrid beats Top-p only" \
        --claim "diffusion_loss|$ARM_HYB_VD|<|$ARM_TOPK_VD|hybrid beats Top-k only (held-out loss)" \
        --claim "diffusion_loss|$ARM_HYB_VD|<|$ARM_TOPP_VD|hybrid beats Top-p only (held-out loss)" \
        --claim "frechet|$ARM_HYB_VD|<|$ARM_TOPK_VD|hybrid beats Top-k only (Fréchet)" \
        --claim "frechet|$ARM_HYB_VD|<|$ARM_TOPP_VD|hybrid beats Top-p only (Fréchet)" \
        --claim "velocity_rel_l2|$ARM_HYB_VD|<|$ARM_HYB_DIFF|L_VD beats the diffusion loss" \
        --claim "diffusion_loss|$ARM_HYB_VD|<|$ARM_HYB_DIFF|L_VD beats the diffusion loss (held-out loss)" \
        --claim "frechet|$ARM_HYB_VD|<|$ARM_HYB_DIFF|L_VD beats the diffusion loss (Fréchet)" \
        --claim "velocity_rel_l2|$ARM_HYB_VD|<|$ARM_FREE|fine-tuning recovers from the training-free collapse" \
        --claim "diffusion_loss|$ARM_FREE|>|$ARM_TEACHER_T6|training-free sparse attention collapses (held-out loss)" \
        --claim "diffusion_loss|$ARM_HYB_VD|~5%|$ARM_TEACHER_T6|headline: the trained sparse model matches full attention (held-out loss within 5 %)" \
        --claim "sparsity|$ARM_HYB_VD|>|$ARM_FREE|fine-tuning raises the sparsity at the training rule"
}

stats_table2() { # CSV MD: the claims at every p of T2_PS whose rows the CSV has
    local p claims=()
    for p in $T2_PS; do
        grep -qF ",$(t2_arm "$ARM_T2_BEFORE" "$p")," "$1" || continue
        local before after dense
        before=$(t2_arm "$ARM_T2_BEFORE" "$p") after=$(t2_arm "$ARM_T2_HYB" "$p") dense=$(t2_arm "$ARM_T2_DENSE" "$p")
        claims+=(--claim "sparsity|$after|>|$before|p = $p: sparse fine-tuning raises Top-p's sparsity$([ "$p" != "$T2_P" ] ||
                    echo " (paper 51.3 → 56.9 %)")"
                 --claim "attention_rel_l1|$after|<|$before|p = $p: sparse fine-tuning lowers its attention error$([ "$p" != "$T2_P" ] ||
                    echo " (paper 0.4901 → 0.4119)")"
                 --claim "sparsity|$after|>|$dense|p = $p: more than dense fine-tuning on the same data (sparsity)"
                 --claim "attention_rel_l1|$after|<|$dense|p = $p: more than dense fine-tuning on the same data (attention error)")
    done
    # the attention's concentration is the model's, the same at every p: tested on the paper's p rows
    claims+=(--claim "attention_entropy|$ARM_T2_HYB|<|$ARM_T2_BEFORE|sparse fine-tuning concentrates attention (token-level entropy)"
             --claim "attention_top5_mass|$ARM_T2_HYB|>|$ARM_T2_BEFORE|sparse fine-tuning concentrates attention (top-5 % mass)"
             --claim "attention_entropy|$ARM_T2_HYB|<|$ARM_T2_DENSE|more than dense fine-tuning on the same data (entropy)")
    stats_table "$1" table2 "$2" --metrics sparsity,attention_rel_l1,velocity_rel_l2,attention_entropy,attention_top5_mass \
        "${claims[@]}"
}
