/* Build configuration and machine topology, as text. */
#include <stdio.h>
#include <pthread.h>

#include "config.h"
#include "core.h"
#include "../backends/cpu/topology.h"

static char text[1024];
static pthread_once_t text_once = PTHREAD_ONCE_INIT;

/* Written once: callers on any thread then only read. */
static void describe(void)
{
    int n = snprintf(text, sizeof text, "sparge %s\n", PACKAGE_VERSION);
    n += snprintf(text + n, sizeof text - n, "  backends  :");
    for (int i = 0; i < sparge_backend_count() && n < (int)sizeof text; i++)
        n += snprintf(text + n, sizeof text - n, " %s", sparge_backend_name(i));
    snprintf(text + n, sizeof text - n,
             "\n  OpenMP    : %s\n  hwloc     : %s\n  CUDA      : %s\n  HIP       : %s\n",
#ifdef _OPENMP
             "yes",
#else
             "no",
#endif
#ifdef SPARGE_HAVE_HWLOC
             "yes",
#else
             "no",
#endif
#ifdef SPARGE_HAVE_CUDA
             "yes (" SPARGE_CUDA_ARCHS ")",
#else
             "no",
#endif
#ifdef SPARGE_HAVE_HIP
             "yes (" SPARGE_HIP_ARCHS ")"
#else
             "no"
#endif
    );
}

const char *sparge_build_info(void)
{
    pthread_once(&text_once, describe);
    return text;
}

const char *sparge_topology_info(void) { return sparge_cpu_topology_text(); }
