# Table 1 analogue: relative L1 at equal sparsity, ours beside the paper's (left), and the same
# numbers divided by each input's Top-k value (right: free of the value model's scale).
# dat: "input rule ours paper ours/Top-k paper/Top-k" rows (NaN where the paper has no number).
set terminal term size 1500,520 font ",10"
set output out
set multiplot layout 1,2 title "Equal sparsity: Top-k k = 0.05 arm; " . \
    "Top-p and hybrid p calibrated to the same kept-block count"
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set boxwidth 0.9
set grid ytics
set key top left
set yrange [0:*]
set bmargin 5
set title "relative L1 of the attention output"
plot dat using 3:xticlabels(sprintf("%s\n%s", strcol(1), strcol(2))) title "ours" lc rgb "#1f77b4", \
     '' using 4 title "paper (Table 1)" lc rgb "#bbbbbb"
set title "divided by the same input's Top-k error"
plot dat using 5:xticlabels(sprintf("%s\n%s", strcol(1), strcol(2))) title "ours" lc rgb "#1f77b4", \
     '' using 6 title "paper (Table 1)" lc rgb "#bbbbbb", 1 with lines dt 2 lc rgb "black" notitle
unset multiplot
