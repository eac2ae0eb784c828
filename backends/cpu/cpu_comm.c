/* cpu_comm.c - the CPU backend's collectives (ABI 1.5, docs/parallel.md): ranks meet in one
 * POSIX shared-memory segment, so the same code serves threads of one process and forked or
 * separately started processes.
 *
 * The segment (/dev/shm/kiln-comm-<32 hex digits>, named by the unique id) holds a header, one
 * control slot per rank, one data slot of CPU_COMM_SLOT bytes per rank for the collectives and
 * one channel of CPU_COMM_CHAN bytes per ordered pair (src, dst) for send/recv. Rank 0 creates
 * and initialises it (magic written last), the others open it when it appears; once every rank
 * has joined, rank 0 unlinks the name, so nothing is left in /dev/shm after comm_create
 * returns, whatever happens to the ranks later (the mappings live until each rank unmaps).
 *
 * A collective runs in steps of at most CPU_COMM_SLOT bytes per rank: every rank writes its
 * part and a descriptor (op, dtype, bytes, root) into its slot and publishes `arrive` = 2k+1;
 * when every rank has, each checks the descriptors agree and reads what it needs; then
 * `arrive` = 2k+2 and a second wait keeps slots from being overwritten while read. All-reduce
 * sums every element in F32 in rank order 0..W-1 and rounds to F16/BF16 once, so every rank
 * gets the same bits. Waits spin briefly, then sleep (50 us growing to 1 ms) and fail after the
 * communicator's timeout naming the ranks that did not arrive; the communicator is then
 * marked broken (later calls fail at once), since its step counters are out of step.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cpu_internal.h"

#define CPU_COMM_MAGIC 0x6b696c6e636f6d31ull /* "kilncom1" */
#define CPU_COMM_SLOT ((uint64_t)1 << 20)    /* bytes per rank and step */
#define CPU_COMM_CHAN ((uint64_t)64 << 10)   /* bytes per send/recv chunk */
#define CPU_COMM_NAME_MAX 64

/* What each rank posts with a step, compared across ranks. */
typedef struct cpu_comm_desc {
  int32_t op, dtype, root, pad;
  uint64_t bytes; /* the whole call's bytes per rank */
} cpu_comm_desc_t;

typedef struct cpu_comm_rank {
  _Atomic uint64_t arrive; /* 2k+1: step k posted; 2k+2: step k read */
  _Atomic uint32_t joined;
  int32_t pid;
  cpu_comm_desc_t desc;
  char pad[64 - 8 - 4 - 4 - sizeof(cpu_comm_desc_t) % 64];
} cpu_comm_rank_t;

typedef struct cpu_comm_chan {
  _Atomic uint64_t sent;  /* chunks written */
  _Atomic uint64_t acked; /* chunks consumed */
  _Atomic uint32_t reject; /* the receiver refused the message (size mismatch) */
  uint32_t pad;
  uint64_t msg_bytes, chunk_bytes;
} cpu_comm_chan_t;

typedef struct cpu_comm_hdr {
  _Atomic uint64_t magic;
  int32_t world;
  int32_t pad;
  uint64_t total_size;
} cpu_comm_hdr_t;

struct kiln_hal_comm {
  int32_t world, rank;
  int64_t timeout_ns;
  uint64_t step; /* collective steps done */
  bool broken;
  void *base;
  size_t size;
  cpu_comm_hdr_t *hdr;
  cpu_comm_rank_t *ranks;
  cpu_comm_chan_t *chans; /* [src * world + dst] */
  uint8_t *slots;         /* [rank][CPU_COMM_SLOT] */
  uint8_t *chan_data;     /* [src * world + dst][CPU_COMM_CHAN] */
  char name[CPU_COMM_NAME_MAX];
};

enum { COLL_ALL_REDUCE = 1, COLL_ALL_GATHER, COLL_BROADCAST, COLL_SEND, COLL_RECV };

static const char *coll_name(int op) {
  switch (op) {
    case COLL_ALL_REDUCE: return "all_reduce";
    case COLL_ALL_GATHER: return "all_gather";
    case COLL_BROADCAST: return "broadcast";
    case COLL_SEND: return "send";
    case COLL_RECV: return "recv";
  }
  return "collective";
}

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

static void layout(int32_t world, size_t *off_ranks, size_t *off_chans, size_t *off_slots,
                   size_t *off_chan_data, size_t *total) {
  size_t o = align64(sizeof(cpu_comm_hdr_t));
  *off_ranks = o;
  o = align64(o + (size_t)world * sizeof(cpu_comm_rank_t));
  *off_chans = o;
  o = align64(o + (size_t)world * (size_t)world * sizeof(cpu_comm_chan_t));
  o = (o + 4095) & ~(size_t)4095;
  *off_slots = o;
  o += (size_t)world * CPU_COMM_SLOT;
  *off_chan_data = o;
  o += (size_t)world * (size_t)world * CPU_COMM_CHAN;
  *total = o;
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Sleeps a little longer each call: spin first, then 50 us .. 1 ms. */
static void backoff(unsigned *n) {
  if (*n < 200) {
    (*n)++;
    return;
  }
  long us = 50L << ((*n - 200) < 5 ? (*n - 200) : 5);
  if (us > 1000) us = 1000;
  if (*n < 210) (*n)++;
  struct timespec ts = {0, us * 1000};
  nanosleep(&ts, NULL);
}

static kiln_hal_error_t *comm_timeout(kiln_hal_comm_t *c, const char *what, const char *missing) {
  c->broken = true;
  return kiln_hal_error_new(KILN_HAL_ERR_DEVICE,
                            "%s: rank %d of %d timed out after %lld ms waiting for rank(s) %s "
                            "(crashed, hung, or never called it?); the communicator is broken",
                            what, c->rank, c->world, (long long)(c->timeout_ns / 1000000),
                            missing);
}

/* Lists the ranks whose counter (ranks[r].arrive, or joined) is below target. */
static void list_missing(kiln_hal_comm_t *c, uint64_t target, bool joined, char *buf, size_t n) {
  size_t len = 0;
  buf[0] = 0;
  for (int r = 0; r < c->world && len + 8 < n; r++) {
    uint64_t v = joined ? atomic_load(&c->ranks[r].joined) : atomic_load(&c->ranks[r].arrive);
    if (v < target) len += (size_t)snprintf(buf + len, n - len, "%s%d", len ? ", " : "", r);
  }
}

/* Waits until every rank's counter reaches target. */
static kiln_hal_error_t *wait_all(kiln_hal_comm_t *c, uint64_t target, bool joined,
                                  const char *what) {
  int64_t deadline = now_ns() + c->timeout_ns;
  unsigned n = 0;
  for (;;) {
    int r = 0;
    for (; r < c->world; r++) {
      uint64_t v = joined ? atomic_load_explicit(&c->ranks[r].joined, memory_order_acquire)
                          : atomic_load_explicit(&c->ranks[r].arrive, memory_order_acquire);
      if (v < target) break;
    }
    if (r == c->world) return NULL;
    if (n >= 200 && now_ns() > deadline) {
      char buf[256];
      list_missing(c, target, joined, buf, sizeof(buf));
      return comm_timeout(c, what, buf);
    }
    backoff(&n);
  }
}

/* Waits until *v (op: 0 '>=' target) reaches target, or times out naming `peer`. */
static kiln_hal_error_t *wait_value(kiln_hal_comm_t *c, _Atomic uint64_t *v, uint64_t target,
                                    int peer, const char *what) {
  int64_t deadline = now_ns() + c->timeout_ns;
  unsigned n = 0;
  while (atomic_load_explicit(v, memory_order_acquire) < target) {
    if (n >= 200 && now_ns() > deadline) {
      char buf[16];
      snprintf(buf, sizeof(buf), "%d", peer);
      return comm_timeout(c, what, buf);
    }
    backoff(&n);
  }
  return NULL;
}

/* ============================================================================================
 * Creation
 * ==========================================================================================*/

kiln_hal_error_t *cpu_comm_get_unique_id(kiln_hal_comm_id_t *out) {
  if (!out) return cpu_err("comm_get_unique_id: out_id is NULL");
  memset(out, 0, sizeof(*out));
  uint8_t rnd[16];
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  ssize_t got = fd >= 0 ? read(fd, rnd, sizeof(rnd)) : -1;
  if (fd >= 0) close(fd);
  if (got != (ssize_t)sizeof(rnd)) {
    /* No /dev/urandom: time, pid and an address are unique enough for a segment name. */
    uint64_t a = (uint64_t)now_ns() ^ ((uint64_t)getpid() << 32), b = (uint64_t)(uintptr_t)out;
    for (int i = 0; i < 8; i++) rnd[i] = (uint8_t)(a >> (8 * i)), rnd[8 + i] = (uint8_t)(b >> (8 * i));
  }
  char *p = (char *)out->bytes;
  int len = snprintf(p, CPU_COMM_NAME_MAX, "/kiln-comm-");
  for (int i = 0; i < 16; i++) len += snprintf(p + len, CPU_COMM_NAME_MAX - (size_t)len, "%02x", rnd[i]);
  return NULL;
}

static void comm_free(kiln_hal_comm_t *c) {
  if (c->base) munmap(c->base, c->size);
  free(c);
}

/* Opens (rank 0: creates) and maps the segment; the others wait for it to appear. */
static kiln_hal_error_t *comm_map(kiln_hal_comm_t *c, int64_t deadline) {
  size_t o_ranks, o_chans, o_slots, o_cdata, total;
  layout(c->world, &o_ranks, &o_chans, &o_slots, &o_cdata, &total);
  int fd = -1;
  if (c->rank == 0) {
    fd = shm_open(c->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
      return kiln_hal_error_new(KILN_HAL_ERR_DEVICE, "comm_create: shm_open(%s): %s (an id used twice?)",
                                c->name, strerror(errno));
    if (ftruncate(fd, (off_t)total) != 0) {
      int err = errno;
      close(fd);
      shm_unlink(c->name);
      return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "comm_create: cannot size %s to %zu bytes: %s",
                                c->name, total, strerror(err));
    }
  } else {
    unsigned n = 0;
    for (;;) {
      fd = shm_open(c->name, O_RDWR, 0600);
      if (fd >= 0) {
        struct stat st;
        if (fstat(fd, &st) == 0 && (uint64_t)st.st_size >= sizeof(cpu_comm_hdr_t)) break;
        close(fd);
        fd = -1;
      } else if (errno != ENOENT) {
        return kiln_hal_error_new(KILN_HAL_ERR_DEVICE, "comm_create: shm_open(%s): %s", c->name,
                                  strerror(errno));
      }
      if (n >= 200 && now_ns() > deadline) {
        return comm_timeout(c, "comm_create", "0 (it creates the segment)");
      }
      backoff(&n);
    }
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != total) {
    close(fd);
    return cpu_err("comm_create: rank %d: segment %s has %lld bytes, want %zu for world_size %d "
                   "(the ranks disagree on world_size)",
                   c->rank, c->name, (long long)st.st_size, total, c->world);
  }
  void *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (base == MAP_FAILED) {
    if (c->rank == 0) shm_unlink(c->name);
    return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "comm_create: mmap of %zu bytes: %s",
                              total, strerror(err));
  }
  c->base = base;
  c->size = total;
  c->hdr = base;
  c->ranks = (cpu_comm_rank_t *)((char *)base + o_ranks);
  c->chans = (cpu_comm_chan_t *)((char *)base + o_chans);
  c->slots = (uint8_t *)base + o_slots;
  c->chan_data = (uint8_t *)base + o_cdata;
  if (c->rank == 0) {
    /* ftruncate zeroed everything; the magic, written last, says the header is ready. */
    c->hdr->world = c->world;
    c->hdr->total_size = total;
    atomic_store_explicit(&c->hdr->magic, CPU_COMM_MAGIC, memory_order_release);
  } else {
    unsigned n = 0;
    while (atomic_load_explicit(&c->hdr->magic, memory_order_acquire) != CPU_COMM_MAGIC) {
      if (n >= 200 && now_ns() > deadline) return comm_timeout(c, "comm_create", "0");
      backoff(&n);
    }
    if (c->hdr->world != c->world)
      return cpu_err("comm_create: rank %d has world_size %d, rank 0 has %d", c->rank, c->world,
                     (int)c->hdr->world);
  }
  return NULL;
}

kiln_hal_error_t *cpu_comm_create(kiln_hal_device_t *device, const kiln_hal_comm_args_t *args,
                                  kiln_hal_comm_t **out) {
  if (!out) return cpu_err("comm_create: out_comm is NULL");
  *out = NULL;
  if (!device) return cpu_err("comm_create: device is NULL");
  kiln_hal_comm_args_t a;
  kiln_hal_error_t *e = kiln_hal_args_copy("comm_create", &a, sizeof(a), args);
  if (e) return e;
  if (a.world_size < 1 || a.world_size > KILN_HAL_COMM_MAX_RANKS)
    return cpu_err("comm_create: world_size %d is outside 1..%d", (int)a.world_size,
                   KILN_HAL_COMM_MAX_RANKS);
  if (a.rank < 0 || a.rank >= a.world_size)
    return cpu_err("comm_create: rank %d is outside 0..%d", (int)a.rank, (int)a.world_size - 1);
  if (a.timeout_ms < 0) return cpu_err("comm_create: timeout_ms %d is negative", (int)a.timeout_ms);
  const char *id = (const char *)a.id.bytes;
  size_t idlen = strnlen(id, CPU_COMM_NAME_MAX);
  if (idlen == CPU_COMM_NAME_MAX || strncmp(id, "/kiln-comm-", 11) != 0 || idlen < 12 ||
      strchr(id + 1, '/'))
    return cpu_err("comm_create: the id was not made by this backend's comm_get_unique_id");
  kiln_hal_comm_t *c = calloc(1, sizeof(*c));
  if (!c) return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "comm_create: out of memory");
  c->world = a.world_size;
  c->rank = a.rank;
  c->timeout_ns = (int64_t)(a.timeout_ms ? a.timeout_ms : KILN_HAL_COMM_DEFAULT_TIMEOUT_MS) * 1000000;
  memcpy(c->name, id, idlen + 1);
  int64_t deadline = now_ns() + c->timeout_ns;
  e = comm_map(c, deadline);
  if (!e) {
    c->ranks[c->rank].pid = (int32_t)getpid();
    if (atomic_exchange(&c->ranks[c->rank].joined, 1) != 0)
      e = cpu_err("comm_create: rank %d joined twice", c->rank);
    else
      e = wait_all(c, 1, true, "comm_create");
  }
  /* Everyone is in (or rank 0 gives up): the name is no longer needed. */
  if (c->rank == 0 && c->base) shm_unlink(c->name);
  if (e) {
    comm_free(c);
    return e;
  }
  *out = c;
  return NULL;
}

void cpu_comm_destroy(kiln_hal_comm_t *c) {
  if (!c) return;
  comm_free(c);
}

/* ============================================================================================
 * The collectives
 * ==========================================================================================*/

static bool dense(const kiln_hal_tensor_t *t) {
  int64_t want = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] > 1 && t->stride[i] != want) return false;
    want *= t->shape[i];
  }
  return true;
}

static kiln_hal_error_t *check_dense(const char *op, const char *name, const kiln_hal_tensor_t *t,
                                     uint32_t dtypes) {
  kiln_hal_error_t *e = kiln_hal_check_tensor(&cpu_check_env, op, name, t, dtypes, 0, true);
  if (e) return e;
  if (!dense(t)) return cpu_err("%s: %s must be dense (row-major without padding)", op, name);
  return NULL;
}

static uint64_t tensor_bytes(const kiln_hal_tensor_t *t) {
  uint64_t n = 1;
  for (int i = 0; i < t->ndim; i++) n *= (uint64_t)t->shape[i];
  return n * kiln_hal_dtype_size(t->dtype);
}

/* Validates a recorded or immediate collective on the host. */
static kiln_hal_error_t *cpu_coll_check(int op, const kiln_hal_coll_args_t *a) {
  const char *n = coll_name(op);
  kiln_hal_comm_t *c = a->comm;
  if (!c) return cpu_err("%s: comm is NULL", n);
  kiln_hal_error_t *e = NULL;
  switch (op) {
    case COLL_ALL_REDUCE:
      if ((e = check_dense(n, "src", &a->src, KILN_HAL_DT_FLOAT))) return e;
      if ((e = check_dense(n, "dst", &a->dst, KILN_HAL_DT_FLOAT))) return e;
      if (a->src.dtype != a->dst.dtype) return cpu_err("%s: src and dst dtypes differ", n);
      if ((e = kiln_hal_check_same_shape(n, "src", &a->src, "dst", &a->dst))) return e;
      if (kiln_hal_tensor_overlap(&a->src, &a->dst) && a->src.offset != a->dst.offset)
        return cpu_err("%s: src and dst overlap without being the same tensor", n);
      break;
    case COLL_ALL_GATHER: {
      if ((e = check_dense(n, "src", &a->src, KILN_HAL_DT_ANY))) return e;
      if ((e = check_dense(n, "dst", &a->dst, KILN_HAL_DT_ANY))) return e;
      if (a->src.dtype != a->dst.dtype) return cpu_err("%s: src and dst dtypes differ", n);
      bool ok = a->src.ndim == a->dst.ndim && a->dst.shape[0] == a->src.shape[0] * c->world;
      for (int i = 1; ok && i < a->src.ndim; i++) ok = a->src.shape[i] == a->dst.shape[i];
      if (!ok)
        return cpu_err("%s: dst must be src's shape with dimension 0 times world_size %d", n,
                       c->world);
      if (kiln_hal_tensor_overlap(&a->src, &a->dst) &&
          a->src.offset != a->dst.offset + (uint64_t)c->rank * tensor_bytes(&a->src))
        return cpu_err("%s: src overlaps dst without being rank %d's slice of it", n, c->rank);
      break;
    }
    case COLL_BROADCAST:
    case COLL_RECV:
      if ((e = check_dense(n, "dst", &a->dst, KILN_HAL_DT_ANY))) return e;
      break;
    case COLL_SEND:
      if ((e = check_dense(n, "src", &a->src, KILN_HAL_DT_ANY))) return e;
      break;
  }
  if (op >= COLL_BROADCAST) {
    if (a->peer < 0 || a->peer >= c->world)
      return cpu_err("%s: peer %d is outside 0..%d", n, (int)a->peer, c->world - 1);
    if (op != COLL_BROADCAST && a->peer == c->rank)
      return cpu_err("%s: peer %d is this rank", n, (int)a->peer);
  }
  if (c->broken) return kiln_hal_error_new(KILN_HAL_ERR_DEVICE, "%s: the communicator is broken by an earlier timeout", n);
  return NULL;
}

/* One step of a collective: post my descriptor (and data already in my slot), wait for all,
 * compare descriptors. On return without error the caller reads the slots, then calls
 * step_end. A mismatch still ends the step on every rank, so all ranks stay in step. */
static kiln_hal_error_t *step_begin(kiln_hal_comm_t *c, const cpu_comm_desc_t *d) {
  const char *n = coll_name(d->op);
  c->ranks[c->rank].desc = *d;
  atomic_store_explicit(&c->ranks[c->rank].arrive, 2 * c->step + 1, memory_order_release);
  kiln_hal_error_t *e = wait_all(c, 2 * c->step + 1, false, n);
  if (e) return e;
  for (int r = 0; r < c->world; r++) {
    const cpu_comm_desc_t *o = &c->ranks[r].desc;
    if (o->op != d->op || o->dtype != d->dtype || o->bytes != d->bytes || o->root != d->root) {
      e = cpu_err("%s: rank %d called %s (%s, %llu bytes, root %d) while rank %d called %s (%s, "
                  "%llu bytes, root %d): the ranks' collectives do not match",
                  n, c->rank, n, kiln_hal_dtype_name(d->dtype), (unsigned long long)d->bytes,
                  (int)d->root, r, coll_name(o->op), kiln_hal_dtype_name(o->dtype),
                  (unsigned long long)o->bytes, (int)o->root);
      break;
    }
  }
  return e;
}

static kiln_hal_error_t *step_end(kiln_hal_comm_t *c, const char *what) {
  atomic_store_explicit(&c->ranks[c->rank].arrive, 2 * c->step + 2, memory_order_release);
  kiln_hal_error_t *e = wait_all(c, 2 * c->step + 2, false, what);
  c->step++;
  return e;
}

static uint8_t *slot(kiln_hal_comm_t *c, int r) { return c->slots + (size_t)r * CPU_COMM_SLOT; }

/* dst = sum over ranks of the slots' elems elements, in F32, rank order. */
static void reduce_step(kiln_hal_comm_t *c, int32_t dtype, int64_t elems, void *dst, float *acc) {
  if (dtype == KILN_HAL_F32) {
    memcpy(acc, slot(c, 0), (size_t)elems * 4);
    for (int r = 1; r < c->world; r++) {
      const float *s = (const float *)slot(c, r);
      for (int64_t i = 0; i < elems; i++) acc[i] += s[i];
    }
    memcpy(dst, acc, (size_t)elems * 4);
    return;
  }
  enum { TILE = 1024 };
  float tmp[TILE];
  size_t es = 2;
  for (int64_t i0 = 0; i0 < elems; i0 += TILE) {
    int64_t m = elems - i0 < TILE ? elems - i0 : TILE;
    cpu_vec_to_f32(dtype, slot(c, 0) + (size_t)i0 * es, acc, m);
    for (int r = 1; r < c->world; r++) {
      cpu_vec_to_f32(dtype, slot(c, r) + (size_t)i0 * es, tmp, m);
      for (int64_t i = 0; i < m; i++) acc[i] += tmp[i];
    }
    cpu_vec_from_f32(dtype, acc, (uint8_t *)dst + (size_t)i0 * es, m);
  }
}

static kiln_hal_error_t *run_stepped(kiln_hal_stream_t *s, int op, const kiln_hal_coll_args_t *a) {
  kiln_hal_comm_t *c = a->comm;
  const char *n = coll_name(op);
  const kiln_hal_tensor_t *t = op == COLL_BROADCAST ? &a->dst : &a->src;
  uint64_t bytes = tensor_bytes(t);
  size_t es = kiln_hal_dtype_size(t->dtype);
  cpu_comm_desc_t d = {op, t->dtype, op == COLL_BROADCAST ? a->peer : -1, 0, bytes};
  uint8_t *src = op == COLL_BROADCAST ? NULL : cpu_tensor_ptr(&a->src);
  uint8_t *dst = cpu_tensor_ptr(&a->dst);
  float *acc = NULL;
  if (op == COLL_ALL_REDUCE) {
    acc = cpu_scratch(s, op == COLL_ALL_REDUCE && t->dtype == KILN_HAL_F32 ? CPU_COMM_SLOT : 4096 * 4);
    if (!acc) return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "%s: out of memory", n);
  }
  uint64_t chunk = CPU_COMM_SLOT - CPU_COMM_SLOT % es;
  /* At least one step, so a zero-size call still checks that the ranks agree. */
  uint64_t off = 0;
  do {
    uint64_t m = bytes - off < chunk ? bytes - off : chunk;
    if (op == COLL_BROADCAST) {
      if (c->rank == a->peer) memcpy(slot(c, c->rank), dst + off, (size_t)m);
    } else if (m) {
      memcpy(slot(c, c->rank), src + off, (size_t)m);
    }
    kiln_hal_error_t *e = step_begin(c, &d);
    if (!e && m) {
      if (op == COLL_ALL_REDUCE)
        reduce_step(c, t->dtype, (int64_t)(m / es), dst + off, acc);
      else if (op == COLL_BROADCAST && c->rank != a->peer)
        memcpy(dst + off, slot(c, a->peer), (size_t)m);
      else if (op == COLL_ALL_GATHER)
        for (int r = 0; r < c->world; r++) memcpy(dst + (uint64_t)r * bytes + off, slot(c, r), (size_t)m);
    }
    if (e && e->code == KILN_HAL_ERR_DEVICE) return e; /* timed out: no step_end */
    kiln_hal_error_t *e2 = step_end(c, n);
    if (e) {
      if (e2) e2->destroy(e2);
      return e;
    }
    if (e2) return e2;
    off += m;
  } while (off < bytes);
  return NULL;
}

static cpu_comm_chan_t *chan(kiln_hal_comm_t *c, int from, int to) {
  return &c->chans[(size_t)from * (size_t)c->world + (size_t)to];
}
static uint8_t *chan_buf(kiln_hal_comm_t *c, int from, int to) {
  return c->chan_data + ((size_t)from * (size_t)c->world + (size_t)to) * CPU_COMM_CHAN;
}

static kiln_hal_error_t *run_send(kiln_hal_comm_t *c, const kiln_hal_coll_args_t *a) {
  cpu_comm_chan_t *ch = chan(c, c->rank, a->peer);
  uint8_t *buf = chan_buf(c, c->rank, a->peer);
  const uint8_t *src = cpu_tensor_ptr(&a->src);
  uint64_t bytes = tensor_bytes(&a->src), off = 0;
  do {
    uint64_t m = bytes - off < CPU_COMM_CHAN ? bytes - off : CPU_COMM_CHAN;
    uint64_t sent = atomic_load_explicit(&ch->sent, memory_order_relaxed);
    memcpy(buf, src + off, (size_t)m);
    ch->msg_bytes = bytes;
    ch->chunk_bytes = m;
    atomic_store_explicit(&ch->sent, sent + 1, memory_order_release);
    kiln_hal_error_t *e = wait_value(c, &ch->acked, sent + 1, a->peer, "send");
    if (e) return e;
    if (atomic_exchange(&ch->reject, 0))
      return cpu_err("send: rank %d sent %llu bytes but rank %d's recv wants a different size",
                     c->rank, (unsigned long long)bytes, (int)a->peer);
    off += m;
  } while (off < bytes);
  return NULL;
}

static kiln_hal_error_t *run_recv(kiln_hal_comm_t *c, const kiln_hal_coll_args_t *a) {
  cpu_comm_chan_t *ch = chan(c, a->peer, c->rank);
  const uint8_t *buf = chan_buf(c, a->peer, c->rank);
  uint8_t *dst = cpu_tensor_ptr(&a->dst);
  uint64_t bytes = tensor_bytes(&a->dst), off = 0;
  do {
    uint64_t acked = atomic_load_explicit(&ch->acked, memory_order_relaxed);
    kiln_hal_error_t *e = wait_value(c, &ch->sent, acked + 1, a->peer, "recv");
    if (e) return e;
    uint64_t m = ch->chunk_bytes, total = ch->msg_bytes;
    if (total != bytes) {
      atomic_store_explicit(&ch->reject, 1, memory_order_relaxed);
      atomic_store_explicit(&ch->acked, acked + 1, memory_order_release);
      return cpu_err("recv: rank %d wants %llu bytes but rank %d sent %llu", c->rank,
                     (unsigned long long)bytes, (int)a->peer, (unsigned long long)total);
    }
    memcpy(dst + off, buf, (size_t)m);
    atomic_store_explicit(&ch->acked, acked + 1, memory_order_release);
    off += m;
  } while (off < bytes);
  return NULL;
}

kiln_hal_error_t *cpu_coll_run(kiln_hal_stream_t *s, int op, const kiln_hal_coll_args_t *a,
                               bool dry_run) {
  kiln_hal_error_t *e = cpu_coll_check(op, a);
  if (e || dry_run) return e;
  switch (op) {
    case COLL_SEND: return run_send(a->comm, a);
    case COLL_RECV: return run_recv(a->comm, a);
    default: return run_stepped(s, op, a);
  }
}
