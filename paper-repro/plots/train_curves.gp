# Training curves: loss per step (moving mean over `window` steps) of the teacher and of the seed-1 runs.
# logs: folder of sparge-train CSV logs (step,loss,grad_norm,lr,sparsity,step_ms,attention_ms,samples_per_s)
set terminal term size 1300,480 font ",10"
set output out
set datafile separator ","
smooth(f) = sprintf("< awk -F, -v w=%d 'NR > 1 { s += $2; q[NR] = $2; if (NR > w + 1) s -= q[NR - w]; " . \
                    "if (NR > w) print $1 \",\" s / w }' '%s/%s.csv'", window, logs, f)
set multiplot layout 1,2
set grid
set logscale y
set format y "%g"
set xlabel "step"
set title "teacher: diffusion loss on A"
plot smooth("teacher") using 1:2 with lines lw 2 lc rgb "#444444" title "teacher"
set title "fine-tuning, seed 1 (L_VD arms: distance to the teacher; diffusion arms: flow loss)"
# runs: names of the seed-1 logs present (t6_*: Table 6 arms, t3_full_B/A: Table 3 arms)
plot for [i = 1:words(runs)] smooth(word(runs, i)) using 1:2 with lines lw 2 title word(runs, i) noenhanced
unset multiplot
