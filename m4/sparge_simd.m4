# _SPARGE_TRY_SIMD(TIER, FLAGS, BODY): can $CC build BODY with FLAGS?
AC_DEFUN([_SPARGE_TRY_SIMD], [
  AC_MSG_CHECKING([whether $CC accepts $2])
  sparge_save_CFLAGS=$CFLAGS; CFLAGS="$CFLAGS $2"
  AC_COMPILE_IFELSE([AC_LANG_PROGRAM([[#include <immintrin.h>]], [[$3]])],
                    [AC_MSG_RESULT([yes]); have_$1=yes; sparge_simd_summary="$sparge_simd_summary $1"],
                    [AC_MSG_RESULT([no]); have_$1=no])
  CFLAGS=$sparge_save_CFLAGS
])

# SPARGE_SIMD: which x86 SIMD tiers the compiler can build. The library picks
# among them at run time, so no tier is required of the build machine.
AC_DEFUN([SPARGE_SIMD], [
  sparge_simd_summary=generic
  _SPARGE_TRY_SIMD([avx2], [-mavx2 -mfma], [__m256 a = _mm256_set1_ps(1.f); a = _mm256_fmadd_ps(a, a, a); (void)a;])
  _SPARGE_TRY_SIMD([avx512], [-mavx512f -mavx512bw -mavx512vl -mfma],
                   [__m512 a = _mm512_set1_ps(1.f); a = _mm512_fmadd_ps(a, a, a); (void)a;])
  AM_CONDITIONAL([HAVE_AVX2], [test "x$have_avx2" = xyes])
  AM_CONDITIONAL([HAVE_AVX512], [test "x$have_avx512" = xyes])
  AS_IF([test "x$have_avx2" = xyes], [AC_DEFINE([SPARGE_HAVE_AVX2], [1], [AVX2+FMA tier built])])
  AS_IF([test "x$have_avx512" = xyes], [AC_DEFINE([SPARGE_HAVE_AVX512], [1], [AVX-512 tier built])])
])
