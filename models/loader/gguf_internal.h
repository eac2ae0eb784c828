/* gguf_internal.h - the metadata of a GGUF file for readers beside gguf.c (the tokenizer in
 * gguf_vocab.c). Every value was bounds-checked against the file when it was opened, so the
 * accessors below cannot read past it.
 */
#ifndef KILN_MODELS_GGUF_INTERNAL_H
#define KILN_MODELS_GGUF_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "base/status.h"

enum gguf_value_type {
  GGUF_U8 = 0,
  GGUF_I8 = 1,
  GGUF_U16 = 2,
  GGUF_I16 = 3,
  GGUF_U32 = 4,
  GGUF_I32 = 5,
  GGUF_F32 = 6,
  GGUF_BOOL = 7,
  GGUF_STRING = 8,
  GGUF_ARRAY = 9,
  GGUF_U64 = 10,
  GGUF_I64 = 11,
  GGUF_F64 = 12,
  GGUF_TYPE_COUNT = 13,
};

typedef struct gguf_meta gguf_meta_t;

/* Maps the file and reads its header and metadata (not the tensor directory). */
kiln_status_t gguf_meta_open(const char *path, gguf_meta_t **out);
void gguf_meta_free(gguf_meta_t *m);
const char *gguf_meta_file(const gguf_meta_t *m);
uint64_t gguf_meta_count(const gguf_meta_t *m);
/* Key i (not NUL-terminated). */
const char *gguf_meta_key(const gguf_meta_t *m, uint64_t i, uint64_t *out_len);

/* Absent keys give dflt / NULL (or an error naming the key when required); a key of another
 * type is an error naming both types. */
kiln_status_t gguf_meta_int(const gguf_meta_t *m, const char *key, bool required, int64_t dflt,
                            int64_t *out);
kiln_status_t gguf_meta_str(const gguf_meta_t *m, const char *key, bool required, const char **out,
                            uint64_t *out_len);
kiln_status_t gguf_meta_bool(const gguf_meta_t *m, const char *key, bool dflt, bool *out);

/* An array whose elements are of type etype (GGUF_I32 also takes u32). count is 0 and data
 * NULL when absent. */
typedef struct gguf_meta_array {
  const uint8_t *data; /* the first element */
  uint64_t count;
  uint32_t etype;
} gguf_meta_array_t;
kiln_status_t gguf_meta_array(const gguf_meta_t *m, const char *key, bool required, uint32_t etype,
                              gguf_meta_array_t *out);
/* The string at *p (an element of a string array), advancing *p to the next one. */
const char *gguf_array_next_str(const uint8_t **p, uint64_t *out_len);
/* Element i of a 4-byte array (i32, u32, f32 bits). */
uint32_t gguf_array_u32(const gguf_meta_array_t *a, uint64_t i);

#endif /* KILN_MODELS_GGUF_INTERNAL_H */
