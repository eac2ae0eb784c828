/* grammar.h - the constrained-decoding grammars: a context-free grammar over bytes, parsed
 * from llama.cpp's GBNF syntax, and the translators that produce GBNF from the other kinds of
 * constraint (JSON Schema, regular expressions, choice lists).
 *
 * The grammar works on bytes: GBNF character classes and literals name Unicode code points,
 * and are compiled to the UTF-8 byte sequences that encode them, so a grammar only ever
 * accepts valid UTF-8 and a token holding half a character can still be allowed.
 *
 * Representation (after kiln_grammar_compile): rules, each a list of alternatives, each
 * alternative a run of elements in one flat array ended by an END element. An element is a
 * byte set (one byte out of a set of 256) or a reference to a rule. A grammar position is an
 * element index. The compiler checks that every rule is defined, that no rule is left
 * recursive (directly, or through rules that can match the empty string), and drops
 * alternatives that can never finish (a rule that derives no finite string); a grammar whose
 * root derives nothing is refused.
 *
 * GBNF (llama.cpp's grammar format), as accepted here:
 *     name ::= alternatives          one rule; names are [A-Za-z0-9_-]+, the start is "root"
 *     a b c                          a sequence        a | b    alternatives
 *     "text"                         a literal (escapes \n \r \t \\ \" \[ \] \xHH \uHHHH
 *                                    \UHHHHHHHH)
 *     [a-z0-9_] [^"\\]               a character class (code points; the same escapes)
 *     .                              any character
 *     ( ... )                        a group          # ...       a comment to the line end
 *     x* x+ x? x{m} x{m,} x{m,n}     repetition (bounds at most KILN_GRAMMAR_MAX_REPEAT)
 * A rule ends at a newline that is not inside parentheses and does not follow "|" or "::=".
 * Token references (<...>) are refused.
 *
 * Thread-safety: a compiled grammar is immutable. */
#ifndef KILN_CORE_GUIDE_GRAMMAR_H
#define KILN_CORE_GUIDE_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "base/strbuf.h"
#include "kiln/kiln.h"

#define KILN_GRAMMAR_MAX_REPEAT 1000 /* the largest m or n of x{m,n} */
#define KILN_GRAMMAR_MAX_ELEMENTS (1 << 22)

enum { KILN_GEL_END = 0, KILN_GEL_BYTES = 1, KILN_GEL_RULE = 2 };

typedef struct kiln_gel {
  int32_t kind; /* KILN_GEL_* */
  int32_t arg;  /* BYTES: index into sets; RULE: the rule */
} kiln_gel_t;

typedef struct kiln_grammar {
  int32_t num_rules, num_alts, num_el, num_sets;
  int32_t *rule_alt;   /* [num_rules + 1]: rule r's alternatives are alt_start[rule_alt[r] ..] */
  int32_t *alt_start;  /* [num_alts] first element of each alternative */
  kiln_gel_t *el;      /* [num_el] */
  int32_t *el_rule;    /* [num_el] the rule an element belongs to */
  uint64_t (*sets)[4]; /* [num_sets] 256-bit byte sets */
  char **names;        /* [num_rules] */
  bool *nullable;      /* [num_rules] */
  /* [num_rules] links of a bounded repetition x{m,n} (opt_k ::= x opt_{k-1} | ""): rep_pos is
   * the element "S" of the x* rule's alternative "x S" (S ::= x S | "", same x, x not
   * nullable), rep_count = k, the number of x the link still allows; -1 and 0 elsewhere. */
  int32_t *rep_pos;
  int32_t *rep_count;
  int32_t root;
} kiln_grammar_t;

static inline bool kiln_byteset_has(const uint64_t s[4], unsigned b) {
  return (s[b >> 6] >> (b & 63)) & 1;
}

/* Parses GBNF text; start names the start rule (NULL = "root"). what names the field in
 * messages ("grammar"). Errors (KILN_ERR_INVALID_ARGUMENT): "<what>: line L, column C: <why>",
 * an undefined or left-recursive rule, a grammar that matches nothing. */
kiln_status_t kiln_grammar_compile(const char *text, size_t len, const char *what,
                                   const char *start, kiln_grammar_t **out);
void kiln_grammar_free(kiln_grammar_t *g);

/* Appends regular expression re as GBNF rules to out, defining rule `name` (and helpers
 * named name-1, name-2, ...). json_string: the regex constrains the *contents* of a JSON
 * string (JSON Schema "pattern": search semantics unless anchored, characters written as JSON
 * needs them: '"', '\' and control characters escaped); else the whole text must match it
 * (guided_regex; ^ and $ at the ends are allowed and change nothing). The syntax (a subset of
 * ECMAScript / Python `re` that denotes a regular language): literals, . (any character but
 * \n), [...] and [^...] classes with ranges, \d \D \w \W \s \S \t \n \r \f \v \0 \xHH
 * \uHHHH, escaped punctuation, ( ) (?: ) (?P<n> ) (?<n> ) groups, |, * + ? {m} {m,} {m,n}
 * (lazy forms too: the language is the same), ^ at the start and $ at the end. Refused, with
 * the reason: backreferences, lookaround, \b \B, inline flags, \p{...}, possessive
 * quantifiers, anchors elsewhere. Errors name `what` and the offset. */
kiln_status_t kiln_regex_to_gbnf(const char *re, size_t len, bool json_string, const char *name,
                                 const char *what, kiln_strbuf_t *out);

/* Translates a JSON Schema (JSON text) into GBNF (rule root), see schema.c for the supported
 * keywords; an unsupported keyword or a schema that cannot be compiled is
 * KILN_ERR_INVALID_ARGUMENT naming the keyword's path ("<what>: properties.age: 'multipleOf'
 * is not supported"). */
kiln_status_t kiln_schema_to_gbnf(const char *json, size_t len, const char *what,
                                  kiln_strbuf_t *out);

/* The GBNF of any constraint kind: JSON_OBJECT (spec ignored), JSON_SCHEMA, REGEX, CHOICE
 * (a JSON array of strings), GRAMMAR (returned as is). */
kiln_status_t kiln_guide_to_gbnf(kiln_guide_kind_t kind, const char *spec, size_t len,
                                 kiln_strbuf_t *out);

/* The field name used in messages for a kind ("json_schema", "regex", ...). */
const char *kiln_guide_kind_name(kiln_guide_kind_t kind);

#endif /* KILN_CORE_GUIDE_GRAMMAR_H */
