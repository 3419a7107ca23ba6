# SPARGE_WARN(MESSAGE): warn now and repeat the message in the final summary.
AC_DEFUN([SPARGE_WARN], [
  AC_MSG_WARN([$1])
  sparge_warnings="${sparge_warnings}  - $1
"
])

# SPARGE_SUMMARY: what this build has, printed after AC_OUTPUT.
AC_DEFUN([SPARGE_SUMMARY], [
cat <<SPARGE_EOF

sparge $PACKAGE_VERSION configuration
  C compiler      : $CC $CFLAGS
  backends        : cpu-ref cpu$sparge_backends_extra
  OpenMP          : $sparge_openmp_summary
  hwloc           : $sparge_hwloc_summary
  CPU SIMD tiers  : $sparge_simd_summary (chosen at run time)
  CUDA            : $sparge_cuda_summary
  cuBLAS          : $sparge_cublas_summary
  HIP             : $sparge_hip_summary
  BLAS (trainer)  : $sparge_blas_summary
  tests (cmocka)  : $have_cmocka
  plots (gnuplot) : ${GNUPLOT:-no}
SPARGE_EOF
AS_IF([test -n "$sparge_warnings"], [printf 'warnings:\n%s\n' "$sparge_warnings"])
])
