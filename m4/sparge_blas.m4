# SPARGE_BLAS: --with-blas[=yes|no] (default: guess), CBLAS for the trainer's GEMMs
# (experiments/trainer). OpenBLAS through pkg-config first (Debian: libopenblas-dev), then any
# library that links cblas_sgemm with a <cblas.h> (BLIS's libblis-dev, the reference libblas-dev).
# Sets BLAS_CFLAGS, BLAS_LIBS and the conditional HAVE_BLAS; the library itself never needs it.
AC_DEFUN([SPARGE_BLAS], [
  AC_ARG_WITH([blas], [AS_HELP_STRING([--with-blas], [CBLAS for sparge-train, e.g. OpenBLAS (default: guess)])],
              [], [with_blas=guess])
  have_blas=no
  sparge_blas_summary=no
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
  AS_IF([test "x$with_blas" = xyes && test "x$have_blas" = xno],
        [AC_MSG_ERROR([--with-blas was given but no CBLAS was found (apt-get install libopenblas-dev)])])
  AS_IF([test "x$have_blas" = xno && test "x$with_blas" = xno], [sparge_blas_summary="no (disabled)"],
        [test "x$have_blas" = xno],
        [SPARGE_WARN([no CBLAS found: sparge-train and its test are not built (apt-get install libopenblas-dev)])])
  AC_SUBST([BLAS_CFLAGS])
  AC_SUBST([BLAS_LIBS])
  AM_CONDITIONAL([HAVE_BLAS], [test "x$have_blas" = xyes])
])
