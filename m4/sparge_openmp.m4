# SPARGE_OPENMP: --enable-openmp (default: guess). AC_OPENMP provides the option.
AC_DEFUN([SPARGE_OPENMP], [
  AC_OPENMP
  AS_IF([test "x$enable_openmp" = xyes && test -z "$OPENMP_CFLAGS" && test "x$ac_cv_prog_c_openmp" != "xnone needed"],
        [AC_MSG_ERROR([--enable-openmp was given but $CC does not support OpenMP])])
  AS_IF([test "x$enable_openmp" = xno], [sparge_openmp_summary="no (disabled)"],
        [test "x$ac_cv_prog_c_openmp" = xunsupported],
        [sparge_openmp_summary="no"; SPARGE_WARN([OpenMP not supported by $CC: the cpu backend runs on one thread])],
        [sparge_openmp_summary="yes ($OPENMP_CFLAGS)"])
  AC_SUBST([OPENMP_CFLAGS])
])
