# The teacher's attention under the Table 6 arms, by layer (x; each layer's points spread by diffusion time, one
# point per head; open circles: the hybrid, over the others where they coincide): sparsity and kept pooled mass of
# each arm, how far apart the arms' masks are, and row flatness.
# csv: exp_discrim --csv (layer,t,head,rows,key_blocks,entropy,top1_mass,topn_mass,sink_share,topk_blocks,
#      topk_sparsity,topk_mass,topk_rel_l1,topp_sparsity,topp_mass,topp_rel_l1,hybrid_sparsity,hybrid_mass,
#      hybrid_rel_l1,topp_rows_fewer,hybrid_floor_binds,distance_topk_topp,distance_hybrid_topp,distance_hybrid_topk)
set terminal term size 1500,900 font ",10"
set output out
set datafile separator ","
set multiplot layout 2,2 title "Table 6 arms on the teacher's attention: per layer, head (points) and time (offset right)"
x(layer, t) = layer + 0.6 * (t - 0.5)
set grid
set xlabel "layer (points to the right: later diffusion time)"
set key outside right top
set title "block sparsity of each arm's masks"
set ylabel "sparsity"
plot csv every ::1 using (x($1, $2)):11 with points pt 7 ps 0.6 lc rgb "#1f77b4" title "Top-k (every row alike)", \
     '' every ::1 using (x($1, $2)):14 with points pt 5 ps 0.6 lc rgb "#d62728" title "Top-p", \
     '' every ::1 using (x($1, $2)):17 with points pt 6 ps 1.2 lc rgb "#2ca02c" title "hybrid"
set title "kept pooled mass of a row"
set ylabel "kept mass"
plot csv every ::1 using (x($1, $2)):12 with points pt 7 ps 0.6 lc rgb "#1f77b4" title "Top-k", \
     '' every ::1 using (x($1, $2)):15 with points pt 5 ps 0.6 lc rgb "#d62728" title "Top-p", \
     '' every ::1 using (x($1, $2)):18 with points pt 6 ps 1.2 lc rgb "#2ca02c" title "hybrid"
set title "how far the arms' masks are apart"
set ylabel "Jaccard distance / share of rows"
set yrange [0:*]
plot csv every ::1 using (x($1, $2)):22 with points pt 7 ps 0.6 lc rgb "#9467bd" title "distance Top-k / Top-p", \
     '' every ::1 using (x($1, $2)):23 with points pt 5 ps 0.6 lc rgb "#2ca02c" title "distance hybrid / Top-p", \
     '' every ::1 using (x($1, $2)):21 with points pt 9 ps 0.6 lc rgb "#ff7f0e" title "rows where the hybrid's floor binds"
set title "row flatness on the pooled map"
set ylabel "entropy (1 = flat) / mass share"
set yrange [0:1.05]
plot csv every ::1 using (x($1, $2)):6 with points pt 7 ps 0.6 lc rgb "#444444" title "normalized entropy", \
     '' every ::1 using (x($1, $2)):8 with points pt 5 ps 0.6 lc rgb "#1f77b4" title "mass of the top n blocks", \
     '' every ::1 using (x($1, $2)):9 with points pt 9 ps 0.6 lc rgb "#d62728" title "sink share", \
     '' every ::1 using (x($1, $2)):($10 / $5) with lines dt 2 lc rgb "#1f77b4" title "n / key blocks (a flat row)"
unset multiplot
