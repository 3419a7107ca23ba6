# Fig. 1 analogue: per query-block row, kept pooled mass (x) against the row's
# relative L1 output error (y), for Top-k, Top-p and hybrid; top row at the
# paper's arms, bottom row at equal sparsity. Variables: csv, out, term.
set terminal term size 1500,900 font ",10"
set output out
# families: the inputs' names in the CSV's first column (run.sh passes those present)
if (!exists("families")) families = "uniform+hubs sink video"
nf = words(families)
set datafile separator ","
set multiplot layout 2,nf title "Per-row kept pooled mass vs. output error (each point: one query-block row)"
set logscale y
set format y "%g"
set xrange [0:1]
set grid
set key bottom left
settings = "paper-arms equal-sparsity"
rules = "Top-k Top-p hybrid"
colors = "#1f77b4 #d62728 #2ca02c"
pts = "7 5 9"
do for [s = 1:2] {
  do for [f = 1:nf] {
    fam = word(families, f)
    set title sprintf("%s — %s", fam, word(settings, s))
    set xlabel "kept pooled mass of the row"
    set ylabel "row rel. L1 error"
    plot for [r = 1:3] csv every ::1 using \
        ((strcol(1) eq fam && strcol(2) eq word(settings, s) && strcol(3) eq word(rules, r)) ? $9 : NaN):10 \
        with points pt int(word(pts, r)) ps 0.6 lc rgb word(colors, r) title word(rules, r)
  }
}
unset multiplot
