/* sha.h - SHA-1 and SHA-256 (FIPS 180-4), streaming: the checksums the Hugging Face Hub names
 * its files by. An LFS file's etag is the SHA-256 of its bytes; any other file's is its git
 * blob id, the SHA-1 of "blob <size>\0" followed by its bytes (kiln_sha1_git_blob_init()).
 *
 * Exported (kiln_*) so that the unit tests can check them against the FIPS test vectors. No
 * allocation; a context is plain data, one per stream, not shared between threads.
 */
#ifndef KILN_MODELS_HUB_SHA_H
#define KILN_MODELS_HUB_SHA_H

#include <stddef.h>
#include <stdint.h>

typedef struct kiln_sha256 {
  uint32_t h[8];
  uint64_t len; /* bytes hashed so far */
  uint8_t buf[64];
  size_t n; /* bytes in buf */
} kiln_sha256_t;

typedef struct kiln_sha1 {
  uint32_t h[5];
  uint64_t len;
  uint8_t buf[64];
  size_t n;
} kiln_sha1_t;

void kiln_sha256_init(kiln_sha256_t *c);
void kiln_sha256_update(kiln_sha256_t *c, const void *data, size_t n);
/* Writes the digest as 64 lowercase hex digits and a NUL into hex[65]. */
void kiln_sha256_final_hex(kiln_sha256_t *c, char hex[65]);

void kiln_sha1_init(kiln_sha1_t *c);
/* Starts a git blob id: kiln_sha1_init() then "blob <size>\0". */
void kiln_sha1_git_blob_init(kiln_sha1_t *c, uint64_t size);
void kiln_sha1_update(kiln_sha1_t *c, const void *data, size_t n);
/* Writes the digest as 40 lowercase hex digits and a NUL into hex[41]. */
void kiln_sha1_final_hex(kiln_sha1_t *c, char hex[41]);

#endif /* KILN_MODELS_HUB_SHA_H */
