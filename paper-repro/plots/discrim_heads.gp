# The teacher's attention per layer (rows) and head (columns), means over the dumped diffusion times: the mass of a
# row's top n blocks, and the share of rows where the hybrid's Top-k floor binds. csv: exp_discrim --csv.
set terminal term size 1300,520 font ",10"
set output out
set datafile separator whitespace
# "head layer mean" lines in scan order (layer by layer), a blank line after each layer
mean(col) = sprintf("< awk -F, 'NR > 1 { k = $3 \" \" $1; s[k] += $%d; n[k]++ } " . \
                    "END { for (k in s) print k, s[k] / n[k] }' '%s' | sort -k2,2n -k1,1n | " . \
                    "awk 'NR > 1 && $2 != last { print \"\" } { print; last = $2 }'", col, csv)
set multiplot layout 1,2 title "Per layer and head (mean over diffusion times)"
set xlabel "head"
set ylabel "layer"
set xtics 1
set ytics 1
set cbrange [0:*]
set palette defined (0 "#ffffff", 1 "#1f3f8f")
set title "mass of a row's top n blocks"
plot mean(8) using 1:2:3 with image notitle
set title "rows where the hybrid's floor binds"
set palette defined (0 "#ffffff", 1 "#b2182b")
plot mean(21) using 1:2:3 with image notitle
unset multiplot
