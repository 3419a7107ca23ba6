# Mask-rule ablation: rel. L1 against achieved sparsity, three rules at equal
# sparsity (lines) and the paper's arms (large symbols), per input family.
# csv: family,kind,rule,k,p,kept_blocks,sparsity,token_density,mean_row_mass,rel_l1,rel_l2
set terminal term size 1500,480 font ",10"
set output out
# families: the inputs' names in the CSV's first column (run.sh passes those present)
if (!exists("families")) families = "uniform+hubs sink video"
nf = words(families)
set datafile separator ","
set multiplot layout 1,nf title "Output error vs. sparsity (lines: equal-sparsity sweep; " . \
    "symbols: paper arms Top-k 0.05, Top-p 0.4, hybrid 0.03/0.2)"
rules = "Top-k Top-p hybrid"
colors = "#1f77b4 #d62728 #2ca02c"
# rows of one (family, kind, rule), so that lines join only that series' points
sel(fam, kind, rule) = sprintf("< awk -F, -v f=%s -v k=%s -v r=%s '$1 == f && $2 == k && $3 == r' '%s'", \
                               fam, kind, rule, csv)
set grid
set logscale y
set format y "%g"
set xlabel "sparsity (%)"
set ylabel "rel. L1 of the output"
set key bottom right
do for [f = 1:nf] {
  fam = word(families, f)
  set title fam
  plot for [r = 1:3] sel(fam, "sweep", word(rules, r)) using (100*$7):10 \
        with linespoints pt 7 ps 0.6 lc rgb word(colors, r) title word(rules, r), \
       for [r = 1:3] sel(fam, "paper-arm", word(rules, r)) using (100*$7):10 \
        with points pt 13 ps 2 lc rgb word(colors, r) notitle
}
unset multiplot
