/* cpu_pool.c - persistent worker threads that spin briefly, then sleep, between loops. */
#include "cpu_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

/* Workers spin this long for the next loop before sleeping: a forward pass issues ops back
 * to back, and a condition-variable wake-up costs tens of microseconds per op. Short, so
 * that an idle process does not keep its cores busy. */
#define POOL_SPIN_NS 200000

struct cpu_pool {
  int threads;
  pthread_t *workers;
  int started;

  pthread_mutex_t run_lock; /* one loop at a time; others run inline */
  pthread_mutex_t mu;       /* guards sleeping on cv */
  pthread_cond_t cv;

  /* The current loop, published by bumping `generation`. */
  cpu_pool_fn fn;
  void *ctx;
  int64_t ntasks;
  _Atomic int64_t next;
  _Atomic int busy; /* workers that have not finished the current loop */
  _Atomic uint64_t generation;
  _Atomic bool stop;
};

typedef struct worker_arg {
  cpu_pool_t *pool;
  int thread;
} worker_arg_t;

/* Set on pool threads and while a caller runs a loop, so nested loops run inline. A pthread
 * key, not _Thread_local: a dlopen'ed plugin's _Thread_local lives in glibc's dynamic TLS once
 * the static TLS surplus is spent (libkiln links libcurl and its TLS libraries), and GCC 12's
 * LeakSanitizer crashes scanning it at exit ("Tracer caught signal 11", test_model_load under
 * ASan, 2026-12-02). The key is deleted when the plugin is unloaded. */
static pthread_key_t tls_key;
static pthread_once_t tls_once = PTHREAD_ONCE_INIT;
static bool tls_made;
static void tls_init(void) { tls_made = pthread_key_create(&tls_key, NULL) == 0; }
static bool tls_get(void) {
  (void)pthread_once(&tls_once, tls_init);
  return tls_made && pthread_getspecific(tls_key) != NULL;
}
static void tls_set(bool v) {
  (void)pthread_once(&tls_once, tls_init);
  if (tls_made) (void)pthread_setspecific(tls_key, v ? (void *)1 : NULL);
}
__attribute__((destructor)) static void tls_fini(void) {
  if (tls_made) (void)pthread_key_delete(tls_key);
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void run_tasks(cpu_pool_t *p, int thread) {
  for (;;) {
    int64_t t = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
    if (t >= p->ntasks) break;
    p->fn(p->ctx, t, thread);
  }
}

static void *worker_main(void *argp) {
  worker_arg_t *arg = argp;
  cpu_pool_t *p = arg->pool;
  int thread = arg->thread;
  uint64_t seen = 0;
  free(arg);
  tls_set(true);
  for (;;) {
    uint64_t gen = atomic_load_explicit(&p->generation, memory_order_acquire);
    if (gen == seen && !atomic_load(&p->stop)) {
      uint64_t t0 = now_ns();
      unsigned spins = 0;
      while ((gen = atomic_load_explicit(&p->generation, memory_order_acquire)) == seen &&
             !atomic_load_explicit(&p->stop, memory_order_relaxed)) {
        CPU_RELAX();
        if ((++spins & 255u) == 0 && now_ns() - t0 > POOL_SPIN_NS) break;
      }
      if (gen == seen) {
        pthread_mutex_lock(&p->mu);
        while ((gen = atomic_load_explicit(&p->generation, memory_order_acquire)) == seen &&
               !atomic_load(&p->stop))
          pthread_cond_wait(&p->cv, &p->mu);
        pthread_mutex_unlock(&p->mu);
      }
    }
    if (atomic_load(&p->stop)) break;
    seen = gen;
    run_tasks(p, thread);
    atomic_fetch_sub_explicit(&p->busy, 1, memory_order_release);
  }
  return NULL;
}

cpu_pool_t *cpu_pool_create(int threads) {
  cpu_pool_t *p = calloc(1, sizeof(*p));
  if (!p) return NULL;
  if (threads < 1) threads = 1;
  p->threads = threads;
  pthread_mutex_init(&p->run_lock, NULL);
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  atomic_init(&p->next, 0);
  atomic_init(&p->busy, 0);
  atomic_init(&p->generation, 0);
  atomic_init(&p->stop, false);
  if (threads > 1) {
    p->workers = calloc((size_t)threads - 1, sizeof(pthread_t));
    if (!p->workers) goto fail;
    for (int i = 1; i < threads; i++) {
      worker_arg_t *arg = malloc(sizeof(*arg));
      if (!arg) goto fail;
      arg->pool = p;
      arg->thread = i;
      if (pthread_create(&p->workers[i - 1], NULL, worker_main, arg) != 0) {
        free(arg);
        goto fail;
      }
      p->started++;
    }
  }
  return p;

fail:
  cpu_pool_destroy(p);
  return NULL;
}

void cpu_pool_destroy(cpu_pool_t *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  atomic_store(&p->stop, true);
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  for (int i = 0; i < p->started; i++) pthread_join(p->workers[i], NULL);
  free(p->workers);
  pthread_cond_destroy(&p->cv);
  pthread_mutex_destroy(&p->mu);
  pthread_mutex_destroy(&p->run_lock);
  free(p);
}

int cpu_pool_threads(const cpu_pool_t *p) { return p ? p->started + 1 : 1; }

void cpu_pool_run(cpu_pool_t *p, int64_t ntasks, cpu_pool_fn fn, void *ctx) {
  if (ntasks <= 0) return;
  if (!p || p->started == 0 || ntasks == 1 || tls_get() ||
      pthread_mutex_trylock(&p->run_lock) != 0) {
    for (int64_t t = 0; t < ntasks; t++) fn(ctx, t, 0);
    return;
  }
  tls_set(true);
  p->fn = fn;
  p->ctx = ctx;
  p->ntasks = ntasks;
  atomic_store_explicit(&p->next, 0, memory_order_relaxed);
  atomic_store_explicit(&p->busy, p->started, memory_order_relaxed);
  pthread_mutex_lock(&p->mu);
  atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  run_tasks(p, 0);
  /* Every worker checks in, even one that found no task, before the loop's fields change. */
  while (atomic_load_explicit(&p->busy, memory_order_acquire) != 0) CPU_RELAX();
  tls_set(false);
  pthread_mutex_unlock(&p->run_lock);
}
