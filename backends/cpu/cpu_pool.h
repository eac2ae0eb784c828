/* cpu_pool.h - a persistent thread pool that runs data-parallel loops for the CPU backend. */
#ifndef KILN_CPU_POOL_H
#define KILN_CPU_POOL_H

#include <stdint.h>

typedef struct cpu_pool cpu_pool_t;

/* Runs task `task` of a loop on the thread numbered `thread` (0 = the caller,
 * 1..threads-1 = workers); a thread number is never used by two tasks at once, so it can
 * index per-thread scratch. */
typedef void (*cpu_pool_fn)(void *ctx, int64_t task, int thread);

/* Creates a pool of `threads` threads in all (the caller counts as one, so threads - 1
 * workers are started). Returns NULL when a thread or memory cannot be had. */
cpu_pool_t *cpu_pool_create(int threads);

/* Stops and joins the workers and frees the pool; NULL is a no-op. */
void cpu_pool_destroy(cpu_pool_t *pool);

/* Threads a loop may use (>= 1); 1 for a NULL pool. */
int cpu_pool_threads(const cpu_pool_t *pool);

/* Runs fn(ctx, t, thread) for every t in [0, ntasks) and returns when all are done. Tasks are
 * handed out dynamically. When the pool is busy (another stream's op, or a nested call from a
 * task) or there is one task, the loop runs on the calling thread alone. Thread-safe. */
void cpu_pool_run(cpu_pool_t *pool, int64_t ntasks, cpu_pool_fn fn, void *ctx);

#endif /* KILN_CPU_POOL_H */
