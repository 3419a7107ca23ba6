# Table 6 (training): velocity error to the teacher and Fréchet distance per arm, mean ± std over seeds.
# dat: "arm" velocity_rel_l2_mean std frechet_mean std (one line per arm, written by train.sh)
set terminal term size 1300,480 font ",10"
set output out
set multiplot layout 1,2 title "Sparse fine-tuning at matched sparsity (mean ± std over seeds; lower is better)"
set style fill solid 0.6 border -1
set boxwidth 0.6
set grid ytics
set xtics rotate by -25 left
set yrange [0:*]
set offsets 0.6, 0.6, 0, 0
set bmargin 7
set title "velocity rel. L2 to the full-attention teacher (held-out A)"
plot dat using 0:2:3:xtic(1) with boxerrorbars lc rgb "#1f77b4" notitle
set title "Fréchet distance of Euler samples to real A videos (informative? table6.md, sanity)"
plot dat using 0:4:5:xtic(1) with boxerrorbars lc rgb "#d62728" notitle
unset multiplot
