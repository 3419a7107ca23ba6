# SPARGE_CUBLAS (after SPARGE_CUDA): cuBLAS for the trainer's CUDA ops (experiments/trainer/ops_cuda.cu), and
# cuSOLVER's dsyevd for its Fréchet distance where no host LAPACK is found (m4/sparge_blas.m4).
# Looked for only when the CUDA backend is built; never needed by the library. Sets CUBLAS_LIBS, CUSOLVER_LIBS and
# the conditional HAVE_CUBLAS; without cuBLAS sparge-train runs its model on the host (device_ops has no effect).
AC_DEFUN([SPARGE_CUBLAS], [
  have_cublas=no
  have_cusolver=no
  sparge_cublas_summary=no
  AS_IF([test "x$have_cuda" = xyes], [
    sparge_save_CPPFLAGS=$CPPFLAGS; CPPFLAGS="$CPPFLAGS $CUDA_CPPFLAGS"
    sparge_save_LIBS=$LIBS
    AC_CHECK_HEADER([cublas_v2.h],
      [AC_CHECK_LIB([cublas], [cublasCreate_v2], [have_cublas=yes], [],
                    [-L$CUDA_HOME/lib64 -L$CUDA_HOME/lib -lcudart])])
    AS_IF([test "x$have_cublas" = xyes],
      [AC_CHECK_HEADER([cusolverDn.h],
        [AC_CHECK_LIB([cusolver], [cusolverDnXsyevd], [have_cusolver=yes], [],
                      [-L$CUDA_HOME/lib64 -L$CUDA_HOME/lib -lcublas -lcudart])])])
    CPPFLAGS=$sparge_save_CPPFLAGS; LIBS=$sparge_save_LIBS
    AS_IF([test "x$have_cublas" = xyes],
          [CUBLAS_LIBS="-L$CUDA_HOME/lib64 -Wl,-rpath,$CUDA_HOME/lib64 -lcublas -lcudart"
           sparge_cublas_summary="yes (trainer CUDA ops)"],
          [SPARGE_WARN([cuBLAS not found: sparge-train runs its model on the host even on a CUDA device])])
    AS_IF([test "x$have_cusolver" = xyes],
          [CUSOLVER_LIBS="-L$CUDA_HOME/lib64 -Wl,-rpath,$CUDA_HOME/lib64 -lcusolver"
           sparge_cublas_summary="yes (trainer CUDA ops; cuSOLVER found)"])
  ])
  AC_SUBST([CUBLAS_LIBS])
  AM_CONDITIONAL([HAVE_CUBLAS], [test "x$have_cublas" = xyes])
])
