/* safetensors.c - Hugging Face .safetensors files and sharded model.safetensors.index.json.
 *
 * A file is an 8-byte little-endian header length N, N bytes of JSON
 * {name: {"dtype", "shape", "data_offsets": [begin, end)}, "__metadata__": {...}}, then the data
 * region the offsets are relative to. Every entry is checked against the file before it is
 * added (dtype, shape, byte count, bounds, overlap), so a tensor's data pointer can be read
 * without further checks.
 */
#define _POSIX_C_SOURCE 200809L /* stat */
#include "base/json.h"
#include "base/strbuf.h"
#include "models/loader/weights.h"
#include "models/loader/weights_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* A tensor's byte range in the data region, for the overlap check. */
typedef struct st_range {
  uint64_t begin, end;
  const char *name; /* borrowed from the header document */
} st_range_t;

/* "a number", "an object": for messages about JSON values. */
static const char *json_kind(const kiln_json_t *v) {
  switch (kiln_json_type(v)) {
    case KILN_JSON_NULL: return "null";
    case KILN_JSON_BOOL: return "a bool";
    case KILN_JSON_NUMBER: return "a number";
    case KILN_JSON_STRING: return "a string";
    case KILN_JSON_ARRAY: return "an array";
    default: return "an object";
  }
}

static uint64_t read_le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

static int range_cmp(const void *a, const void *b) {
  const st_range_t *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return x->end < y->end ? -1 : x->end > y->end;
}

/* A JSON number that is an integer in [0, INT64_MAX]. */
static bool json_uint(const kiln_json_t *v, int64_t *out) {
  return kiln_json_number_is_int(v) && kiln_json_int64(v, out) && *out >= 0;
}

/* Checks one header entry and adds it. data_start is the file offset of the data region. */
static kiln_status_t st_tensor(kiln_weights_t *w, const char *file, const char *name,
                               const kiln_json_t *v, const uint8_t *data, uint64_t size,
                               uint64_t data_start, st_range_t *out_range) {
  if (!kiln_json_is(v, KILN_JSON_OBJECT))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s: the header entry is %s, want an object", file, name,
                            json_kind(v));
  const char *dtype = kiln_json_string(kiln_json_get(v, "dtype"), NULL);
  if (!dtype)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s: \"dtype\" is missing or not a string", file, name);
  int32_t type;
  if (strcmp(dtype, "F32") == 0) {
    type = KILN_WTYPE_F32;
  } else if (strcmp(dtype, "F16") == 0) {
    type = KILN_WTYPE_F16;
  } else if (strcmp(dtype, "BF16") == 0) {
    type = KILN_WTYPE_BF16;
  } else if (strcmp(dtype, "I32") == 0) { /* GPTQ / AWQ packed tensors */
    type = KILN_WTYPE_I32;
  } else if (strcmp(dtype, "F8_E4M3") == 0) { /* FP8 weight codes */
    type = KILN_WTYPE_F8_E4M3;
  } else if (strcmp(dtype, "F8_E5M2") == 0) { /* refused by the FP8 loader, naming it */
    type = KILN_WTYPE_F8_E5M2;
  } else {
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s: dtype %s is not supported (only F32, F16, BF16 and, "
                            "for quantized checkpoints, I32 and F8_E4M3)",
                            file, name, dtype);
  }

  const kiln_json_t *shape_v = kiln_json_get(v, "shape");
  if (!kiln_json_is(shape_v, KILN_JSON_ARRAY))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s: \"shape\" is missing or not an array", file, name);
  size_t ndim = kiln_json_len(shape_v);
  if (ndim > KILN_WEIGHT_MAX_DIMS)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s has %zu dimensions; at most %d are supported", file,
                            name, ndim, KILN_WEIGHT_MAX_DIMS);
  /* A scalar (shape []) holds one element; kiln_weight_t has no 0-d form, so it reads as [1]. */
  int64_t shape[KILN_WEIGHT_MAX_DIMS] = {1};
  int64_t numel = 1;
  for (size_t i = 0; i < ndim; i++) {
    if (!json_uint(kiln_json_at(shape_v, i), &shape[i]))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: tensor %s: shape[%zu] is not a non-negative integer", file, name,
                              i);
    if (shape[i] > 0 && numel > INT64_MAX / shape[i])
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: tensor %s: the shape has too many elements", file, name);
    numel *= shape[i];
  }
  if (ndim == 0) ndim = 1;

  const kiln_json_t *off = kiln_json_get(v, "data_offsets");
  int64_t begin, end;
  if (!kiln_json_is(off, KILN_JSON_ARRAY) || kiln_json_len(off) != 2 ||
      !json_uint(kiln_json_at(off, 0), &begin) || !json_uint(kiln_json_at(off, 1), &end))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s: \"data_offsets\" must be [begin, end] with "
                            "non-negative integers",
                            file, name);
  if (begin > end)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s: data_offsets [%lld, %lld) end before they begin", file,
                            name, (long long)begin, (long long)end);
  uint64_t nbytes = weights_type_nbytes(type, numel);
  if ((uint64_t)(end - begin) != nbytes)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s: data_offsets [%lld, %lld) span %lld bytes, but %lld "
                            "%s elements take %llu",
                            file, name, (long long)begin, (long long)end, (long long)(end - begin),
                            (long long)numel, dtype, (unsigned long long)nbytes);
  /* data_start <= size and end < 2^63, so neither sum overflows. */
  if (data_start + (uint64_t)end > size)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s: data [%llu, %llu) lies beyond the end of the file "
                            "(%llu bytes): the file is truncated",
                            file, name, (unsigned long long)(data_start + (uint64_t)begin),
                            (unsigned long long)(data_start + (uint64_t)end),
                            (unsigned long long)size);
  *out_range = (st_range_t){(uint64_t)begin, (uint64_t)end, name};
  return weights_add(w, name, type, (int)ndim, shape, data + data_start + (uint64_t)begin, nbytes,
                     file);
}

/* Maps path, checks its header and adds every tensor in it to w. */
static kiln_status_t st_load_file(kiln_weights_t *w, const char *path) {
  const uint8_t *data;
  uint64_t size;
  const char *file;
  kiln_status_t st = weights_map_file(w, path, &data, &size, &file);
  if (st) return st;
  if (size < 8)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: %llu bytes is too short for a safetensors file (it starts with "
                            "an 8-byte header length): the file is truncated",
                            file, (unsigned long long)size);
  uint64_t n = read_le64(data);
  if (n > size - 8)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: the header length %llu runs past the end of the file (%llu "
                            "bytes): the file is truncated or not a safetensors file",
                            file, (unsigned long long)n, (unsigned long long)size);
  kiln_json_doc_t *doc = NULL;
  st_range_t *ranges = NULL;
  st = kiln_json_parse((const char *)data + 8, (size_t)n, file, &doc);
  if (st) goto done;
  const kiln_json_t *root = kiln_json_root(doc);
  if (!kiln_json_is(root, KILN_JSON_OBJECT)) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: the header is %s, want an object", file,
                          json_kind(root));
    goto done;
  }
  size_t count = kiln_json_len(root), n_ranges = 0;
  ranges = malloc((count ? count : 1) * sizeof(*ranges));
  if (!ranges) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", file);
    goto done;
  }
  for (size_t i = 0; i < count; i++) {
    size_t klen;
    const char *name = kiln_json_key_at(root, i, &klen);
    const kiln_json_t *v = kiln_json_value_at(root, i);
    if (strcmp(name, "__metadata__") == 0) continue;
    if (klen != strlen(name) || klen == 0) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: the header names a tensor \"%s\" that is empty or holds a NUL",
                            file, name);
      goto done;
    }
    st = st_tensor(w, file, name, v, data, size, 8 + n, &ranges[n_ranges]);
    if (st) goto done;
    n_ranges++;
  }
  /* Two tensors sharing bytes would alias silently: refuse (empty tensors take no bytes). */
  qsort(ranges, n_ranges, sizeof(*ranges), range_cmp);
  const st_range_t *prev = NULL;
  for (size_t i = 0; i < n_ranges; i++) {
    if (ranges[i].begin == ranges[i].end) continue;
    if (prev && ranges[i].begin < prev->end) {
      st = kiln_status_make(
          KILN_ERR_INVALID_ARGUMENT, "%s: tensors %s [%llu, %llu) and %s [%llu, %llu) overlap",
          file, prev->name, (unsigned long long)prev->begin, (unsigned long long)prev->end,
          ranges[i].name, (unsigned long long)ranges[i].begin, (unsigned long long)ranges[i].end);
      goto done;
    }
    prev = &ranges[i];
  }
done:
  free(ranges);
  kiln_json_doc_free(doc);
  return st;
}

kiln_status_t kiln_weights_open_safetensors(const char *path, kiln_weights_t **out_weights) {
  *out_weights = NULL;
  kiln_weights_t *w;
  kiln_status_t st = weights_create(&w);
  if (st) return st;
  st = st_load_file(w, path);
  if (st) {
    kiln_weights_free(w);
    return st;
  }
  *out_weights = w;
  return NULL;
}

/* ---- sharded checkpoints ------------------------------------------------------------------ */

/* A shard's name is a file in the model directory: anything that could lead out of it (a '/',
 * "..") or that is not a C string is refused. */
static bool shard_name_ok(const char *s, size_t len) {
  return len > 0 && len == strlen(s) && !strchr(s, '/') && strcmp(s, ".") != 0 &&
         strcmp(s, "..") != 0;
}

static uint64_t str_hash(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
  return h;
}

static kiln_status_t st_open_index(const char *dir, const char *index_path,
                                   kiln_weights_t **out_weights) {
  kiln_weights_t *w = NULL;
  kiln_json_doc_t *doc = NULL;
  const char **shards = NULL; /* distinct shard names, in order of first mention */
  const char **first = NULL;  /* a tensor that each shard holds, for messages */
  char **paths = NULL;        /* dir/shard */
  int64_t *slots = NULL;      /* hash of shard name -> index + 1 */
  size_t *shard_of = NULL;    /* per weight_map entry */
  size_t n_shards = 0, n = 0, n_slots = 0;
  kiln_status_t st = kiln_json_parse_file(index_path, &doc);
  if (st) goto done;
  const kiln_json_t *map = kiln_json_get(kiln_json_root(doc), "weight_map");
  if (!kiln_json_is(map, KILN_JSON_OBJECT)) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s: \"weight_map\" is missing or not an object", index_path);
    goto done;
  }
  n = kiln_json_len(map);
  if (n == 0) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: \"weight_map\" lists no tensors",
                          index_path);
    goto done;
  }
  for (n_slots = 16; n_slots < 2 * n; n_slots *= 2) continue;
  shards = malloc(n * sizeof(*shards));
  first = malloc(n * sizeof(*first));
  paths = calloc(n, sizeof(*paths));
  slots = calloc(n_slots, sizeof(*slots));
  shard_of = malloc(n * sizeof(*shard_of));
  if (!shards || !first || !paths || !slots || !shard_of) goto oom;
  for (size_t i = 0; i < n; i++) {
    size_t klen, slen = 0;
    const char *name = kiln_json_key_at(map, i, &klen);
    const char *shard = kiln_json_string(kiln_json_value_at(map, i), &slen);
    if (klen != strlen(name) || klen == 0) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: weight_map names a tensor \"%s\" that is empty or holds a NUL",
                            index_path, name);
      goto done;
    }
    if (!shard) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: weight_map: tensor %s: the shard is not a string", index_path,
                            name);
      goto done;
    }
    if (!shard_name_ok(shard, slen)) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: weight_map: tensor %s: shard \"%s\" is not a file name in the "
                            "model directory",
                            index_path, name, shard);
      goto done;
    }
    uint64_t j = str_hash(shard) & (n_slots - 1);
    while (slots[j] && strcmp(shards[slots[j] - 1], shard) != 0) j = (j + 1) & (n_slots - 1);
    if (!slots[j]) {
      shards[n_shards] = shard;
      first[n_shards] = name;
      paths[n_shards] = kiln_strprintf("%s/%s", dir, shard);
      if (!paths[n_shards]) goto oom;
      slots[j] = (int64_t)++n_shards;
    }
    shard_of[i] = (size_t)slots[j] - 1;
  }

  st = weights_create(&w);
  if (st) goto done;
  for (size_t s = 0; s < n_shards; s++) {
    st = st_load_file(w, paths[s]);
    if (kiln_status_code(st) == KILN_ERR_NOT_FOUND) {
      kiln_status_free(st);
      st = kiln_status_make(KILN_ERR_NOT_FOUND,
                            "%s: shard %s is missing (it holds tensor %s, listed in %s)", paths[s],
                            shards[s], first[s], index_path);
    }
    if (st) goto done;
  }
  /* Every tensor the index lists must come from the shard it names. */
  for (size_t i = 0; i < n; i++) {
    const char *name = kiln_json_key_at(map, i, NULL);
    const kiln_weight_t *t = kiln_weights_find(w, name);
    const char *want = paths[shard_of[i]];
    if (!t) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s is listed in shard %s, but %s does not contain it",
                            index_path, name, shards[shard_of[i]], want);
      goto done;
    }
    if (strcmp(t->file, want) != 0) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s is listed in shard %s, but it is in %s", index_path,
                            name, want, t->file);
      goto done;
    }
  }
  goto done;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", index_path);
done:
  if (paths)
    for (size_t s = 0; s < n_shards; s++) free(paths[s]);
  free(paths);
  free(shards);
  free(first);
  free(slots);
  free(shard_of);
  kiln_json_doc_free(doc);
  if (st) {
    kiln_weights_free(w);
    w = NULL;
  }
  *out_weights = w;
  return st;
}

kiln_status_t kiln_weights_open_dir(const char *dir, kiln_weights_t **out_weights) {
  *out_weights = NULL;
  kiln_status_t st = NULL;
  char *index_path = kiln_strprintf("%s/model.safetensors.index.json", dir);
  char *single_path = kiln_strprintf("%s/model.safetensors", dir);
  if (!index_path || !single_path) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", dir);
    goto done;
  }
  struct stat sb;
  if (stat(index_path, &sb) == 0) {
    st = st_open_index(dir, index_path, out_weights);
    goto done;
  }
  if (errno != ENOENT && errno != ENOTDIR) {
    st = kiln_status_make(KILN_ERR_IO, "%s: %s", index_path, strerror(errno));
    goto done;
  }
  st = kiln_weights_open_safetensors(single_path, out_weights);
  if (kiln_status_code(st) == KILN_ERR_NOT_FOUND) {
    kiln_status_free(st);
    st = kiln_status_make(KILN_ERR_NOT_FOUND,
                          "%s: no safetensors weights: looked for %s and %s, and neither exists",
                          dir, index_path, single_path);
  }
done:
  free(index_path);
  free(single_path);
  return st;
}
