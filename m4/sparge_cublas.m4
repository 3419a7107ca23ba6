# SPARGE_CUBLAS (after SPARGE_CUDA): cuBLAS for the trainer's CUDA ops (experiments/trainer/ops_cuda.cu).
# Looked for only when the CUDA backend is built; never needed by the library. Sets CUBLAS_LIBS and
# the conditional HAVE_CUBLAS; without it sparge-train runs its model on the host (device_ops has no effect).
AC_DEFUN([SPARGE_CUBLAS], [
  have_cublas=no
  sparge_cublas_summary=no
  AS_IF([test "x$have_cuda" = xyes], [
    sparge_save_CPPFLAGS=$CPPFLAGS; CPPFLAGS="$CPPFLAGS $CUDA_CPPFLAGS"
    sparge_save_LIBS=$LIBS
    AC_CHECK_HEADER([cublas_v2.h],
      [AC_CHECK_LIB([cublas], [cublasCreate_v2], [have_cublas=yes], [],
                    [-L$CUDA_HOME/lib64 -L$CUDA_HOME/lib -lcudart])])
    CPPFLAGS=$sparge_save_CPPFLAGS; LIBS=$sparge_save_LIBS
    AS_IF([test "x$have_cublas" = xyes],
          [CUBLAS_LIBS="-L$CUDA_HOME/lib64 -Wl,-rpath,$CUDA_HOME/lib64 -lcublas -lcudart"
           sparge_cublas_summary="yes (trainer CUDA ops)"],
          [SPARGE_WARN([cuBLAS not found: sparge-train runs its model on the host even on a CUDA device])])
  ])
  AC_SUBST([CUBLAS_LIBS])
  AM_CONDITIONAL([HAVE_CUBLAS], [test "x$have_cublas" = xyes])
])
