/* npy.h - NumPy .npy files (format 1.0/2.0) of float32 matrices: `kiln score` writes logits in
 * this format and the parity tests read the references transformers wrote.
 *
 * Only what Kiln needs: little-endian float32 ('<f4'), C order, 1 or 2 dimensions. Anything
 * else is refused with the header's text quoted. Thread-safe (no shared state). */
#ifndef KILN_CORE_NPY_H
#define KILN_CORE_NPY_H

#include <stdint.h>

#include "base/status.h"

/* Writes rows x cols float32 values (row-major) to path as a 2-D .npy file.
 * Errors: KILN_ERR_IO naming the path and strerror. */
kiln_status_t kiln_npy_write_f32(const char *path, const float *data, int64_t rows, int64_t cols);

/* Reads a 1-D or 2-D float32 .npy file. A 1-D file reads as rows = 1. *out_data is malloc'ed
 * and owned by the caller (free()). Errors: KILN_ERR_NOT_FOUND, KILN_ERR_IO,
 * KILN_ERR_INVALID_ARGUMENT (not .npy, another dtype, Fortran order, a truncated file). */
kiln_status_t kiln_npy_read_f32(const char *path, float **out_data, int64_t *out_rows,
                                int64_t *out_cols);

#endif /* KILN_CORE_NPY_H */
