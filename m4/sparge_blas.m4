# SPARGE_BLAS (after SPARGE_CUBLAS): --with-blas[=yes|no] (default: guess), CBLAS and LAPACK for the trainer
# (experiments/trainer): cblas_sgemm for its host GEMMs, LAPACK's dsyevd for the matrix square roots of its Fréchet
# distance.
# CBLAS: OpenBLAS through pkg-config first (Debian: libopenblas-dev), then any library that links cblas_sgemm
# with a <cblas.h> (BLIS's libblis-dev, the reference libblas-dev).
# LAPACK: LAPACKE_dsyevd with <lapacke.h>, from the CBLAS library itself (upstream OpenBLAS exports LAPACKE),
# else from liblapacke (pkg-config lapacke, then -llapacke; Debian: liblapacke-dev); failing that, LAPACK's
# Fortran dsyevd_ in the CBLAS library (every OpenBLAS build carries LAPACK, Debian's too), declared by the
# trainer itself.
# Without both, a build with cuBLAS and cuSOLVER (SPARGE_CUBLAS) still builds the trainer for CUDA devices: its
# host GEMMs are plain loops and the eigen-decomposition is cuSOLVER's, so a GPU machine needs no host BLAS.
# Sets TRAINER_CPPFLAGS (-DSPARGE_TRAINER_CBLAS=1 with -DSPARGE_TRAINER_LAPACKE=1 where LAPACKE is used, or
# -DSPARGE_TRAINER_CUSOLVER=1), TRAINER_LIBS and the conditional HAVE_TRAINER; the library itself never needs them.
AC_DEFUN([SPARGE_BLAS], [
  AC_ARG_WITH([blas], [AS_HELP_STRING([--with-blas], [CBLAS and LAPACK for sparge-train, e.g. OpenBLAS (default: guess)])],
              [], [with_blas=guess])
  AC_ARG_WITH([lapacke], [AS_HELP_STRING([--without-lapacke],
              [call LAPACK's Fortran dsyevd_ even where LAPACKE is found (tests that path)])],
              [], [with_lapacke=guess])
  have_blas=no
  AS_IF([test "x$with_blas" = xno], [sparge_blas_summary="no (disabled)"], [sparge_blas_summary=no])
  AS_IF([test "x$with_blas" != xno], [
    PKG_CHECK_MODULES([BLAS], [openblas], [have_blas=yes; sparge_blas_summary="OpenBLAS ($BLAS_LIBS)"], [:])
    AS_IF([test "x$have_blas" = xno], [
      sparge_blas_save_LIBS=$LIBS
      AC_SEARCH_LIBS([cblas_sgemm], [openblas blis cblas blas], [
        AC_CHECK_HEADER([cblas.h], [have_blas=yes
                                    BLAS_LIBS=$ac_cv_search_cblas_sgemm
                                    AS_IF([test "x$BLAS_LIBS" = "xnone required"], [BLAS_LIBS=])
                                    sparge_blas_summary="CBLAS (${BLAS_LIBS:-libc})"])])
      LIBS=$sparge_blas_save_LIBS
    ])
  ])
  AS_IF([test "x$have_blas" = xyes], [
    sparge_lapack=no
    sparge_blas_save_LIBS=$LIBS
    sparge_blas_save_CPPFLAGS=$CPPFLAGS
    AS_IF([test "x$with_lapacke" != xno], [
      LIBS="$BLAS_LIBS $sparge_blas_save_LIBS"
      AC_MSG_CHECKING([for LAPACKE_dsyevd in the CBLAS library])
      AC_LINK_IFELSE([AC_LANG_CALL([], [LAPACKE_dsyevd])],
                     [AC_MSG_RESULT([yes]); sparge_lapack=lapacke; sparge_lapack_libs=],
                     [AC_MSG_RESULT([no])])
      AS_IF([test "x$sparge_lapack" = xno], [
        PKG_CHECK_MODULES([LAPACKE], [lapacke], [sparge_lapacke_pc=yes], [sparge_lapacke_pc=no])
        AS_IF([test "x$sparge_lapacke_pc" = xyes],
              [sparge_lapacke_try="$LAPACKE_LIBS"], [sparge_lapacke_try="-llapacke"; LAPACKE_CFLAGS=])
        LIBS="$sparge_lapacke_try $BLAS_LIBS $sparge_blas_save_LIBS"
        AC_MSG_CHECKING([for LAPACKE_dsyevd in $sparge_lapacke_try])
        AC_LINK_IFELSE([AC_LANG_CALL([], [LAPACKE_dsyevd])],
                       [AC_MSG_RESULT([yes]); sparge_lapack=lapacke; sparge_lapack_libs=$sparge_lapacke_try],
                       [AC_MSG_RESULT([no])])
      ])
      AS_IF([test "x$sparge_lapack" = xlapacke], [
        CPPFLAGS="$LAPACKE_CFLAGS $BLAS_CFLAGS $CPPFLAGS"
        AC_CHECK_HEADER([lapacke.h], [], [sparge_lapack=no])
        CPPFLAGS=$sparge_blas_save_CPPFLAGS
      ])
    ])
    AS_IF([test "x$sparge_lapack" = xno], [
      LIBS="$BLAS_LIBS $sparge_blas_save_LIBS"
      AC_MSG_CHECKING([for LAPACK's Fortran dsyevd_ in the CBLAS library])
      AC_LINK_IFELSE([AC_LANG_CALL([], [dsyevd_])],
                     [AC_MSG_RESULT([yes]); sparge_lapack=fortran],
                     [AC_MSG_RESULT([no])])
    ])
    LIBS=$sparge_blas_save_LIBS
    AS_CASE([$sparge_lapack],
      [lapacke], [BLAS_CFLAGS="$BLAS_CFLAGS $LAPACKE_CFLAGS -DSPARGE_TRAINER_LAPACKE=1"
                  BLAS_LIBS="$sparge_lapack_libs $BLAS_LIBS"
                  sparge_blas_summary="$sparge_blas_summary, LAPACKE (${sparge_lapack_libs:-in the CBLAS library})"],
      [fortran], [sparge_blas_summary="$sparge_blas_summary, LAPACK dsyevd_ (Fortran interface)"],
      [have_blas=no
       sparge_blas_summary="no (CBLAS found, but no LAPACK dsyevd)"])
  ])
  AS_IF([test "x$with_blas" = xyes && test "x$have_blas" = xno],
        [AC_MSG_ERROR([--with-blas was given but no CBLAS with LAPACK was found (apt-get install libopenblas-dev liblapacke-dev)])])
  have_trainer=no
  AS_IF([test "x$have_blas" = xyes],
        [have_trainer=yes
         TRAINER_CPPFLAGS="$BLAS_CFLAGS -DSPARGE_TRAINER_CBLAS=1"
         TRAINER_LIBS=$BLAS_LIBS],
        [test "x$have_cusolver" = xyes],
        [have_trainer=yes
         TRAINER_CPPFLAGS="$CUDA_CPPFLAGS -DSPARGE_TRAINER_CUSOLVER=1"
         TRAINER_LIBS=$CUSOLVER_LIBS
         sparge_blas_summary="$sparge_blas_summary; sparge-train for CUDA devices: host GEMMs as loops, cuSOLVER dsyevd"],
        [test "x$with_blas" != xno],
        [SPARGE_WARN([no CBLAS with LAPACK and no cuSOLVER found: sparge-train and its tests are not built (apt-get install libopenblas-dev liblapacke-dev)])])
  AC_SUBST([TRAINER_CPPFLAGS])
  AC_SUBST([TRAINER_LIBS])
  AM_CONDITIONAL([HAVE_TRAINER], [test "x$have_trainer" = xyes])
])
