# Speed figure: speedup over dense attention against sparsity (forward alone
# and with mask prediction), the ideal 1/(1−s), and the paper's 16.2× at 95 %.
# csv: backend,device,dtype,B,H,N,D,target_sparsity,sparsity,token_density,mask_ms,fwd_ms,total_ms,dense_ms,
#      speedup_fwd,speedup_total,...
set terminal term size 900,600 font ",10"
set output out
set datafile separator ","
set grid
set logscale y
set format y "%g×"
set xlabel "sparsity (%)"
set ylabel "speedup over dense attention"
set key top left
set xrange [*:100]
set title sprintf("Block-sparse forward on %s", label)
$paper << EOD
95,16.2
EOD
set label 1 "paper: 16.2× at 95 %\n(RTX 5090)" at 95, 16.2 offset -14, 1.2
plot csv every ::1 using (100*$9):15 with linespoints pt 7 lc rgb "#1f77b4" title "sparse forward", \
     csv every ::1 using (100*$9):16 with linespoints pt 5 lc rgb "#d62728" title "mask prediction + sparse forward", \
     csv every ::1 using (100*$9):(1/(1-$9)) with lines dt 2 lc rgb "black" title "ideal 1/(1−s)", \
     $paper using 1:2 with points pt 13 ps 2.5 lc rgb "#ff7f0e" title "paper"
