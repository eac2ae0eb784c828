/* weights_internal.h - how loaders build a kiln_weights_t (shared by safetensors.c and
 * gguf.c; not part of any public interface). */
#ifndef KILN_MODELS_WEIGHTS_INTERNAL_H
#define KILN_MODELS_WEIGHTS_INTERNAL_H

#include "models/loader/weights.h"

/* An empty set. */
kiln_status_t weights_create(kiln_weights_t **out_weights);

/* Maps path read-only and keeps the mapping for the set's life. *out_data and *out_size describe
 * the whole file; *out_file is the set's copy of the path (for kiln_weight_t.file).
 * Errors: KILN_ERR_NOT_FOUND, KILN_ERR_IO (with strerror). An empty file maps as size 0. */
kiln_status_t weights_map_file(kiln_weights_t *w, const char *path, const uint8_t **out_data,
                               uint64_t *out_size, const char **out_file);

/* Adds a tensor (the name is copied). Errors: a duplicate name (KILN_ERR_INVALID_ARGUMENT,
 * naming both files), OOM. nbytes must already have been checked against the mapping. */
kiln_status_t weights_add(kiln_weights_t *w, const char *name, int32_t type, int ndim,
                          const int64_t *shape, const uint8_t *data, uint64_t nbytes,
                          const char *file);

/* Bytes that numel elements of type occupy (Q8_0: numel must be a multiple of 32), or
 * UINT64_MAX when numel is invalid for the type. */
uint64_t weights_type_nbytes(int32_t type, int64_t numel);

#endif /* KILN_MODELS_WEIGHTS_INTERNAL_H */
