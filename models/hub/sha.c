/* sha.c - SHA-1 and SHA-256 as FIPS 180-4 specifies them (see sha.h). */
#include "models/hub/sha.h"

#include <stdio.h>
#include <string.h>

static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
static uint32_t rotl(uint32_t x, int n) { return (x << n) | (x >> (32 - n)); }

static uint32_t load_be32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static void to_hex(const uint32_t *h, int words, char *hex) {
  for (int i = 0; i < words; i++) snprintf(hex + 8 * i, 9, "%08x", (unsigned)h[i]);
}

/* ---- SHA-256 ---------------------------------------------------------------------------- */

/* The first 32 bits of the fractional parts of the cube roots of the first 64 primes. */
static const uint32_t sha256_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

static void sha256_block(uint32_t h[8], const uint8_t *p) {
  uint32_t w[64];
  for (int t = 0; t < 16; t++) w[t] = load_be32(p + 4 * t);
  for (int t = 16; t < 64; t++) {
    uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
    uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
    w[t] = w[t - 16] + s0 + w[t - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
  for (int t = 0; t < 64; t++) {
    uint32_t t1 =
        k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + sha256_k[t] + w[t];
    uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h[0] += a;
  h[1] += b;
  h[2] += c;
  h[3] += d;
  h[4] += e;
  h[5] += f;
  h[6] += g;
  h[7] += k;
}

void kiln_sha256_init(kiln_sha256_t *c) {
  static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  memcpy(c->h, iv, sizeof(iv));
  c->len = 0;
  c->n = 0;
}

/* Shared by both hashes: buffers data into 64-byte blocks for block(). */
#define SHA_UPDATE(c, data, n, block)                       \
  do {                                                      \
    const uint8_t *p_ = (const uint8_t *)(data);            \
    size_t n_ = (n);                                        \
    (c)->len += n_;                                         \
    if ((c)->n) {                                           \
      size_t take_ = 64 - (c)->n < n_ ? 64 - (c)->n : n_;   \
      memcpy((c)->buf + (c)->n, p_, take_);                 \
      (c)->n += take_;                                      \
      p_ += take_;                                          \
      n_ -= take_;                                          \
      if ((c)->n < 64) break;                               \
      block((c)->h, (c)->buf);                              \
      (c)->n = 0;                                           \
    }                                                       \
    for (; n_ >= 64; p_ += 64, n_ -= 64) block((c)->h, p_); \
    memcpy((c)->buf, p_, n_);                               \
    (c)->n = n_;                                            \
  } while (0)

/* The padding: 0x80, zeros to 56 mod 64, then the length in bits, big-endian. */
#define SHA_FINAL(c, block)                                                               \
  do {                                                                                    \
    uint64_t bits_ = (c)->len * 8;                                                        \
    (c)->buf[(c)->n++] = 0x80;                                                            \
    if ((c)->n > 56) {                                                                    \
      memset((c)->buf + (c)->n, 0, 64 - (c)->n);                                          \
      block((c)->h, (c)->buf);                                                            \
      (c)->n = 0;                                                                         \
    }                                                                                     \
    memset((c)->buf + (c)->n, 0, 56 - (c)->n);                                            \
    for (int i_ = 0; i_ < 8; i_++) (c)->buf[56 + i_] = (uint8_t)(bits_ >> (56 - 8 * i_)); \
    block((c)->h, (c)->buf);                                                              \
  } while (0)

void kiln_sha256_update(kiln_sha256_t *c, const void *data, size_t n) {
  SHA_UPDATE(c, data, n, sha256_block);
}

void kiln_sha256_final_hex(kiln_sha256_t *c, char hex[65]) {
  SHA_FINAL(c, sha256_block);
  to_hex(c->h, 8, hex);
}

/* ---- SHA-1 ------------------------------------------------------------------------------ */

static void sha1_block(uint32_t h[5], const uint8_t *p) {
  uint32_t w[80];
  for (int t = 0; t < 16; t++) w[t] = load_be32(p + 4 * t);
  for (int t = 16; t < 80; t++) w[t] = rotl(w[t - 3] ^ w[t - 8] ^ w[t - 14] ^ w[t - 16], 1);
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4];
  for (int t = 0; t < 80; t++) {
    uint32_t f, k;
    if (t < 20) {
      f = (b & c) | (~b & d);
      k = 0x5a827999;
    } else if (t < 40) {
      f = b ^ c ^ d;
      k = 0x6ed9eba1;
    } else if (t < 60) {
      f = (b & c) | (b & d) | (c & d);
      k = 0x8f1bbcdc;
    } else {
      f = b ^ c ^ d;
      k = 0xca62c1d6;
    }
    uint32_t tmp = rotl(a, 5) + f + e + k + w[t];
    e = d;
    d = c;
    c = rotl(b, 30);
    b = a;
    a = tmp;
  }
  h[0] += a;
  h[1] += b;
  h[2] += c;
  h[3] += d;
  h[4] += e;
}

void kiln_sha1_init(kiln_sha1_t *c) {
  static const uint32_t iv[5] = {0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476, 0xc3d2e1f0};
  memcpy(c->h, iv, sizeof(iv));
  c->len = 0;
  c->n = 0;
}

void kiln_sha1_git_blob_init(kiln_sha1_t *c, uint64_t size) {
  kiln_sha1_init(c);
  char head[40];
  int n = snprintf(head, sizeof(head), "blob %llu", (unsigned long long)size);
  kiln_sha1_update(c, head, (size_t)n + 1); /* with the NUL */
}

void kiln_sha1_update(kiln_sha1_t *c, const void *data, size_t n) {
  SHA_UPDATE(c, data, n, sha1_block);
}

void kiln_sha1_final_hex(kiln_sha1_t *c, char hex[41]) {
  SHA_FINAL(c, sha1_block);
  to_hex(c->h, 5, hex);
}
