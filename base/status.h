/* status.h - libkiln's error values: a code plus a message built where the failure happened.
 *
 * A kiln_status_t is NULL on success and an owned heap object on failure (the IREE model):
 *
 *     kiln_status_t st = kiln_config_load(cfg, path);
 *     if (st) { fprintf(stderr, "%s\n", kiln_status_message(st)); kiln_status_free(st); }
 *
 * Ownership: a function that returns a status hands it to the caller, who must either free it
 * or return it further up (optionally after kiln_status_annotate()). Out-of-memory while
 * building a status yields a static status that kiln_status_free() ignores, so error paths
 * never fail themselves. All functions are thread-safe (no shared state).
 */
#ifndef KILN_CORE_STATUS_H
#define KILN_CORE_STATUS_H

#include <stdarg.h>

typedef enum kiln_status_code {
  KILN_OK = 0,
  KILN_ERR_INVALID_ARGUMENT = 1, /* bad input from a user or caller: config, file, request */
  KILN_ERR_NOT_FOUND = 2,        /* a file, plugin, key or device that is not there */
  KILN_ERR_OUT_OF_MEMORY = 3,    /* host or device allocation failed */
  KILN_ERR_UNSUPPORTED = 4,      /* valid, but not implemented by this build or backend */
  KILN_ERR_IO = 5,               /* read/write/mmap failure */
  KILN_ERR_INCOMPATIBLE = 6,     /* ABI or format version mismatch */
  KILN_ERR_DEVICE = 7,           /* the device or its driver reported an error */
  KILN_ERR_INTERNAL = 8,         /* a bug: an invariant did not hold */
  KILN_ERR_UNAVAILABLE = 9,      /* not now: a full queue, a shutting-down engine; try later */
} kiln_status_code_t;

typedef struct kiln_status *kiln_status_t;

/* Creates a status with a printf-style message. Never returns NULL for code != KILN_OK. */
kiln_status_t kiln_status_make(kiln_status_code_t code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
kiln_status_t kiln_status_makev(kiln_status_code_t code, const char *fmt, va_list ap)
    __attribute__((format(printf, 2, 0), nonnull(2)));

/* Prefixes the message with "<context>: " and returns the same status (or the static OOM
 * status). A NULL status is returned unchanged, so `return kiln_status_annotate(st, ...)` is
 * safe on both paths. */
kiln_status_t kiln_status_annotate(kiln_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* KILN_OK for NULL. */
kiln_status_code_t kiln_status_code(const kiln_status_t st);
/* "ok" for NULL; borrowed, valid until the status is freed. */
const char *kiln_status_message(const kiln_status_t st);
/* Short name of a code, e.g. "INVALID_ARGUMENT". */
const char *kiln_status_code_name(kiln_status_code_t code);
/* Frees a status; NULL is a no-op. */
void kiln_status_free(kiln_status_t st);

#endif /* KILN_CORE_STATUS_H */
