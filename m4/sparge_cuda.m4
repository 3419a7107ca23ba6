# SPARGE_CUDA: --with-cuda[=DIR] (default: guess, looking in PATH and /usr/local/cuda)
# and --with-cuda-arch=LIST (default: 80 90 120; "90" also builds sm_90a where the
# Hopper kernels need it).
AC_DEFUN([SPARGE_CUDA], [
  AC_ARG_WITH([cuda], [AS_HELP_STRING([--with-cuda@<:@=DIR@:>@], [build the CUDA backend (default: guess)])],
              [], [with_cuda=guess])
  AC_ARG_WITH([cuda-arch], [AS_HELP_STRING([--with-cuda-arch=LIST],
              [compute capabilities to build, e.g. "80 90 120" (default: 80 90 120)])],
              [], [with_cuda_arch="80 90 120"])
  have_cuda=no
  sparge_cuda_summary=no
  AS_IF([test "x$with_cuda" != xno], [
    sparge_cuda_path=$PATH
    AS_CASE([$with_cuda], [yes|guess], [sparge_cuda_path="$PATH:/usr/local/cuda/bin"],
            [sparge_cuda_path="$with_cuda/bin"])
    AC_PATH_PROG([NVCC], [nvcc], [], [$sparge_cuda_path])
    AS_IF([test -n "$NVCC"], [
      dnl nvcc may be a wrapper script (e.g. /usr/local/bin/nvcc): ask nvcc where its toolkit lives.
      sparge_cuda_top=$("$NVCC" -dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
      AS_IF([test -z "$sparge_cuda_top"], [sparge_cuda_top="$(dirname "$NVCC")/.."])
      CUDA_HOME=$(cd "$sparge_cuda_top" && pwd)
      AC_MSG_NOTICE([CUDA toolkit root: $CUDA_HOME])
      sparge_save_CPPFLAGS=$CPPFLAGS; CPPFLAGS="$CPPFLAGS -I$CUDA_HOME/include"
      sparge_save_LIBS=$LIBS
      AC_CHECK_HEADER([cuda_runtime_api.h],
        [AC_CHECK_LIB([cudart], [cudaGetDeviceCount], [have_cuda=yes], [], [-L$CUDA_HOME/lib64 -L$CUDA_HOME/lib])])
      CPPFLAGS=$sparge_save_CPPFLAGS; LIBS=$sparge_save_LIBS
    ])
  ])
  AS_IF([test "x$with_cuda" != xno && test "x$with_cuda" != xguess && test "x$have_cuda" = xno],
        [AC_MSG_ERROR([--with-cuda was given but no working nvcc + cudart was found (looked in $sparge_cuda_path)])])
  AS_IF([test "x$have_cuda" = xyes], [
    NVCC_GENCODE=
    for a in $with_cuda_arch; do
      AS_CASE([$a], [@<:@0-9@:>@@<:@0-9@:>@|@<:@0-9@:>@@<:@0-9@:>@@<:@0-9@:>@|@<:@0-9@:>@@<:@0-9@:>@a],
              [NVCC_GENCODE="$NVCC_GENCODE -gencode arch=compute_$a,code=sm_$a"],
              [AC_MSG_ERROR([--with-cuda-arch: '$a' is not a compute capability like 80, 90 or 120])])
    done
    dnl The Hopper kernels (forward_sm90.cu, backward_sm90.cu, dq_sm90.cu) are built for sm_90a alone when 90 is
    dnl in the list; the define tells their host code that the kernel image exists. Without 90 they
    dnl compile to stubs.
    NVCC_GENCODE_SM90A=
    for a in $with_cuda_arch; do
      AS_CASE([$a], [90|90a], [NVCC_GENCODE_SM90A="-gencode arch=compute_90a,code=sm_90a -DSPARGE_CUDA_SM90A=1"])
    done
    dnl The highest arch also ships PTX so newer GPUs can JIT it.
    sparge_cuda_last=$(echo $with_cuda_arch | awk '{print $NF}')
    NVCC_GENCODE="$NVCC_GENCODE -gencode arch=compute_$sparge_cuda_last,code=compute_$sparge_cuda_last"
    AS_IF([test -z "$NVCC_GENCODE_SM90A"], [NVCC_GENCODE_SM90A=$NVCC_GENCODE])
    CUDA_CPPFLAGS="-I$CUDA_HOME/include"
    CUDA_LIBS="-L$CUDA_HOME/lib64 -Wl,-rpath,$CUDA_HOME/lib64 -lcudart"
    AC_DEFINE([SPARGE_HAVE_CUDA], [1], [CUDA backend built])
    AC_DEFINE_UNQUOTED([SPARGE_CUDA_ARCHS], ["sm $with_cuda_arch"], [CUDA architectures built])
    sparge_backends_extra="$sparge_backends_extra cuda cuda-generic"
    sparge_cuda_summary="yes ($NVCC, sm: $with_cuda_arch)"
  ], [test "x$with_cuda" = xno], [sparge_cuda_summary="no (disabled)"],
     [SPARGE_WARN([CUDA not found: the CUDA backend is not built (use --with-cuda=DIR)])])
  AC_SUBST([NVCC]) AC_SUBST([NVCC_GENCODE]) AC_SUBST([NVCC_GENCODE_SM90A]) AC_SUBST([CUDA_CPPFLAGS]) AC_SUBST([CUDA_LIBS])
  AM_CONDITIONAL([HAVE_CUDA], [test "x$have_cuda" = xyes])
])
