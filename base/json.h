/* json.h - a strict, fast JSON reader (RFC 8259) into an immutable tree, plus string escaping
 * for writers.
 *
 * A document owns every node and string in one arena; nodes are borrowed from it and die with
 * kiln_json_doc_free(). Objects keep their members in document order and answer key lookups
 * through a hash index (so a 150k-key vocabulary is O(1) per lookup, not a linear scan).
 * Duplicate keys: the last one wins for lookups (as Python's json does); iteration still sees
 * every member.
 *
 * Strictness: UTF-8 is validated (invalid bytes, overlongs, surrogates encoded in UTF-8 are
 * errors); \u escapes are decoded, surrogate pairs combined, a lone surrogate is an error;
 * control characters in strings, trailing commas, comments, NaN/Infinity, leading zeros and
 * trailing garbage are errors. Nesting deeper than KILN_JSON_MAX_DEPTH is an error; the parser
 * keeps its own stack, so hostile input cannot overflow the C stack. A number that overflows a
 * double (1e400) is an error; one that underflows reads as 0 or a subnormal. A leading UTF-8
 * byte order mark is skipped (RFC 8259 section 8.1). Errors say "name: line L, column C: what"
 * (columns count bytes). Numbers are read independently of the C locale.
 *
 * Performance: one arena per document (a few large chunks), strings decoded into it, an
 * open-addressing hash index per object with more than 8 members (seeded per document), and no
 * recursion. An 11 MB tokenizer.json parses in tens of milliseconds.
 *
 * Thread-safety: a parsed document is immutable; any number of threads may read it. Parsing
 * and writing keep no shared state, so threads may parse and write different documents at once
 * (number conversion switches only the calling thread to the C locale, with uselocale).
 */
#ifndef KILN_CORE_JSON_H
#define KILN_CORE_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "base/strbuf.h"

#define KILN_JSON_MAX_DEPTH 512

typedef enum kiln_json_type {
  KILN_JSON_NULL = 0,
  KILN_JSON_BOOL = 1,
  KILN_JSON_NUMBER = 2,
  KILN_JSON_STRING = 3,
  KILN_JSON_ARRAY = 4,
  KILN_JSON_OBJECT = 5,
} kiln_json_type_t;

typedef struct kiln_json_doc kiln_json_doc_t;
typedef struct kiln_json kiln_json_t; /* a node; borrowed from its document */

/* Parses len bytes of text (need not be NUL-terminated). name is used in error messages
 * ("tokenizer.json: line 3, column 17: expected ':' after object key"). On error *out_doc is
 * NULL and the status is KILN_ERR_INVALID_ARGUMENT (or OUT_OF_MEMORY). */
kiln_status_t kiln_json_parse(const char *text, size_t len, const char *name,
                              kiln_json_doc_t **out_doc);

/* Reads and parses a whole file (KILN_ERR_NOT_FOUND / KILN_ERR_IO when it cannot be read). */
kiln_status_t kiln_json_parse_file(const char *path, kiln_json_doc_t **out_doc);

void kiln_json_doc_free(kiln_json_doc_t *doc);
const kiln_json_t *kiln_json_root(const kiln_json_doc_t *doc);

/* Accessors. Each is safe on any node (and on NULL, which reads as a missing value): asking
 * for the wrong type returns the zero value (false, 0, NULL, length 0). */
kiln_json_type_t kiln_json_type(const kiln_json_t *v); /* KILN_JSON_NULL for NULL */
const char *kiln_json_type_name(kiln_json_type_t t);   /* "null", "bool", ... "object" */
bool kiln_json_is(const kiln_json_t *v, kiln_json_type_t t);
bool kiln_json_bool(const kiln_json_t *v);
double kiln_json_number(const kiln_json_t *v);
/* True (and *out set) when v is a number with an exact int64 value (1e3 counts; 1.5 not).
 * An integer literal is kept exactly (9223372036854775807 and -9223372036854775808 work even
 * though no double holds the former); anything else counts when its double is integral and in
 * [-2^63, 2^63). */
bool kiln_json_int64(const kiln_json_t *v, int64_t *out);
/* True when v is a number written as an integer (no fraction, no exponent) that fits int64:
 * what Python's json.loads returns as an int rather than a float. "1", "-0" yes; "1.0", "1e3",
 * "99999999999999999999" no (the last reads as the nearest double). */
bool kiln_json_number_is_int(const kiln_json_t *v);
/* The decoded UTF-8 bytes, NUL-terminated (a string may also contain "\u0000", hence
 * out_len, which may be NULL). NULL for a non-string. */
const char *kiln_json_string(const kiln_json_t *v, size_t *out_len);
/* Elements of an array, members of an object, 0 otherwise. */
size_t kiln_json_len(const kiln_json_t *v);
/* Element i of an array (NULL when out of range or not an array). */
const kiln_json_t *kiln_json_at(const kiln_json_t *v, size_t i);
/* Member of an object by key (NUL-terminated / with length); NULL when absent. */
const kiln_json_t *kiln_json_get(const kiln_json_t *obj, const char *key);
const kiln_json_t *kiln_json_getn(const kiln_json_t *obj, const char *key, size_t key_len);
/* Member i of an object in document order: its key (and length) and value. */
const char *kiln_json_key_at(const kiln_json_t *obj, size_t i, size_t *out_len);
const kiln_json_t *kiln_json_value_at(const kiln_json_t *obj, size_t i);
/* Line and column (1-based) where the node starts, for messages about a valid document
 * ("tokenizer.json:12:5: merges[3] is not a string"). Columns count bytes, not characters (in
 * error messages too). 0, 0 for NULL. */
void kiln_json_position(const kiln_json_t *v, int *out_line, int *out_col);

/* ---- writing --------------------------------------------------------------------------- */

/* Appends s[0..n) as a quoted JSON string. ensure_ascii escapes every non-ASCII code point as
 * \uXXXX (surrogate pairs above U+FFFF), as Python's json.dumps does by default; otherwise
 * UTF-8 is copied through. Escapes: \" \\ \n \r \t \b \f, other controls as \u00XX. Invalid
 * UTF-8 input bytes are written as U+FFFD. Returns false on out-of-memory. */
bool kiln_json_write_string(kiln_strbuf_t *out, const char *s, size_t n, bool ensure_ascii);

/* Appends a number the way Python's json.dumps writes a float or int. A double does not say
 * whether it was an int, so: a value with no fractional part and |x| < 2^53 is written as an
 * integer ("3", not "3.0"; -0.0 as "-0" so the sign survives a round trip); anything else as
 * kiln_json_write_double does ("0.1", "1e-07", "1.5e+300", "1e+16"). NaN and infinities as
 * NaN, Infinity, -Infinity (as Python writes them; not valid JSON). False on out-of-memory. */
bool kiln_json_write_number(kiln_strbuf_t *out, double x);

/* Appends Python's repr() of a float, which is what json.dumps writes for one: the shortest
 * digits that read back as x, fixed notation for decimal exponents in [-4, 16) and always with
 * a fraction ("1.0", "0.0001", "1000000000000000.0", "-0.0"), otherwise scientific with a signed
 * exponent of at least two digits ("1e-05", "1e+16", "1.5e+300"). NaN / Infinity / -Infinity.
 * Independent of the C locale. False on out-of-memory. */
bool kiln_json_write_double(kiln_strbuf_t *out, double x);

/* Appends node v re-serialised as Python's json.dumps(json.loads(text)) would write it: compact
 * with separators ", " and ": " when pretty is false; indent = 2 spaces per level and separators
 * "," and ": " when pretty is true (json.dumps(indent=2)); empty containers as [] and {}.
 * Numbers written as integers stay integers (exactly, up to int64); others are written as
 * floats ("1.0" stays "1.0", "1e3" becomes "1000.0"). A duplicated key is written once, at its
 * first position, with its last value (Python's dict semantics). NULL writes "null". False on
 * out-of-memory (the buffer's failure flag is set). */
bool kiln_json_write(kiln_strbuf_t *out, const kiln_json_t *v, bool ensure_ascii, bool pretty);

#endif /* KILN_CORE_JSON_H */
