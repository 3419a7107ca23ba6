# Block masks of the teacher's attention (the paper's Fig. 3 kind): for every layer (rows) one head at one diffusion
# time, the pooled map and the kept blocks of the three Table 6 arms (query blocks down, key blocks across).
# dat: exp_discrim --masks (per layer: map, Top-k, Top-p, hybrid as gnuplot matrices, each ending in two blank lines)
layers = int(system("grep -c '^# layer' '" . dat . "'"))
set terminal term size 1500,(260 * layers + 60) font ",9"
set output out
where = system("awk 'NR == 1 { printf \"%s %s, %s %s\", $4, $5, $6, $7 }' '" . dat . "'")
set multiplot layout layers,4 title where . ": pooled map (dark: more mass) and kept blocks (black) of each arm"
unset key
unset colorbox
set yrange [*:*] reverse
set xtics format ""
set ytics format ""
names = "pooled-map Top-k Top-p hybrid"
do for [l = 0:layers - 1] {
  do for [m = 0:3] {
    set title sprintf("layer %d — %s", l, word(names, m + 1))
    if (m == 0) { set palette defined (0 "#ffffff", 1 "#1f3f8f"); set cbrange [*:*] } \
    else { set palette defined (0 "#ffffff", 1 "#000000"); set cbrange [0:1] }
    plot dat index (4 * l + m) matrix with image
  }
}
unset multiplot
