# SPARGE_HIP: --with-hip[=DIR] (default: guess) and --with-hip-arch=LIST
# (default: gfx90a gfx940 gfx1030, the targets Debian's hipcc 5.2 builds).
AC_DEFUN([SPARGE_HIP], [
  AC_ARG_WITH([hip], [AS_HELP_STRING([--with-hip@<:@=DIR@:>@], [build the HIP backend (default: guess)])],
              [], [with_hip=guess])
  AC_ARG_WITH([hip-arch], [AS_HELP_STRING([--with-hip-arch=LIST],
              [AMD targets to build (default: gfx90a gfx940 gfx1030)])],
              [], [with_hip_arch="gfx90a gfx940 gfx1030"])
  have_hip=no
  sparge_hip_summary=no
  AS_IF([test "x$with_hip" != xno], [
    AS_CASE([$with_hip], [yes|guess], [sparge_hip_path="$PATH:/opt/rocm/bin"], [sparge_hip_path="$with_hip/bin"])
    AC_PATH_PROG([HIPCC], [hipcc], [], [$sparge_hip_path])
    AS_IF([test -n "$HIPCC"], [
      AC_MSG_CHECKING([whether $HIPCC builds for $with_hip_arch])
      HIPCC_ARCH=
      for a in $with_hip_arch; do HIPCC_ARCH="$HIPCC_ARCH --offload-arch=$a"; done
      dnl select.cu sorts rows with rocPRIM's block radix sort (librocprim-dev).
      echo '#include <hip/hip_runtime.h>
#include <rocprim/rocprim.hpp>
__global__ void k(float *x) { x@<:@threadIdx.x@:>@ = 1.f; }' > conftest.hip.cpp
      AS_IF([$HIPCC -std=c++17 $HIPCC_ARCH -x hip -fPIC -c conftest.hip.cpp -o conftest.hip.o >&AS_MESSAGE_LOG_FD 2>&1],
            [have_hip=yes], [have_hip=no])
      rm -f conftest.hip.cpp conftest.hip.o
      AC_MSG_RESULT([$have_hip])
    ])
  ])
  AS_IF([test "x$with_hip" != xno && test "x$with_hip" != xguess && test "x$have_hip" = xno],
        [AC_MSG_ERROR([--with-hip was given but hipcc could not build for $with_hip_arch (apt-get install hipcc libamdhip64-dev librocprim-dev)])])
  AS_IF([test "x$have_hip" = xyes], [
    HIP_LIBS="-lamdhip64"
    AC_DEFINE([SPARGE_HAVE_HIP], [1], [HIP backend built])
    AC_DEFINE_UNQUOTED([SPARGE_HIP_ARCHS], ["$with_hip_arch"], [HIP targets built])
    sparge_backends_extra="$sparge_backends_extra hip"
    sparge_hip_summary="yes ($HIPCC, $with_hip_arch)"
  ], [test "x$with_hip" = xno], [sparge_hip_summary="no (disabled)"],
     [SPARGE_WARN([HIP not found: the HIP backend is not built (apt-get install hipcc libamdhip64-dev librocprim-dev)])])
  AC_SUBST([HIPCC]) AC_SUBST([HIPCC_ARCH]) AC_SUBST([HIP_LIBS])
  AM_CONDITIONAL([HAVE_HIP], [test "x$have_hip" = xyes])
])
