/* ops_harness.h - shared machinery of the op conformance suite (test_ops): the backends under
 * test, random inputs, device buffers with host mirrors and NaN poison, and comparisons that
 * report the backend, op, dtype and case of every mismatch.
 *
 * Buffers. An oh_buf_t is a device buffer plus three host arrays of the same size:
 *   host  what the bytes the op must NOT write should still hold afterwards: 0xFF (poison)
 *         for outputs, the uploaded input for in-place operands;
 *   got   the buffer's contents as last downloaded (oh_pull);
 *   mask  bytes the op is expected to write (marked with oh_mark*, checked by value).
 * oh_check_rest() then requires every unmarked byte of `got` to equal `host`. All buffers of a
 * test are tracked and released by oh_free_all() / oh_test_end().
 *
 * Failures. Checks never abort the test: each mismatch is printed with the current case label
 * (oh_case) and counted; oh_test_end() fails the cmocka test when the count is non-zero, so one
 * run reports every broken case at once. Not thread-safe (the suite is single-threaded).
 */
#ifndef KILN_TESTS_OPS_HARNESS_H
#define KILN_TESTS_OPS_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kiln/hal_util.h"

#define OH_MAX_BACKENDS 8

/* One backend under test: its table, device 0 and one stream. */
typedef struct oh_backend {
  const char *name;
  const kiln_hal_backend_t *t; /* borrowed from the registry */
  kiln_hal_device_t *dev;
  kiln_hal_stream_t *stream;
  kiln_hal_device_info_t info;
} oh_backend_t;

extern oh_backend_t oh_backends[OH_MAX_BACKENDS];
extern int oh_num_backends;
extern uint64_t oh_seed;

/* Quick mode, under valgrind or with KILN_TEST_QUICK=1: cases bigger than OH_QUICK_WORK
 * multiply-adds are skipped (and counted). The valgrind pass looks for leaks and uninitialised
 * reads, which the small cases reach as well; the release and sanitizer runs keep every case. */
#define OH_QUICK_WORK 1.0e6
extern bool oh_quick;
/* True (and counted as skipped) when quick mode is on and `work` exceeds OH_QUICK_WORK. */
bool oh_skip_big(double work);

/* Loads the registry, opens every usable backend (restricted by $KILN_TEST_BACKENDS) and
 * prints them. Returns the number of backends under test. *out_why is NULL when all is well,
 * else a static explanation of why the suite must fail (no backend at all, or one that was
 * asked for or found usable could not be opened). */
int oh_setup(const char **out_why);
void oh_teardown(void);

/* The float dtypes in test order, and whether `be` accepts `dtype` (F32 always; F16/BF16 per
 * CAP_F16/CAP_BF16). A skipped dtype is announced once per backend. */
extern const int32_t oh_float_dtypes[3];
bool oh_dtype_ok(const oh_backend_t *be, int32_t dtype);

/* ---- test bookkeeping ---------------------------------------------------------------------- */

/* Starts a test: reseeds the generator from oh_seed and the test's name (so a test run alone
 * with the same seed sees the same inputs) and clears the failure count. */
void oh_test_begin(const char *name);
/* Releases the test's buffers and fails the cmocka test if any check failed. */
void oh_test_end(void);

/* Sets the label printed with every failure: "[backend] op dtype: case". */
void oh_case(const oh_backend_t *be, const char *op, int32_t dtype, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Records a failure of the current case. */
void oh_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int oh_failure_count(void);
/* True when err is NULL; otherwise records "<what> failed: CODE: message" and frees err. */
bool oh_ok(kiln_hal_error_t *err, const char *what);
/* Expects an error from an op given bad arguments: non-NULL, INVALID_ARGUMENT or UNSUPPORTED,
 * with a non-empty message. Frees it. Returns true when the expectation held. */
bool oh_expect_error(kiln_hal_error_t *err, const char *what);

/* ---- random numbers (xoshiro256**, seeded per test) ---------------------------------------- */

uint64_t oh_rand_u64(void);
double oh_rand_uniform(double lo, double hi);
int64_t oh_rand_int(int64_t lo, int64_t hi); /* inclusive */
void oh_rand_fill(double *v, int64_t n, double lo, double hi);
void oh_shuffle_i32(int32_t *v, int64_t n);

/* ---- buffers --------------------------------------------------------------------------------- */

typedef struct oh_buf {
  const oh_backend_t *be;
  kiln_hal_buffer_t *b;
  size_t size;
  uint8_t *host, *got, *mask;
} oh_buf_t;

/* A poisoned buffer of `bytes` bytes (device filled with 0xFF through the backend's fill,
 * host mirror 0xFF). Never NULL: allocation failure aborts the test binary. */
oh_buf_t *oh_buf_new(const oh_backend_t *be, size_t bytes);
/* Frees every buffer created since the last call. */
void oh_free_all(void);

/* A view: dense row-major when stride is NULL. */
kiln_hal_tensor_t oh_view(const oh_buf_t *b, uint64_t byte_offset, int32_t dtype, int ndim,
                          const int64_t *shape, const int64_t *stride);
kiln_hal_tensor_t oh_absent(void);
/* Element count and flat element offset of the n-th element (row-major order over shape). */
int64_t oh_numel(const kiln_hal_tensor_t *v);

/* Writes vals (dense, row-major over v's shape) into b's host mirror through view v. Float
 * values are rounded to v's dtype in place, so the reference sees exactly what is stored;
 * integer dtypes take (int64_t)vals[i]. */
void oh_write(oh_buf_t *b, const kiln_hal_tensor_t *v, double *vals);
void oh_write_i32(oh_buf_t *b, const kiln_hal_tensor_t *v, const int32_t *vals);
/* Fills every element of view v with random values in [lo, hi] and returns them (dense,
 * rounded to the dtype) in vals. */
void oh_write_rand(oh_buf_t *b, const kiln_hal_tensor_t *v, double lo, double hi, double *vals);
/* Uploads the whole host mirror (copy_h2d) and synchronises. */
void oh_push(oh_buf_t *b);
/* Poisons the whole buffer (fill 0xFF) and its host mirror. */
void oh_poison(oh_buf_t *b);
/* Synchronises, downloads the whole buffer into `got` and clears the mask. Returns false (and
 * records the failure) when the stream reported an error. */
bool oh_pull(oh_buf_t *b);
/* Reads view v from `got` into vals (dense). Integer dtypes are converted to double. */
void oh_read(const oh_buf_t *b, const kiln_hal_tensor_t *v, double *vals);
void oh_read_i32(const oh_buf_t *b, const kiln_hal_tensor_t *v, int32_t *vals);
/* Marks the elements of v (or a byte range) as written by the op. */
void oh_mark(oh_buf_t *b, const kiln_hal_tensor_t *v);
void oh_mark_bytes(oh_buf_t *b, size_t offset, size_t n);
/* Every unmarked byte of `got` must equal `host`; records up to a few offending offsets.
 * Returns the number of offending bytes. */
int64_t oh_check_rest(const oh_buf_t *b, const char *what);

/* ---- comparisons --------------------------------------------------------------------------------
 */

/* |got - want| <= atol + rtol * |want| + mtol * mag[i] (mag may be NULL). */
typedef struct oh_tol {
  double atol, rtol, mtol;
} oh_tol_t;

/* Tolerances by op family and dtype; see ops_harness.c for the reasoning. */
oh_tol_t oh_tol_elementwise(int32_t dtype);
oh_tol_t oh_tol_rmsnorm(int32_t dtype);
oh_tol_t oh_tol_gemm(int32_t out_dtype);
oh_tol_t oh_tol_attention(int32_t dtype);
oh_tol_t oh_tol_logprob(void);

/* Compares n values; a NaN (or any non-finite value) where a finite value is expected is a
 * failure ("not written"). Returns the number of mismatches, recording the first few. */
int64_t oh_compare(const char *what, int64_t n, const double *got, const double *want,
                   const double *mag, oh_tol_t tol);
int64_t oh_compare_i32(const char *what, int64_t n, const int32_t *got, const int32_t *want);

/* ---- small helpers ----------------------------------------------------------------------------
 */

void *oh_xcalloc(size_t n, size_t size); /* aborts on OOM */
#define OH_NEW(type, n) ((type *)oh_xcalloc((size_t)(n), sizeof(type)))

#endif /* KILN_TESTS_OPS_HARNESS_H */
