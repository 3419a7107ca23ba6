# Error decomposition: measured ||O − O_s||_1 per sampled token against the
# prediction (1 − α)||μ_d − μ_k||_1 (left), and the token-level kept mass α
# against the pooled kept mass the mask was selected with (right).
# tokens csv: family,rule,head,token,alpha,pooled_mass,err_l1,pred_l1,residual_l1,dropped_l1,renorm_l1,o_l1
set terminal term size 1300,550 font ",10"
set output out
# families: the inputs' names in the CSV's first column (run.sh passes those present)
if (!exists("families")) families = "uniform+hubs sink video"
nf = words(families)
set datafile separator ","
set multiplot layout 1,2
colors = "#1f77b4 #d62728 #2ca02c"
set grid
set key top left
set logscale xy
set format xy "%g"
set title "O − O_s = (1−α)(μ_{dropped} − μ_{kept}), every rule, sampled tokens"
set xlabel "predicted (1−α)·||μ_d − μ_k||_1"
set ylabel "measured ||O − O_s||_1 (sparge dense − sparse)"
plot for [f = 1:nf] csv every ::1 using ((strcol(1) eq word(families, f)) ? $8 : NaN):7 \
        with points pt 7 ps 0.35 lc rgb word(colors, f) title word(families, f), \
     x with lines lc rgb "black" dt 2 title "y = x"
unset logscale
set xrange [0:1]
set yrange [0:1]
set title "Pooled kept mass (what the mask sees) vs. token-level kept mass α"
set xlabel "pooled kept mass of the query block's row"
set ylabel "token-level kept mass α"
plot for [f = 1:nf] csv every ::1 using ((strcol(1) eq word(families, f)) ? $6 : NaN):5 \
        with points pt 7 ps 0.35 lc rgb word(colors, f) title word(families, f), \
     x with lines lc rgb "black" dt 2 title "y = x"
unset multiplot
