/* weights.c - the tensor set shared by the safetensors and GGUF loaders: mappings, a name
 * index and conversion into the HAL's float dtypes (see weights.h). */
#define _POSIX_C_SOURCE 200809L /* open flags, fstat, mmap */
#include "models/loader/weights.h"

#include "base/arena.h"
#include "base/strbuf.h"
#include "kiln/hal_quant.h"
#include "kiln/hal_util.h"
#include "models/loader/weights_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Tensor bytes are read in the file's byte order, which both formats define as little endian. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "models/loader reads little-endian tensor data in place; big-endian hosts are unsupported"
#endif

typedef struct weights_mapping {
  void *addr;  /* NULL for an empty file */
  size_t size; /* bytes mapped */
  char *path;  /* owned; kiln_weight_t.file points here */
} weights_mapping_t;

struct kiln_weights {
  weights_mapping_t *maps;
  int64_t n_maps, cap_maps;
  kiln_weight_t *tensors; /* in insertion order; may move while loading, stable once open */
  int64_t n_tensors, cap_tensors;
  /* Open addressing, linear probing: slot holds tensor index + 1, 0 = empty. Kept at most
   * half full, so a lookup touches one or two slots on average. */
  int64_t *slots;
  uint64_t n_slots;   /* a power of two (or 0 before the first add) */
  uint64_t seed;      /* per set, so a crafted header cannot aim every name at one slot */
  kiln_arena_t names; /* the tensors' names */
};

/* FNV-1a, seeded: names are short and a checkpoint has at most tens of thousands of them. */
static uint64_t weights_hash(const kiln_weights_t *w, const char *s) {
  uint64_t h = 0xcbf29ce484222325ull ^ w->seed;
  for (; *s; s++) {
    h ^= (uint8_t)*s;
    h *= 0x100000001b3ull;
  }
  return h;
}

kiln_status_t weights_create(kiln_weights_t **out_weights) {
  *out_weights = NULL;
  kiln_weights_t *w = calloc(1, sizeof(*w));
  if (!w) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory creating a weight set");
  /* The set's own address (randomised by ASLR) is seed enough for a hash index. */
  w->seed = (uint64_t)(uintptr_t)w * 0x9e3779b97f4a7c15ull;
  *out_weights = w;
  return NULL;
}

void kiln_weights_free(kiln_weights_t *w) {
  if (!w) return;
  for (int64_t i = 0; i < w->n_maps; i++) {
    if (w->maps[i].addr) munmap(w->maps[i].addr, w->maps[i].size);
    free(w->maps[i].path);
  }
  free(w->maps);
  free(w->tensors);
  free(w->slots);
  kiln_arena_free(&w->names);
  free(w);
}

kiln_status_t weights_map_file(kiln_weights_t *w, const char *path, const uint8_t **out_data,
                               uint64_t *out_size, const char **out_file) {
  static const uint8_t empty[1] = {0};
  *out_data = NULL;
  *out_size = 0;
  *out_file = NULL;
  kiln_status_t st = NULL;
  void *addr = NULL;
  size_t size = 0;
  char *copy = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    return kiln_status_make(e == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO, "%s: %s", path,
                            strerror(e));
  }
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    st = kiln_status_make(KILN_ERR_IO, "%s: stat: %s", path, strerror(errno));
    goto fail;
  }
  if (!S_ISREG(sb.st_mode)) {
    st = kiln_status_make(KILN_ERR_IO, "%s: not a regular file", path);
    goto fail;
  }
  if ((uintmax_t)sb.st_size > (uintmax_t)SIZE_MAX) {
    st = kiln_status_make(KILN_ERR_IO, "%s: too large to map (%jd bytes)", path,
                          (intmax_t)sb.st_size);
    goto fail;
  }
  size = (size_t)sb.st_size;
  if (size > 0) {
    addr = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (addr == MAP_FAILED) {
      addr = NULL;
      st = kiln_status_make(KILN_ERR_IO, "%s: mmap of %zu bytes failed: %s", path, size,
                            strerror(errno));
      goto fail;
    }
  }
  copy = strdup(path);
  if (!copy) goto oom;
  if (w->n_maps == w->cap_maps) {
    int64_t cap = w->cap_maps ? w->cap_maps * 2 : 4;
    weights_mapping_t *m = realloc(w->maps, (size_t)cap * sizeof(*m));
    if (!m) goto oom;
    w->maps = m;
    w->cap_maps = cap;
  }
  w->maps[w->n_maps++] = (weights_mapping_t){addr, size, copy};
  close(fd);
  *out_data = addr ? (const uint8_t *)addr : empty;
  *out_size = size;
  *out_file = copy;
  return NULL;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
fail:
  free(copy);
  if (addr) munmap(addr, size);
  close(fd);
  return st;
}

uint64_t weights_type_nbytes(int32_t type, int64_t numel) {
  if (numel < 0) return UINT64_MAX;
  uint64_t n = (uint64_t)numel;
  switch (type) {
    case KILN_WTYPE_F32:
    case KILN_WTYPE_I32: return n > UINT64_MAX / 4 ? UINT64_MAX : n * 4;
    case KILN_WTYPE_F16:
    case KILN_WTYPE_BF16: return n > UINT64_MAX / 2 ? UINT64_MAX : n * 2;
    case KILN_WTYPE_F8_E4M3:
    case KILN_WTYPE_F8_E5M2: return n;
    default: {
      int32_t fmt = kiln_wtype_qfmt(type);
      uint64_t be = (uint64_t)kiln_hal_qfmt_block_elems(fmt);
      if (!be || n % be) return UINT64_MAX;
      return n / be * (uint64_t)kiln_hal_qfmt_block_bytes(fmt);
    }
  }
}

int32_t kiln_wtype_qfmt(int32_t type) {
  switch (type) {
    case KILN_WTYPE_Q8_0: return KILN_HAL_QFMT_Q8_0;
    case KILN_WTYPE_Q4_0: return KILN_HAL_QFMT_Q4_0;
    case KILN_WTYPE_Q4_K: return KILN_HAL_QFMT_Q4_K;
    case KILN_WTYPE_Q5_K: return KILN_HAL_QFMT_Q5_K;
    case KILN_WTYPE_Q6_K: return KILN_HAL_QFMT_Q6_K;
    default: return KILN_HAL_QFMT_NONE;
  }
}

int64_t kiln_wtype_block_elems(int32_t type) {
  int32_t fmt = kiln_wtype_qfmt(type);
  return fmt == KILN_HAL_QFMT_NONE ? 1 : kiln_hal_qfmt_block_elems(fmt);
}

/* Rebuilds the index with n_slots slots (a power of two > 2 * n_tensors). */
static bool weights_rehash(kiln_weights_t *w, uint64_t n_slots) {
  int64_t *slots = calloc(n_slots, sizeof(*slots));
  if (!slots) return false;
  for (int64_t i = 0; i < w->n_tensors; i++) {
    uint64_t j = weights_hash(w, w->tensors[i].name) & (n_slots - 1);
    while (slots[j]) j = (j + 1) & (n_slots - 1);
    slots[j] = i + 1;
  }
  free(w->slots);
  w->slots = slots;
  w->n_slots = n_slots;
  return true;
}

const kiln_weight_t *kiln_weights_find(const kiln_weights_t *w, const char *name) {
  if (!w || !name || !w->n_slots) return NULL;
  uint64_t j = weights_hash(w, name) & (w->n_slots - 1);
  for (; w->slots[j]; j = (j + 1) & (w->n_slots - 1)) {
    const kiln_weight_t *t = &w->tensors[w->slots[j] - 1];
    if (strcmp(t->name, name) == 0) return t;
  }
  return NULL;
}

kiln_status_t weights_add(kiln_weights_t *w, const char *name, int32_t type, int ndim,
                          const int64_t *shape, const uint8_t *data, uint64_t nbytes,
                          const char *file) {
  const kiln_weight_t *dup = kiln_weights_find(w, name);
  if (dup)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: tensor %s is listed twice (also in %s)",
                            file, name, dup->file);
  if (ndim < 1 || ndim > KILN_WEIGHT_MAX_DIMS)
    return kiln_status_make(KILN_ERR_INTERNAL, "%s: tensor %s: %d dimensions", file, name, ndim);
  int64_t numel = 1;
  for (int i = 0; i < ndim; i++) numel *= shape[i]; /* the loaders checked for overflow */
  /* Grow the index first so that a failure leaves the set unchanged. */
  if ((uint64_t)(w->n_tensors + 1) * 2 > w->n_slots &&
      !weights_rehash(w, w->n_slots ? w->n_slots * 2 : 64))
    goto oom;
  if (w->n_tensors == w->cap_tensors) {
    int64_t cap = w->cap_tensors ? w->cap_tensors * 2 : 64;
    kiln_weight_t *t = realloc(w->tensors, (size_t)cap * sizeof(*t));
    if (!t) goto oom;
    w->tensors = t;
    w->cap_tensors = cap;
  }
  char *copy = kiln_arena_strndup(&w->names, name, strlen(name));
  if (!copy) goto oom;
  kiln_weight_t *t = &w->tensors[w->n_tensors];
  memset(t, 0, sizeof(*t));
  t->name = copy;
  t->type = type;
  t->ndim = ndim;
  for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
  t->numel = numel;
  t->data = data;
  t->nbytes = nbytes;
  t->file = file;
  uint64_t j = weights_hash(w, copy) & (w->n_slots - 1);
  while (w->slots[j]) j = (j + 1) & (w->n_slots - 1);
  w->slots[j] = ++w->n_tensors;
  return NULL;
oom:
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory adding tensor %s", file, name);
}

int64_t kiln_weights_count(const kiln_weights_t *w) { return w ? w->n_tensors : 0; }

const kiln_weight_t *kiln_weights_at(const kiln_weights_t *w, int64_t i) {
  if (!w || i < 0 || i >= w->n_tensors) return NULL;
  return &w->tensors[i];
}

const char *kiln_wtype_name(int32_t type) {
  switch (type) {
    case KILN_WTYPE_F32: return "f32";
    case KILN_WTYPE_F16: return "f16";
    case KILN_WTYPE_BF16: return "bf16";
    case KILN_WTYPE_I32: return "i32";
    case KILN_WTYPE_F8_E4M3: return "f8_e4m3";
    case KILN_WTYPE_F8_E5M2: return "f8_e5m2";
    case KILN_WTYPE_Q8_0:
    case KILN_WTYPE_Q4_0:
    case KILN_WTYPE_Q4_K:
    case KILN_WTYPE_Q5_K:
    case KILN_WTYPE_Q6_K: return kiln_hal_qfmt_name(kiln_wtype_qfmt(type));
    default: return "unknown";
  }
}

/* ---- conversion ------------------------------------------------------------------------------
 *
 * The mapped data has no alignment guarantee (a safetensors header may have any length), so
 * every element is loaded with memcpy, which compilers turn into one unaligned load.
 */

static inline uint16_t load_u16(const uint8_t *p) {
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
}

static inline float load_f32(const uint8_t *p) {
  float v;
  memcpy(&v, p, 4);
  return v;
}

/* Decodes n elements of src (the first one at src; for a block type n is whole blocks and src
 * a block start) into f32, exactly: every f16/bf16 value is an f32, and the block types decode
 * as kiln/hal_quant.h defines them (Q8_0 value j of a block = f16 scale * int8 q[j], as
 * llama.cpp's dequantize_row_q8_0 computes it). */
static void decode_f32(const uint8_t *src, int32_t type, int64_t n, float *out) {
  switch (type) {
    case KILN_WTYPE_F32:
      for (int64_t i = 0; i < n; i++) out[i] = load_f32(src + i * 4);
      break;
    case KILN_WTYPE_F16:
      for (int64_t i = 0; i < n; i++) out[i] = kiln_hal_f16_to_f32(load_u16(src + i * 2));
      break;
    case KILN_WTYPE_BF16:
      for (int64_t i = 0; i < n; i++) out[i] = kiln_hal_bf16_to_f32(load_u16(src + i * 2));
      break;
    default: { /* a block type */
      const int32_t fmt = kiln_wtype_qfmt(type);
      const int64_t be = kiln_hal_qfmt_block_elems(fmt), bb = kiln_hal_qfmt_block_bytes(fmt);
      for (int64_t b = 0; b < n / be; b++) kiln_hal_quant_dequant(fmt, src + b * bb, out + b * be);
      break;
    }
  }
}

/* Rounds n f32 values to a 16-bit dtype (nearest even). */
static void encode_16(const float *in, int64_t n, int32_t dst_dtype, uint16_t *out) {
  if (dst_dtype == KILN_HAL_F16) {
    for (int64_t i = 0; i < n; i++) out[i] = kiln_hal_f32_to_f16(in[i]);
  } else {
    for (int64_t i = 0; i < n; i++) out[i] = kiln_hal_f32_to_bf16(in[i]);
  }
}

kiln_status_t kiln_weight_convert(const kiln_weight_t *w, int64_t first, int64_t n,
                                  int32_t dst_dtype, void *dst) {
  if (!w || (!dst && n > 0))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "kiln_weight_convert: NULL argument");
  if (first < 0 || n < 0 || first > w->numel || n > w->numel - first)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s: %lld elements from element %lld lie outside its %lld",
                            w->file, w->name, (long long)n, (long long)first, (long long)w->numel);
  if (dst_dtype != KILN_HAL_F32 && dst_dtype != KILN_HAL_F16 && dst_dtype != KILN_HAL_BF16)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s: cannot convert to dtype %d (only f32, f16, bf16)",
                            w->file, w->name, (int)dst_dtype);
  if (w->type < 0 || w->type >= KILN_WTYPE_COUNT)
    return kiln_status_make(KILN_ERR_INTERNAL, "%s: tensor %s has unknown type %d", w->file,
                            w->name, (int)w->type);
  if (w->type == KILN_WTYPE_I32)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s is i32 (packed quantized data), not a float tensor",
                            w->file, w->name);
  if (w->type == KILN_WTYPE_F8_E4M3 || w->type == KILN_WTYPE_F8_E5M2)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s is %s (FP8 codes, which need their scales: a "
                            "quantization_config), not a float tensor",
                            w->file, w->name, kiln_wtype_name(w->type));
  const int64_t be = kiln_wtype_block_elems(w->type);
  if (first % be || n % be)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s is %s: %lld elements from element %lld are not whole "
                            "blocks of %lld",
                            w->file, w->name, kiln_wtype_name(w->type), (long long)n,
                            (long long)first, (long long)be);
  if (n == 0) return NULL;
  /* kiln_wtype_t and the HAL's float dtypes share their numbering for F32/F16/BF16. */
  _Static_assert((int)KILN_WTYPE_F32 == (int)KILN_HAL_F32 &&
                     (int)KILN_WTYPE_F16 == (int)KILN_HAL_F16 &&
                     (int)KILN_WTYPE_BF16 == (int)KILN_HAL_BF16,
                 "wtype and HAL dtype numbering differ");
  const bool blocks = be > 1;
  /* es: bytes per element (float types) or per block (block types) */
  const int64_t es = w->type == KILN_WTYPE_F32
                         ? 4
                         : blocks ? kiln_hal_qfmt_block_bytes(kiln_wtype_qfmt(w->type)) : 2;
  const uint8_t *src = w->data + first / be * es;
  if (w->type == dst_dtype) { /* the same type: the bytes as they are */
    memcpy(dst, src, (size_t)(n * es));
    return NULL;
  }
  if (dst_dtype == KILN_HAL_F32) { /* exact: decode straight into dst */
    decode_f32(src, w->type, n, dst);
    return NULL;
  }
  /* To f16/bf16: decode a chunk to f32 on the stack, then round it. */
  enum { CHUNK = 512 }; /* a multiple of 256, so block-type chunks are whole blocks */
  float tmp[CHUNK];
  uint16_t *out = dst;
  for (int64_t done = 0; done < n; done += CHUNK) {
    int64_t k = n - done < CHUNK ? n - done : CHUNK;
    decode_f32(src + done / be * es, w->type, k, tmp);
    encode_16(tmp, k, dst_dtype, out + done);
  }
  return NULL;
}

static void append_shape(kiln_strbuf_t *b, int ndim, const int64_t *shape) {
  kiln_strbuf_append_char(b, '[');
  for (int i = 0; i < ndim; i++)
    kiln_strbuf_printf(b, "%s%lld", i ? ", " : "", (long long)shape[i]);
  kiln_strbuf_append_char(b, ']');
}

kiln_status_t kiln_weight_expect_shape(const kiln_weight_t *w, int ndim, const int64_t *shape) {
  bool same = w->ndim == ndim;
  for (int i = 0; same && i < ndim; i++) same = w->shape[i] == shape[i];
  if (same) return NULL;
  kiln_strbuf_t have = KILN_STRBUF_INIT, want = KILN_STRBUF_INIT;
  append_shape(&have, w->ndim, w->shape);
  append_shape(&want, ndim, shape);
  kiln_status_t st;
  if (kiln_strbuf_ok(&have) && kiln_strbuf_ok(&want))
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: tensor %s has shape %s, want %s", w->file,
                          w->name, kiln_strbuf_cstr(&have), kiln_strbuf_cstr(&want));
  else
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: tensor %s has the wrong shape", w->file,
                          w->name);
  kiln_strbuf_free(&have);
  kiln_strbuf_free(&want);
  return st;
}
