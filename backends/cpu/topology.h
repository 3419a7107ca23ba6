/* hwloc: thread binding and a topology summary (no-ops without hwloc). */
#ifndef SPARGE_TOPOLOGY_H
#define SPARGE_TOPOLOGY_H

/* Bind each OpenMP thread to its own core; returns 1 if bound. */
int sparge_cpu_bind_threads(void);
/* Multi-line summary: package, cores, PUs, caches, NUMA nodes. */
const char *sparge_cpu_topology_text(void);

#endif
