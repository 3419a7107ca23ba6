# Table 1 analogue: relative L1 at equal sparsity, ours beside the paper's.
# dat: "input rule ours paper" rows (paper = NaN where the paper has none).
set terminal term size 1100,500 font ",10"
set output out
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set boxwidth 0.9
set grid ytics
set ylabel "relative L1 of the attention output"
set title "Equal sparsity (Top-k k = 0.05 arm; Top-p and hybrid p calibrated to the same kept-block count)"
set key top left
set yrange [0:*]
set bmargin 5
plot dat using 3:xticlabels(sprintf("%s\n%s", strcol(1), strcol(2))) title "ours" lc rgb "#1f77b4", \
     '' using 4 title "paper (Table 1)" lc rgb "#bbbbbb"
