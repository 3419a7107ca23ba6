/* hwloc topology: binding OpenMP threads to cores and describing the machine. */
#include <stdio.h>
#include <string.h>
#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "config.h"
#include "topology.h"

#ifdef SPARGE_HAVE_HWLOC
#include <hwloc.h>

static hwloc_topology_t topo;
static int topo_loaded;
static char topo_text[1024];
static pthread_once_t topo_once = PTHREAD_ONCE_INIT;

static void describe(void)
{
    char *text = topo_text;
    int n = 0;
    const char *model = hwloc_obj_get_info_by_name(hwloc_get_obj_by_type(topo, HWLOC_OBJ_PACKAGE, 0), "CPUModel");
    n += snprintf(text + n, sizeof topo_text - n, "  cpu model : %s\n", model ? model : "unknown");
    n += snprintf(text + n, sizeof topo_text - n, "  packages  : %d, NUMA nodes: %d, cores: %d, PUs: %d\n",
                  hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PACKAGE), hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE),
                  hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE), hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU));
    static const hwloc_obj_type_t caches[] = {HWLOC_OBJ_L1CACHE, HWLOC_OBJ_L2CACHE, HWLOC_OBJ_L3CACHE};
    for (int c = 0; c < 3 && n < (int)sizeof topo_text; c++) {
        hwloc_obj_t o = hwloc_get_obj_by_type(topo, caches[c], 0);
        if (o && o->attr)
            n += snprintf(text + n, sizeof topo_text - n, "  L%d cache  : %llu KiB x %d\n", c + 1,
                          (unsigned long long)o->attr->cache.size / 1024, hwloc_get_nbobjs_by_type(topo, caches[c]));
    }
}

/* Loaded once for the process, the text written once: callers on any thread then only read. */
static void load_once(void)
{
    topo_loaded = hwloc_topology_init(&topo) == 0 && hwloc_topology_load(topo) == 0;
    if (topo_loaded)
        describe();
    else
        snprintf(topo_text, sizeof topo_text, "hwloc could not load the topology");
}

static int load(void)
{
    pthread_once(&topo_once, load_once);
    return topo_loaded;
}

int sparge_cpu_bind_threads(void)
{
    if (!load())
        return 0;
    int ncores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
    if (ncores <= 0)
        return 0;
    /* The caller is OpenMP thread 0: bind the pool's workers, then give the
     * caller its own binding back so opening a device does not pin the user's thread. */
    hwloc_bitmap_t caller = hwloc_bitmap_alloc();
    int saved = caller && hwloc_get_cpubind(topo, caller, HWLOC_CPUBIND_THREAD) == 0;
    int bound = 1;
#pragma omp parallel reduction(&& : bound)
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        hwloc_obj_t core = hwloc_get_obj_by_type(topo, HWLOC_OBJ_CORE, t % ncores);
        bound = core && hwloc_set_cpubind(topo, core->cpuset, HWLOC_CPUBIND_THREAD) == 0;
    }
    if (saved)
        hwloc_set_cpubind(topo, caller, HWLOC_CPUBIND_THREAD);
    hwloc_bitmap_free(caller);
    return bound;
}

const char *sparge_cpu_topology_text(void)
{
    load();
    return topo_text;
}
#else
int sparge_cpu_bind_threads(void) { return 0; }
const char *sparge_cpu_topology_text(void) { return "  (built without hwloc)\n"; }
#endif
