# SPARGE_HWLOC: --with-hwloc[=yes|no] (default: guess) for thread binding and topology.
AC_DEFUN([SPARGE_HWLOC], [
  AC_ARG_WITH([hwloc], [AS_HELP_STRING([--with-hwloc], [bind CPU threads and report topology with hwloc (default: guess)])],
              [], [with_hwloc=guess])
  have_hwloc=no
  AS_IF([test "x$with_hwloc" != xno],
        [PKG_CHECK_MODULES([HWLOC], [hwloc >= 2.0], [have_hwloc=yes], [have_hwloc=no])])
  AS_IF([test "x$with_hwloc" = xyes && test "x$have_hwloc" = xno],
        [AC_MSG_ERROR([--with-hwloc was given but hwloc >= 2.0 was not found (apt-get install libhwloc-dev)])])
  AS_IF([test "x$have_hwloc" = xyes],
        [AC_DEFINE([SPARGE_HAVE_HWLOC], [1], [hwloc is available])
         sparge_hwloc_summary=yes],
        [test "x$with_hwloc" = xno], [sparge_hwloc_summary="no (disabled)"],
        [sparge_hwloc_summary=no; SPARGE_WARN([hwloc not found: threads are not bound (apt-get install libhwloc-dev)])])
  AM_CONDITIONAL([HAVE_HWLOC], [test "x$have_hwloc" = xyes])
])
