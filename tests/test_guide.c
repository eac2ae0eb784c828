/* test_guide.c - constrained decoding (core/guide): GBNF, regex and JSON Schema constraints
 * against hand-written accept / reject strings; regexes against PCRE2 on random strings; every
 * token mask against a brute-force check of every token (a synthetic vocabulary built for the
 * edge cases: tokens spanning JSON structure, UTF-8 characters split across tokens, special
 * tokens; and the real Qwen3 tokenizer); copies and compaction of matchers; and the engine
 * with the embedded model: n > 1, chunked prefill and preemption give the same outputs as a
 * plain run, the prefix cache, logprobs, ignore_eos, the refusals. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <stdatomic.h>
/* cmocka after the standard headers */
#include <cmocka.h>
#include <dirent.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#endif

#include "base/json.h"
#include "core/guide/guide.h"
#include "kiln/kiln.h"

static bool slow_host(void) {
#ifdef RUNNING_ON_VALGRIND
  if (RUNNING_ON_VALGRIND) return true;
#endif
  return false;
}

static uint64_t g_rng = 0x12345678;
static uint32_t rnd(uint32_t n) {
  g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(g_rng >> 33) % n;
}

static kiln_guide_t *compile_ok(kiln_guide_vocab_t *v, kiln_guide_kind_t kind, const char *spec) {
  kiln_guide_t *g = NULL;
  kiln_status_t st = kiln_guide_compile(v, kind, spec, 0, &g);
  if (st)
    fail_msg("compiling %s %s: %s", kiln_guide_kind_name(kind), spec ? spec : "",
             kiln_status_message(st));
  return g;
}

/* Does the constraint accept text as a whole? */
static bool matches(kiln_guide_t *g, const char *text, size_t n) {
  kiln_guide_matcher_t *m;
  assert_null(kiln_guide_matcher_create(g, &m));
  bool ok = kiln_guide_matcher_accept_bytes(m, text, n) && kiln_guide_matcher_accepting(m);
  kiln_guide_matcher_free(m);
  return ok;
}

typedef struct acase {
  const char *text;
  bool ok;
} acase_t;

static void check_cases(kiln_guide_kind_t kind, const char *spec, const acase_t *cases) {
  kiln_guide_t *g = compile_ok(NULL, kind, spec);
  for (int i = 0; cases[i].text; i++)
    if (matches(g, cases[i].text, strlen(cases[i].text)) != cases[i].ok)
      fail_msg("%s %s: '%s' should be %s", kiln_guide_kind_name(kind), spec, cases[i].text,
               cases[i].ok ? "accepted" : "refused");
  kiln_guide_release(g);
}

static void check_error(kiln_guide_kind_t kind, const char *spec, const char *needle) {
  kiln_guide_t *g = NULL;
  kiln_status_t st = kiln_guide_compile(NULL, kind, spec, 0, &g);
  if (!st)
    fail_msg("%s '%s' compiled; expected an error with '%s'", kiln_guide_kind_name(kind), spec,
             needle);
  assert_null(g);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  if (!strstr(kiln_status_message(st), needle))
    fail_msg("%s '%s': error '%s' lacks '%s'", kiln_guide_kind_name(kind), spec,
             kiln_status_message(st), needle);
  const char *prefix = kiln_guide_kind_name(kind);
  if (strncmp(kiln_status_message(st), prefix, strlen(prefix)))
    fail_msg("error '%s' does not start with the kind's field '%s'", kiln_status_message(st),
             prefix);
  kiln_status_free(st);
}

/* ---- GBNF ---------------------------------------------------------------------------------- */

static void test_gbnf(void **state) {
  (void)state;
  check_cases(
      KILN_GUIDE_GRAMMAR, "root ::= \"a\" | \"b\" [0-9]{2,3}",
      (acase_t[]){
          {"a", 1}, {"b12", 1}, {"b123", 1}, {"b1", 0}, {"b1234", 0}, {"", 0}, {"c", 0}, {0}});
  check_cases(KILN_GUIDE_GRAMMAR, "root ::= \"(\" root \")\" | \"\"",
              (acase_t[]){{"", 1}, {"()", 1}, {"(())", 1}, {"(()", 0}, {"())", 0}, {0}});
  check_cases(KILN_GUIDE_GRAMMAR,
              "# comments and a multi-line group\nroot ::= item (\n  \",\" item\n)*\nitem ::= "
              "[a-z]+ # trailing\n",
              (acase_t[]){{"ab", 1}, {"ab,c,de", 1}, {"ab,", 0}, {",ab", 0}, {"AB", 0}, {0}});
  /* code points: classes, negation, ranges across UTF-8 lengths, escapes, any character */
  check_cases(KILN_GUIDE_GRAMMAR, "root ::= [α-ω]+ [^a] \"\\u00e9\\x41\\U0001F600\" .",
              (acase_t[]){{"αβxéA😀z", 1},
                          {"αÿéA😀\xe4\xb8\xad", 1},
                          {"αaéA😀z", 0},
                          {"aéA😀z", 0},
                          {"αxéA😀", 0},
                          {"αx\xc3\xa9"
                           "A\xf0\x9f\x98\x80\xc3",
                           0},
                          {0}});
  check_cases(KILN_GUIDE_GRAMMAR, "root ::= [^\\x00-\\x7F]{2}",
              (acase_t[]){{"éé", 1},
                          {"中€", 1},
                          {"\xf4\x8f\xbf\xbf\xc2\x80", 1},
                          {"é", 0},
                          {"ée", 0},
                          {"\xed\xa0\x80\xc2\x80", 0} /* a surrogate: not UTF-8 */,
                          {"\xc0\x80\xc2\x80", 0},
                          {0}});
  check_cases(KILN_GUIDE_GRAMMAR,
              "root ::= x? y* z+ \"!\"{2,}\nx ::= \"x\"\ny ::= \"y\"\nz ::= \"z\"",
              (acase_t[]){{"z!!", 1}, {"xyyz!!!", 1}, {"xz!", 0}, {"x!!", 0}, {"xxz!!", 0}, {0}});
  /* a left cycle of tail references only (the continuation stays the same) is fine */
  check_cases(KILN_GUIDE_GRAMMAR, "root ::= x root | \"b\"\nx ::= \"a\"?",
              (acase_t[]){{"b", 1}, {"aab", 1}, {"aa", 0}, {0}});
  check_cases(KILN_GUIDE_GRAMMAR, "root ::= (\"a\"* | \"c\")* \"b\"",
              (acase_t[]){{"b", 1}, {"aacab", 1}, {"ca", 0}, {0}});
  /* nullable prefixes before a recursion are fine when not left-recursive */
  check_cases(KILN_GUIDE_GRAMMAR, "root ::= a \"x\" root | \"y\"\na ::= \"a\"?",
              (acase_t[]){{"y", 1}, {"xy", 1}, {"axaxy", 1}, {"ay", 0}, {0}});
  check_cases(KILN_GUIDE_GRAMMAR, "root ::= \"\\\"quoted\\\" \\\\ \\[\\]\"",
              (acase_t[]){{"\"quoted\" \\ []", 1}, {0}});
}

static void test_gbnf_errors(void **state) {
  (void)state;
  check_error(KILN_GUIDE_GRAMMAR, "root ::= root \"a\" | \"b\"", "left-recursive");
  check_error(KILN_GUIDE_GRAMMAR, "root ::= x root \"c\" | \"b\"\nx ::= \"a\"?", "left-recursive");
  check_error(KILN_GUIDE_GRAMMAR, "root ::= \"a\" root", "matches no string");
  check_error(KILN_GUIDE_GRAMMAR, "root ::= x", "rule 'x' (line 1) is used but never defined");
  check_error(KILN_GUIDE_GRAMMAR, "start ::= \"a\"", "no 'root' rule");
  check_error(KILN_GUIDE_GRAMMAR, "root ::= \"a", "line 1, column 10: unterminated literal");
  check_error(KILN_GUIDE_GRAMMAR, "root ::= [a-", "unterminated character class");
  check_error(KILN_GUIDE_GRAMMAR, "root ::= \"\\q\"", "unknown escape");
  check_error(KILN_GUIDE_GRAMMAR, "root ::= <think>", "token references");
  check_error(KILN_GUIDE_GRAMMAR, "root ::= \"a\"{3,2}", "maximum is below the minimum");
  check_error(KILN_GUIDE_GRAMMAR, "root ::= \"a\"{5000}", "repetition bound above");
  check_error(KILN_GUIDE_GRAMMAR, "root ::= * \"a\"", "nothing to repeat");
  check_error(KILN_GUIDE_GRAMMAR, "root ::= (\"a\"", "without a matching ')'");
  check_error(KILN_GUIDE_GRAMMAR, "root ::= \"a\"\nroot ::= \"b\"", "defined twice");
  check_error(KILN_GUIDE_GRAMMAR, "root ::= [z-a]", "range from");
  check_error(KILN_GUIDE_GRAMMAR, "root \"a\"", "expected '::='");
}

/* ---- regular expressions --------------------------------------------------------------------- */

static void test_regex(void **state) {
  (void)state;
  check_cases(KILN_GUIDE_REGEX, "^[a-z]+@[a-z]+\\.com$",
              (acase_t[]){{"a@b.com", 1}, {"ab@c.co", 0}, {"a@.com", 0}, {0}});
  check_cases(
      KILN_GUIDE_REGEX, "(?:cat|dog)s?|(?P<n>\\d{2,3})|(?<m>x)",
      (acase_t[]){{"cat", 1}, {"dogs", 1}, {"12", 1}, {"1234", 0}, {"x", 1}, {"cats?", 0}, {0}});
  check_cases(KILN_GUIDE_REGEX, "[^\\d\\s]\\S\\W\\w*?",
              (acase_t[]){{"ab!", 1}, {"a  x", 0}, {"1b!", 0}, {"é\x01.z_9", 1}, {0}});
  check_cases(KILN_GUIDE_REGEX, "\\u00e9\\x41\\u{1F600}\\.\\/\\t.",
              (acase_t[]){{"éA😀./\tq", 1}, {"éA😀./\t\n", 0}, {"éA😀./\t\r", 0}, {0}});
  check_cases(KILN_GUIDE_REGEX, "a{2}b{1,}c{0,2}[\\]a-]",
              (acase_t[]){{"aabcc]", 1}, {"aabbb-", 1}, {"aab", 0}, {"abc]", 0}, {0}});
  check_cases(KILN_GUIDE_REGEX, "[^]x|[\\b]", (acase_t[]){{"\nx", 1}, {"\b", 1}, {"x", 0}, {0}});
  check_error(KILN_GUIDE_REGEX, "(?=a)b", "lookaround");
  check_error(KILN_GUIDE_REGEX, "(?<!a)b", "lookaround");
  check_error(KILN_GUIDE_REGEX, "(a)\\1", "backreferences");
  check_error(KILN_GUIDE_REGEX, "\\bword", "word boundaries");
  check_error(KILN_GUIDE_REGEX, "(?i)abc", "inline flags");
  check_error(KILN_GUIDE_REGEX, "\\p{L}", "Unicode property");
  check_error(KILN_GUIDE_REGEX, "a*+", "possessive");
  check_error(KILN_GUIDE_REGEX, "a^b", "'^' is supported only at the start");
  check_error(KILN_GUIDE_REGEX, "a$b", "'$' is supported only at the end");
  check_error(KILN_GUIDE_REGEX, "(ab", "without a matching ')'");
  check_error(KILN_GUIDE_REGEX, "ab)", "without a matching '('");
  check_error(KILN_GUIDE_REGEX, "[ab", "unterminated");
  check_error(KILN_GUIDE_REGEX, "a{x}", "quantifier");
  check_error(KILN_GUIDE_REGEX, "**", "nothing to repeat");
  check_error(KILN_GUIDE_REGEX, "[z-a]", "out of order");
}

/* Random strings over a small alphabet: our full-match semantics against PCRE2's anchored
 * match, for regexes whose meaning PCRE2 and ECMAScript share on ASCII text. */
static void test_regex_vs_pcre2(void **state) {
  (void)state;
  static const char *const res[] = {"a(b|c)*d?",   "(ab|a)(bc|c)",      "[a-c]{2,4}",
                                    "x?y+z*",      "((a|b)c){1,3}",     "[^ab]*b",
                                    "a.c",         "(a|ab)(c|bcd)(d*)", "\\d+(\\.\\d\\d?)?",
                                    "\\w\\s?\\W",  "(?:a{0,2}b){2}",    "(a*)*b",
                                    "[ab-]+|\\-x", "(c|d)?(a|b){3}",    "a|b|cd|",
                                    "[\\d.]{1,3}x"};
  static const char alpha[] = "abcdxyz01. -_\t\n";
  int checked = 0, accepted = 0;
  for (size_t ri = 0; ri < sizeof(res) / sizeof(res[0]); ri++) {
    kiln_guide_t *g = compile_ok(NULL, KILN_GUIDE_REGEX, res[ri]);
    int err;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)res[ri], PCRE2_ZERO_TERMINATED,
                                   PCRE2_ANCHORED | PCRE2_ENDANCHORED, &err, &off, NULL);
    assert_non_null(re);
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    int trials = slow_host() ? 150 : 1500;
    for (int t = 0; t < trials; t++) {
      char s[16];
      int n = (int)rnd(7);
      for (int i = 0; i < n; i++) s[i] = alpha[rnd(sizeof(alpha) - 1)];
      /* bias towards the regex's own letters */
      for (int i = 0; i < n && t % 2; i++) s[i] = "abcd"[rnd(4)];
      bool want = pcre2_match(re, (PCRE2_SPTR)s, (size_t)n, 0, 0, md, NULL) >= 0;
      bool got = matches(g, s, (size_t)n);
      if (want != got) fail_msg("regex %s on '%.*s': PCRE2 %d, Kiln %d", res[ri], n, s, want, got);
      checked++;
      accepted += got;
    }
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    kiln_guide_release(g);
  }
  printf("test_guide: regex vs PCRE2: %d strings, %d matched\n", checked, accepted);
  assert_true(accepted > checked / 40);
}

/* ---- JSON Schema --------------------------------------------------------------------------- */

static void test_schema(void **state) {
  (void)state;
  check_cases(KILN_GUIDE_JSON_SCHEMA,
              "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":5},"
              "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},\"tags\":{\"type\":"
              "\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":2}},\"required\":[\"name\"]}",
              (acase_t[]){{"{\"name\":\"bob\"}", 1},
                          {"{\"name\": \"bob\", \"age\": 42}", 1},
                          {"{ \"name\" : \"a\" , \"age\" : 0 }", 1},
                          {"{\"name\":\"a\",\"tags\":[\"x\",\"y\"]}", 1},
                          {"{\"name\":\"bobbyb\"}", 0},
                          {"{\"age\":3}", 0},
                          {"{\"name\":\"a\",\"age\":151}", 0},
                          {"{\"name\":\"a\",\"age\":-1}", 0},
                          {"{\"name\":\"a\",\"tags\":[\"x\",\"y\",\"z\"]}", 0},
                          {"{\"age\":1,\"name\":\"a\"}", 0}, /* schema order */
                          {"{\"name\":\"a\",\"x\":1}", 0},   /* no extra properties */
                          {"{\"name\":\"\\u00e9\\n\"}", 1},
                          {"{\"name\":\"\\ud800\"}", 0}, /* lone surrogate */
                          {"{\"name\":\"a\"}  ", 0},
                          {0}});
  check_cases(KILN_GUIDE_JSON_OBJECT, NULL,
              (acase_t[]){{"{}", 1},
                          {"{\"a\":[1,-2.5e3,true,null,{\"b\":\"c\"}]}", 1},
                          {"[1]", 0},
                          {"{\"a\":}", 0},
                          {"{\"x\":01}", 0},
                          {"{\"x\":1.}", 0},
                          {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"number\",\"minimum\":0,\"maximum\":1}",
              (acase_t[]){{"0", 1},
                          {"1", 1},
                          {"0.5", 1},
                          {"1.0", 1},
                          {"1.000", 1},
                          {"1.5", 0},
                          {"1.01", 0},
                          {"-0.1", 0},
                          {"2", 0},
                          {"1e0", 0},
                          {0}});
  check_cases(
      KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"number\",\"exclusiveMinimum\":0,\"exclusiveMaximum\":3}",
      (acase_t[]){
          {"0.1", 1}, {"2.99", 1}, {"0", 0}, {"0.0", 0}, {"3", 0}, {"3.0", 0}, {"-1", 0}, {0}});
  check_cases(
      KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"number\",\"minimum\":-5,\"maximum\":-1}",
      (acase_t[]){
          {"-5", 1}, {"-1", 1}, {"-1.0", 1}, {"-4.5", 1}, {"-0.5", 0}, {"-5.5", 0}, {"0", 0}, {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"integer\",\"minimum\":-20,\"maximum\":345}",
              (acase_t[]){{"-20", 1},
                          {"0", 1},
                          {"99", 1},
                          {"100", 1},
                          {"345", 1},
                          {"-21", 0},
                          {"346", 0},
                          {"-0", 0},
                          {"1.0", 0},
                          {"007", 0},
                          {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA,
              "{\"type\":\"integer\",\"exclusiveMinimum\":9.5,\"maximum\":1000}",
              (acase_t[]){{"10", 1}, {"999", 1}, {"1000", 1}, {"9", 0}, {"1001", 0}, {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"string\",\"format\":\"date\"}",
              (acase_t[]){{"\"2024-02-29\"", 1},
                          {"\"2000-02-29\"", 1},
                          {"\"2023-12-31\"", 1},
                          {"\"2023-02-29\"", 0},
                          {"\"1900-02-29\"", 0},
                          {"\"2023-04-31\"", 0},
                          {"\"2023-13-01\"", 0},
                          {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"string\",\"format\":\"date-time\"}",
              (acase_t[]){{"\"2024-01-02T03:04:05Z\"", 1},
                          {"\"2024-01-02T23:59:59.123+05:30\"", 1},
                          {"\"2024-01-02T24:00:00Z\"", 0},
                          {"\"2024-01-02T03:04:05\"", 0},
                          {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"string\",\"format\":\"uuid\"}",
              (acase_t[]){{"\"123e4567-e89b-12d3-a456-426614174000\"", 1},
                          {"\"123e4567e89b12d3a456426614174000\"", 0},
                          {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"string\",\"format\":\"email\"}",
              (acase_t[]){{"\"a.b+c@ex-ample.co\"", 1},
                          {"\"a@b\"", 0},
                          {"\"@b.co\"", 0},
                          {"\"a..b@c.d\"", 0},
                          {0}});
  check_cases(
      KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"string\",\"format\":\"ipv4\"}",
      (acase_t[]){{"\"192.168.0.255\"", 1}, {"\"256.1.1.1\"", 0}, {"\"01.1.1.1\"", 0}, {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"string\",\"pattern\":\"^\\\"[a-z]+\\\\\\\\$\"}",
              (acase_t[]){{"\"\\\"ab\\\\\"", 1}, {"\"\\\"ab\"", 0}, {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"string\",\"pattern\":\"[0-9]\"}",
              (acase_t[]){{"\"ab1cd\"", 1}, {"\"1\"", 1}, {"\"abc\"", 0}, {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}",
              (acase_t[]){{"\"ab\"", 1},
                          {"\"\\u00e9\\n\"", 1},
                          {"\"a\"", 0},
                          {"\"abcd\"", 0},
                          {"\"中文字\"", 1},
                          {0}});
  check_cases(
      KILN_GUIDE_JSON_SCHEMA,
      "{\"$defs\":{\"n\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
      "\"next\":{\"anyOf\":[{\"$ref\":\"#/$defs/n\"},{\"type\":\"null\"}]}},\"required\":[\"v\","
      "\"next\"]}},\"$ref\":\"#/$defs/n\"}",
      (acase_t[]){{"{\"v\":1,\"next\":{\"v\":2,\"next\":null}}", 1}, {"{\"v\":1}", 0}, {0}});
  check_cases(
      KILN_GUIDE_JSON_SCHEMA, "{\"enum\":[\"red\",3,null,{\"a\":[1]}]}",
      (acase_t[]){
          {"\"red\"", 1}, {"3", 1}, {"null", 1}, {"{\"a\": [1]}", 1}, {"\"blue\"", 0}, {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA,
              "{\"type\":\"object\",\"properties\":{\"ab\":{\"type\":\"integer\"}},"
              "\"additionalProperties\":{\"type\":\"boolean\"}}",
              (acase_t[]){{"{\"ab\":1,\"b\":true}", 1},
                          {"{\"a\":false}", 1},
                          {"{\"abc\":true}", 1},
                          {"{\"ab\":1,\"ab\":true}", 0},
                          {"{\"x\":1}", 0},
                          {"{\"\":true}", 1},
                          {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA,
              "{\"type\":\"array\",\"prefixItems\":[{\"type\":\"integer\"},{\"type\":\"string\"}],"
              "\"minItems\":1}",
              (acase_t[]){{"[1]", 1}, {"[1,\"a\"]", 1}, {"[]", 0}, {"[1,\"a\",2]", 0}, {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA,
              "{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":2}",
              (acase_t[]){{"[1,2]", 1}, {"[1, 2, 3, 4]", 1}, {"[1]", 0}, {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA, "{\"type\":[\"string\",\"null\"],\"maxLength\":2}",
              (acase_t[]){{"null", 1}, {"\"ab\"", 1}, {"\"abc\"", 0}, {"1", 0}, {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"integer\",\"nullable\":true}",
              (acase_t[]){{"null", 1}, {"-3", 1}, {"\"x\"", 0}, {0}});
  check_cases(
      KILN_GUIDE_JSON_SCHEMA,
      "{\"allOf\":[{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"integer\"},\"x\":"
      "{\"type\":\"integer\"}},\"required\":[\"id\"],\"additionalProperties\":false},{\"type\":"
      "\"object\",\"properties\":{\"id\":{\"type\":\"integer\"},\"name\":{\"type\":\"string\"}}}]}",
      (acase_t[]){
          {"{\"id\":1}", 1}, {"{\"id\":1,\"x\":2}", 1}, {"{\"id\":1,\"name\":\"a\"}", 0}, {0}});
  check_cases(KILN_GUIDE_JSON_SCHEMA, "{}",
              (acase_t[]){{"[1,{}]", 1}, {"\"s\"", 1}, {"tru", 0}, {0}});
  check_cases(KILN_GUIDE_CHOICE, "[\"yes\",\"no\",\"n/a \\u2713\"]",
              (acase_t[]){{"yes", 1}, {"no", 1}, {"n/a ✓", 1}, {"maybe", 0}, {"ye", 0}, {0}});
}

static void test_schema_errors(void **state) {
  (void)state;
  check_error(
      KILN_GUIDE_JSON_SCHEMA,
      "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\",\"multipleOf\":3}}}",
      "properties.a: keyword 'multipleOf' is not supported");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"strnig\"}", "unknown type 'strnig'");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"$ref\":\"#/$defs/x\"}", "points to nothing");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"$ref\":\"http://example.com/s.json\"}",
              "only references into the schema itself");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"string\",\"format\":\"uri\"}",
              "format 'uri' is not supported");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"string\",\"pattern\":\"(?=x)\"}",
              "pattern: offset 0: lookaround");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"string\",\"pattern\":\"a\",\"maxLength\":3}",
              "'pattern' together with");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"number\",\"minimum\":0.5}",
              "only integer bounds");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"integer\",\"minimum\":5,\"maximum\":4}",
              "no integer");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"array\",\"uniqueItems\":true}", "uniqueItems");
  check_error(KILN_GUIDE_JSON_SCHEMA,
              "{\"type\":\"object\",\"required\":[\"x\"],\"properties\":{}}",
              "required property 'x'");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"string\",\"maxLength\":1,\"minLength\":2}",
              "below minLength");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"string\",\"maxLength\":100000}",
              "lengths above");
  check_error(KILN_GUIDE_JSON_SCHEMA, "false", "matches nothing");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"not\":{}}", "keyword 'not' is not supported");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"if\":{},\"then\":{}}", "keyword 'if' is not supported");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"object\",\"patternProperties\":{}}",
              "'patternProperties'");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"anyOf\":[],\"type\":\"string\"}", "anyOf");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"enum\":[1],\"minimum\":0}", "'enum' together with");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"allOf\":[{\"type\":\"string\"}]}",
              "allOf is supported for object schemas only");
  check_error(KILN_GUIDE_JSON_SCHEMA,
              "{\"allOf\":[{\"type\":\"object\",\"properties\":{\"a\":{}},\"required\":[\"a\"]},"
              "{\"type\":\"object\",\"additionalProperties\":false}]}",
              "no object fits");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{\"type\": [1]}", "unknown type in 'type'[0]");
  check_error(KILN_GUIDE_JSON_SCHEMA, "{not json", "json_schema: line 1");
  check_error(KILN_GUIDE_CHOICE, "[]", "non-empty array");
  check_error(KILN_GUIDE_CHOICE, "[\"a\", 1]", "choice[1]");
  /* deep nesting is refused, not a stack overflow */
  char deep[4096] = "";
  for (int i = 0; i < 100; i++) strcat(deep, "{\"items\":");
  strcat(deep, "{}");
  for (int i = 0; i < 100; i++) strcat(deep, "}");
  check_error(KILN_GUIDE_JSON_SCHEMA, deep, "nested more than");
}

/* Every schema of the corpus compiles; the typical one well within 10 ms. */
static void test_corpus_compiles(void **state) {
  (void)state;
  char dir[1024];
  const char *src = getenv("KILN_SOURCE_DIR");
  snprintf(dir, sizeof(dir), "%s/tests/data/schemas", src ? src : "..");
  DIR *d = opendir(dir);
  assert_non_null(d);
  struct dirent *de;
  double ms[512];
  int n = 0;
  while ((de = readdir(d)) && n < 512) {
    size_t l = strlen(de->d_name);
    if (l < 6 || strcmp(de->d_name + l - 5, ".json")) continue;
    char path[2048];
    snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    char buf[65536];
    size_t len = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[len] = 0;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    kiln_guide_t *g = NULL;
    kiln_status_t st = kiln_guide_compile(NULL, KILN_GUIDE_JSON_SCHEMA, buf, len, &g);
    clock_gettime(CLOCK_MONOTONIC, &b);
    if (st) fail_msg("%s: %s", de->d_name, kiln_status_message(st));
    kiln_guide_release(g);
    ms[n++] = (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) * 1e-6;
  }
  closedir(d);
  assert_true(n >= 100);
  for (int i = 1; i < n; i++)
    for (int j = i; j > 0 && ms[j] < ms[j - 1]; j--) {
      double t = ms[j];
      ms[j] = ms[j - 1];
      ms[j - 1] = t;
    }
  printf("test_guide: %d corpus schemas compile: median %.3f ms, max %.3f ms\n", n, ms[n / 2],
         ms[n - 1]);
  if (!slow_host()) assert_true(ms[n / 2] < 10.0);
}

/* ---- masks ---------------------------------------------------------------------------------- */

/* Walks a constraint with random allowed tokens for up to `steps` tokens, checking every mask
 * against every token's brute-force acceptance (when brute), that end of sequence goes with
 * accepting, and that the produced bytes are accepted by a fresh matcher. Returns the bytes. */
static void walk(kiln_guide_vocab_t *v, kiln_guide_t *g, int steps, bool brute, kiln_strbuf_t *out,
                 const int32_t *never, int nnever) {
  const int32_t V = kiln_guide_vocab_size(v), W = kiln_guide_mask_words(v);
  uint32_t *mask = malloc((size_t)W * 4);
  kiln_guide_matcher_t *m;
  assert_null(kiln_guide_matcher_create(g, &m));
  kiln_strbuf_reset(out);
  for (int s = 0; s < steps; s++) {
    assert_null(kiln_guide_matcher_fill_mask(m, mask));
    int32_t cnt = 0;
    for (int32_t t = 0; t < V; t++) cnt += (mask[t >> 5] >> (t & 31)) & 1;
    for (int i = 0; i < nnever; i++)
      if ((mask[never[i] >> 5] >> (never[i] & 31)) & 1)
        fail_msg("token %d allowed at step %d", never[i], s);
    if (brute) {
      for (int32_t t = 0; t < V; t++) {
        kiln_guide_matcher_t *c;
        assert_null(kiln_guide_matcher_clone(m, &c));
        bool ok = kiln_guide_matcher_accept_token(c, t);
        kiln_guide_matcher_free(c);
        bool in = (mask[t >> 5] >> (t & 31)) & 1;
        if (ok != in) {
          size_t l = 0;
          const uint8_t *b = kiln_guide_vocab_token(v, t, &l);
          fail_msg("step %d after '%s': token %d ('%.*s') brute force %d, mask %d", s,
                   kiln_strbuf_cstr(out), (int)t, (int)l, b ? (const char *)b : "", ok, in);
        }
      }
    }
    if (!cnt) {
      assert_true(kiln_guide_matcher_accepting(m)); /* no dead ends */
      break;
    }
    if (kiln_guide_matcher_accepting(m) && rnd(5) == 0) break;
    int32_t pick = (int32_t)rnd((uint32_t)cnt), t = 0;
    for (t = 0; t < V; t++)
      if (((mask[t >> 5] >> (t & 31)) & 1) && pick-- == 0) break;
    size_t l;
    const uint8_t *b = kiln_guide_vocab_token(v, t, &l);
    kiln_strbuf_append(out, b, l);
    assert_true(kiln_guide_matcher_accept_token(m, t));
  }
  if (kiln_guide_matcher_accepting(m))
    assert_true(matches(g, out->data ? out->data : "", out->len));
  kiln_guide_matcher_free(m);
  free(mask);
}

/* A vocabulary made for the edge cases: every byte, JSON punctuation runs, words with and
 * without a leading space, UTF-8 characters whole and split, specials. */
static kiln_guide_vocab_t *synthetic_vocab(int32_t *nspecial, int32_t *specials) {
  static const char *const multi[] = {
      "\"}",   "\",",    "\":\"",    "{\"",   "\"}]", "\":",      "},{\"",    "[{",
      "}]}",   "\\\"",   "\\u00",    "\\n\"", "\" ",  " \"",      "\": ",     ",\n  \"",
      "{\n",   "\n}",    "  ",       "    ",  "true", "false",    "null",     "nul",
      "tr",    "12",     "345",      "-0",    "0.",   ".5",       "e+1",      "name",
      " name", "age\"",  "\"name\"", "a@b",   ".com", "é",        "中文",     "\xc3",
      "\xa9",  "\xa9\"", "\xe4\xb8", "\xad",  "😀",    "\xf0\x9f", "\x98\x80", "ab",
      "abc",   " the",   "the\"",    "x\"}",  "yes",  "no",       "n/a",      " ✓",
      /* longer than the counts of the bounded repetitions below */
      "aaaaaaaa", "abababab", "hello world, this is", "cccccccccccccccc\"", "ab-ab-", "a-b-c-",
      "abcd\"}", "xxxxxxxxxxxxxxxxxxxxxxxx", "cabcabcabc", "abcabcabcabcabcd", "     "};
  const int32_t nm = (int32_t)(sizeof(multi) / sizeof(multi[0]));
  const int32_t V = 256 + nm + 3;
  const char **tok = calloc((size_t)V, sizeof(char *));
  size_t *len = calloc((size_t)V, sizeof(size_t));
  bool *sp = calloc((size_t)V, 1);
  static char bytes[256];
  for (int i = 0; i < 256; i++) {
    bytes[i] = (char)i;
    tok[i] = &bytes[i];
    len[i] = 1;
  }
  for (int32_t i = 0; i < nm; i++) {
    tok[256 + i] = multi[i];
    len[256 + i] = strlen(multi[i]);
  }
  static const char *const spec[] = {"<|im_end|>", "<|endoftext|>", "\""};
  *nspecial = 3;
  for (int i = 0; i < 3; i++) {
    int32_t id = 256 + nm + i;
    tok[id] = spec[i];
    len[id] = strlen(spec[i]);
    sp[id] = true; /* a special token whose text is a quote is still never allowed */
    specials[i] = id;
  }
  kiln_guide_vocab_t *v = NULL;
  assert_null(kiln_guide_vocab_create_bytes(V, tok, len, sp, &v));
  free(tok);
  free(len);
  free(sp);
  return v;
}

static const char *const walk_specs[][2] = {
    {"2",
     "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":6},"
     "\"age\":{\"type\":\"integer\",\"minimum\":-5,\"maximum\":345},\"ok\":{\"type\":\"boolean\"},"
     "\"l\":{\"type\":\"array\",\"items\":{\"type\":[\"number\",\"null\"]},\"maxItems\":3}},"
     "\"required\":[\"name\"]}"},
    {"1", NULL},
    {"2",
     "{\"$defs\":{\"t\":{\"type\":\"object\",\"properties\":{\"v\":{\"enum\":[\"a\",\"é\",\"中文\"]"
     "},"
     "\"c\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/t\"},\"maxItems\":2}},"
     "\"required\":[\"v\",\"c\"]}},\"$ref\":\"#/$defs/t\"}"},
    {"2",
     "{\"type\":\"object\",\"additionalProperties\":{\"type\":\"string\",\"format\":\"email\"}}"},
    {"3", "[a-c]{1,3}(@[a-z]+\\.com)?|\\d+\\.?\\d*|中+😀?"},
    {"4", "[\"yes\",\"no\",\"n/a ✓\",\"nothing\"]"},
    {"5",
     "root ::= obj\nobj ::= \"{\" (pair (\",\" pair)*)? \"}\"\npair ::= [a-z]+ \":\" (obj | [0-9]+ "
     "| \"\\\"\" [^\"]* \"\\\"\")"},
    /* bounded repetitions whose links are classified from the unbounded rule (guide.c) */
    {"2", "{\"type\":\"string\",\"minLength\":3,\"maxLength\":20}"},
    {"2",
     "{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":9},\"maxItems\":4}"},
    {"3", "(ab|c){2,9}d"},
    {"3", "([a-c]{1,3}-){0,4}[a-c]{0,12}"},
    {"3", "[a-z ,]{0,30}!"},
    {"5", "root ::= (\"x\"{0,5} \"ab\"?){1,6} \"\\\"\""},
};

static void test_masks_synthetic(void **state) {
  (void)state;
  int32_t ns, specials[3];
  kiln_guide_vocab_t *v = synthetic_vocab(&ns, specials);
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  int runs = slow_host() ? 3 : 25;
  for (size_t i = 0; i < sizeof(walk_specs) / sizeof(walk_specs[0]); i++) {
    kiln_guide_t *g = compile_ok(v, (kiln_guide_kind_t)atoi(walk_specs[i][0]), walk_specs[i][1]);
    for (int r = 0; r < runs; r++) walk(v, g, 60, true, &out, specials, ns);
    kiln_guide_release(g);
  }
  /* a UTF-8 character split across tokens: after "\xc3" inside a string only continuation
   * bytes may come */
  kiln_guide_t *g = compile_ok(v, KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"string\"}");
  kiln_guide_matcher_t *m;
  assert_null(kiln_guide_matcher_create(g, &m));
  assert_true(kiln_guide_matcher_accept_bytes(m, "\"\xc3", 2));
  uint32_t *mask = malloc((size_t)kiln_guide_mask_words(v) * 4);
  assert_null(kiln_guide_matcher_fill_mask(m, mask));
  for (int32_t t = 0; t < kiln_guide_vocab_size(v); t++) {
    if (!((mask[t >> 5] >> (t & 31)) & 1)) continue;
    size_t l;
    const uint8_t *b = kiln_guide_vocab_token(v, t, &l);
    assert_true(b[0] >= 0x80 && b[0] <= 0xBF);
  }
  assert_false(kiln_guide_matcher_accept_bytes(m, "\"", 1)); /* "\xc3\"" is not UTF-8 */
  assert_true(kiln_guide_matcher_accept_bytes(m, "\xa9\"", 2));
  assert_true(kiln_guide_matcher_finished(m));
  free(mask);
  kiln_guide_matcher_free(m);
  kiln_guide_release(g);
  kiln_strbuf_free(&out);
  kiln_guide_stats_t st;
  kiln_guide_vocab_stats(v, &st);
  printf("test_guide: synthetic vocabulary: %llu chains classified (%llu derived), %llu found in "
         "the cache (%llu links as their unbounded rule)\n",
         (unsigned long long)st.classified, (unsigned long long)st.derived,
         (unsigned long long)st.class_hits, (unsigned long long)st.derived_same);
  assert_true(st.class_hits > 0);
  /* the bounded repetitions' links took both paths against brute force */
  assert_true(st.derived > 0);
  assert_true(st.derived_same > 0);
  kiln_guide_vocab_free(v);
}

/* The vocabulary's caches: the same spec compiles once; a second schema sharing the JSON rules
 * finds their classifications cached. */
static void test_caches(void **state) {
  (void)state;
  int32_t ns, specials[3];
  kiln_guide_vocab_t *v = synthetic_vocab(&ns, specials);
  kiln_guide_t *a =
      compile_ok(v, KILN_GUIDE_JSON_SCHEMA,
                 "{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"string\"}}}");
  kiln_guide_t *b =
      compile_ok(v, KILN_GUIDE_JSON_SCHEMA,
                 "{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"string\"}}}");
  assert_ptr_equal(a, b);
  kiln_guide_stats_t st;
  kiln_guide_vocab_stats(v, &st);
  assert_int_equal(st.compiles, 1);
  assert_int_equal(st.compile_hits, 1);
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  walk(v, a, 40, false, &out, NULL, 0);
  { /* the inside of a's string, classified whatever the random walk did */
    kiln_guide_matcher_t *ma;
    assert_null(kiln_guide_matcher_create(a, &ma));
    assert_true(kiln_guide_matcher_accept_bytes(ma, "{\"x\":\"", 6));
    uint32_t *mk = malloc((size_t)kiln_guide_mask_words(v) * 4);
    assert_null(kiln_guide_matcher_fill_mask(ma, mk));
    free(mk);
    kiln_guide_matcher_free(ma);
  }
  kiln_guide_t *c =
      compile_ok(v, KILN_GUIDE_JSON_SCHEMA,
                 "{\"type\":\"object\",\"properties\":{\"yy\":{\"type\":\"string\"}}}");
  kiln_guide_matcher_t *m;
  assert_null(kiln_guide_matcher_create(c, &m));
  assert_true(kiln_guide_matcher_accept_bytes(m, "{\"yy\":\"", 7));
  uint64_t hits0;
  kiln_guide_vocab_stats(v, &st);
  hits0 = st.class_hits;
  uint32_t *mask = malloc((size_t)kiln_guide_mask_words(v) * 4);
  assert_null(kiln_guide_matcher_fill_mask(m, mask));
  kiln_guide_vocab_stats(v, &st);
  assert_true(st.class_hits > hits0); /* the string's inside, classified for schema a */
  /* compaction keeps the position */
  kiln_guide_matcher_t *k;
  assert_null(kiln_guide_matcher_clone(m, &k));
  int32_t before = kiln_guide_matcher_nodes(k);
  assert_true(kiln_guide_matcher_compact(k));
  assert_true(kiln_guide_matcher_nodes(k) <= before);
  uint32_t *mask2 = malloc((size_t)kiln_guide_mask_words(v) * 4);
  assert_null(kiln_guide_matcher_fill_mask(k, mask2));
  assert_memory_equal(mask, mask2, (size_t)kiln_guide_mask_words(v) * 4);
  assert_true(kiln_guide_matcher_accept_bytes(k, "abc\"}", 5));
  assert_true(kiln_guide_matcher_finished(k));
  kiln_guide_matcher_reset(k);
  assert_false(kiln_guide_matcher_accepting(k));
  assert_true(kiln_guide_matcher_accept_bytes(k, "{}", 2));
  free(mask);
  free(mask2);
  kiln_guide_matcher_free(k);
  kiln_guide_matcher_free(m);
  kiln_guide_release(a);
  kiln_guide_release(b);
  kiln_guide_release(c);
  kiln_strbuf_free(&out);
  kiln_guide_vocab_free(v);
}

/* The real Qwen3 tokenizer from the fetch_tokenizers fixture's cache (KILN_TOKENIZER_CACHE);
 * a missing one fails the test, naming where it was looked for. */
static kiln_tokenizer_t *load_qwen3(void) {
  const char *cache = getenv("KILN_TOKENIZER_CACHE");
  char dir[1024];
  snprintf(dir, sizeof(dir), "%s/qwen3", cache ? cache : "");
  kiln_tokenizer_t *tok = NULL;
  kiln_status_t st = kiln_tokenizer_load(dir, &tok);
  if (st)
    fail_msg("the Qwen3 tokenizer (%s): %s (the fetch_tokenizers fixture fetches it)", dir,
             kiln_status_message(st));
  return tok;
}

/* The real Qwen3 tokenizer (151k tokens, byte-level BPE): masks against brute force for a few
 * steps, special tokens never allowed, and a timing line. */
static void test_masks_qwen3(void **state) {
  (void)state;
  kiln_tokenizer_t *tok = load_qwen3();
  const int32_t V = (int32_t)kiln_tokenizer_vocab_size(tok);
  kiln_guide_vocab_t *v = NULL;
  assert_null(kiln_guide_vocab_create(tok, V, &v));
  int32_t never[8];
  int nn = 0;
  const char *sp[] = {"<|im_end|>", "<|im_start|>", "<|endoftext|>", "<tool_call>"};
  for (int i = 0; i < 4; i++) {
    int32_t id = kiln_tokenizer_token_to_id(tok, sp[i], strlen(sp[i]));
    if (id >= 0 && kiln_tokenizer_is_special(tok, id)) never[nn++] = id;
  }
  assert_true(nn >= 3);
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  const char *schema =
      "{\"type\":\"object\",\"properties\":{\"text\":{\"type\":\"string\",\"maxLength\":12},"
      "\"n\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":999}},\"required\":[\"text\",\"n\"]}";
  kiln_guide_t *g = compile_ok(v, KILN_GUIDE_JSON_SCHEMA, schema);
  walk(v, g, slow_host() ? 2 : 8, true, &out, never, nn);
  printf("test_guide: qwen3: '%s'\n", kiln_strbuf_cstr(&out));
  /* longer walks without brute force, masks still free of special tokens */
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  int walks = slow_host() ? 1 : 10;
  for (int i = 0; i < walks; i++) walk(v, g, 80, false, &out, never, nn);
  clock_gettime(CLOCK_MONOTONIC, &b);
  printf("test_guide: qwen3: %d walks of up to 80 tokens in %.1f ms\n", walks,
         (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) * 1e-6);
  kiln_guide_release(g);
  /* a long bounded string: links near the bound walk most tokens, far from it only the long
   * ones (derived from the unbounded string's classification), all against brute force */
  g = compile_ok(v, KILN_GUIDE_JSON_SCHEMA, "{\"type\":\"string\",\"minLength\":2,\"maxLength\":40}");
  kiln_guide_stats_t gs0, gs1;
  kiln_guide_vocab_stats(v, &gs0);
  for (int i = 0; i < (slow_host() ? 1 : 3); i++) walk(v, g, slow_host() ? 3 : 8, true, &out, never, nn);
  kiln_guide_vocab_stats(v, &gs1);
  assert_true(gs1.derived + gs1.derived_same > gs0.derived + gs0.derived_same);
  kiln_guide_release(g);
  /* tokens that span several JSON structural characters are used where they fit */
  int32_t id = kiln_tokenizer_token_to_id(tok, "\":\"", 3);
  if (id >= 0) {
    g = compile_ok(
        v, KILN_GUIDE_JSON_SCHEMA,
        "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"}},\"required\":[\"a\"]}");
    kiln_guide_matcher_t *m;
    assert_null(kiln_guide_matcher_create(g, &m));
    assert_true(kiln_guide_matcher_accept_bytes(m, "{\"a", 3));
    uint32_t *mask = malloc((size_t)kiln_guide_mask_words(v) * 4);
    assert_null(kiln_guide_matcher_fill_mask(m, mask));
    assert_true((mask[id >> 5] >> (id & 31)) & 1);
    free(mask);
    kiln_guide_matcher_free(m);
    kiln_guide_release(g);
  }
  kiln_strbuf_free(&out);
  kiln_guide_vocab_free(v);
  kiln_tokenizer_free(tok);
}


/* kiln_guide_precompute changes no mask: every corpus schema walked with the same token choices
 * over two indexes of the Qwen3 vocabulary (separate caches), one precomputed on a second thread
 * while the walk runs (the walk waits for contexts in progress), the other not. */
typedef struct pc_arg {
  kiln_guide_t *g;
  int32_t states;
  kiln_status_t st;
} pc_arg_t;
static void *pc_thread(void *p) {
  pc_arg_t *a = p;
  a->st = kiln_guide_precompute(a->g, slow_host() ? 16 : 96, 0, NULL, &a->states);
  return NULL;
}

static void test_precompute_corpus(void **state) {
  (void)state;
  kiln_tokenizer_t *tok = load_qwen3();
  const int32_t V = (int32_t)kiln_tokenizer_vocab_size(tok);
  kiln_guide_vocab_t *va = NULL, *vb = NULL;
  assert_null(kiln_guide_vocab_create(tok, V, &va));
  assert_null(kiln_guide_vocab_create(tok, V, &vb));
  const size_t W = (size_t)kiln_guide_mask_words(va);
  uint32_t *ma = malloc(W * 4), *mb = malloc(W * 4);
  assert_non_null(ma);
  assert_non_null(mb);
  const char *src = getenv("KILN_SOURCE_DIR");
  char dir[1024];
  snprintf(dir, sizeof(dir), "%s/tests/data/schemas", src ? src : "..");
  DIR *d = opendir(dir);
  assert_non_null(d);
  int n = 0, steps_total = 0, states_total = 0;
  const int max_schemas = slow_host() ? 6 : 1000, steps = slow_host() ? 6 : 40;
  uint64_t rng = 7;
  for (struct dirent *de; (de = readdir(d)) && n < max_schemas;) {
    size_t l = strlen(de->d_name);
    if (l < 6 || strcmp(de->d_name + l - 5, ".json")) continue;
    char path[2048];
    snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    static char buf[65536];
    size_t len = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[len] = 0;
    kiln_guide_t *ga = NULL, *gb = NULL;
    kiln_status_t sa = kiln_guide_compile(va, KILN_GUIDE_JSON_SCHEMA, buf, len, &ga);
    if (sa) { /* the corpus test covers the schemas that do not compile */
      kiln_status_free(sa);
      continue;
    }
    assert_null(kiln_guide_compile(vb, KILN_GUIDE_JSON_SCHEMA, buf, len, &gb));
    n++;
    pc_arg_t arg = {.g = gb};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, pc_thread, &arg), 0);
    kiln_guide_matcher_t *a = NULL, *b = NULL;
    assert_null(kiln_guide_matcher_create(ga, &a));
    assert_null(kiln_guide_matcher_create(gb, &b));
    for (int s = 0; s < steps; s++) {
      assert_null(kiln_guide_matcher_fill_mask(a, ma));
      assert_null(kiln_guide_matcher_fill_mask(b, mb));
      if (memcmp(ma, mb, W * 4)) fail_msg("%s: step %d: the masks differ", de->d_name, s);
      int32_t cnt = 0;
      for (size_t w = 0; w < W; w++) cnt += __builtin_popcount(ma[w]);
      if (!cnt) break;
      rng = rng * 6364136223846793005ull + 1442695040888963407ull;
      int32_t k = (int32_t)((rng >> 33) % (uint64_t)cnt), id = -1;
      for (size_t w = 0; w < W && id < 0; w++)
        for (uint32_t bits = ma[w]; bits; bits &= bits - 1)
          if (k-- == 0) {
            id = (int32_t)(w * 32) + __builtin_ctz(bits);
            break;
          }
      assert_true(kiln_guide_matcher_accept_token(a, id));
      assert_true(kiln_guide_matcher_accept_token(b, id));
      steps_total++;
    }
    pthread_join(th, NULL);
    assert_null(arg.st);
    states_total += arg.states;
    kiln_guide_matcher_free(a);
    kiln_guide_matcher_free(b);
    kiln_guide_release(ga);
    kiln_guide_release(gb);
  }
  closedir(d);
  assert_true(n > 0);
  printf("test_guide: precompute: %d schemas, %d steps, same masks (%d states precomputed)\n", n,
         steps_total, states_total);
  free(ma);
  free(mb);
  kiln_guide_vocab_free(va);
  kiln_guide_vocab_free(vb);
  kiln_tokenizer_free(tok);
}

/* ---- the engine -------------------------------------------------------------------------- */

typedef struct run_out {
  char text[8][4096];
  int32_t ntok[8];
  kiln_finish_reason_t finish[8];
  float lp0[8], top0[8][5];
  int32_t topid0[8][5];
} run_out_t;

static kiln_engine_t *engine(const char *extra1, const char *extra2) {
  char model[1200];
  const char *src = getenv("KILN_SOURCE_DIR");
  snprintf(model, sizeof(model), "model.path=%s/share/models/kiln-tiny", src ? src : "..");
  const char *ov[7] = {"backend.name=cpu", model, "backend.threads=1", "engine.max_num_seqs=8",
                       "cache.block_size=8"};
  int n = 5;
  if (extra1) ov[n++] = extra1;
  if (extra2) ov[n++] = extra2;
  kiln_engine_t *e = NULL;
  kiln_status_t st = kiln_engine_create(NULL, ov, n, &e);
  if (st) fail_msg("engine: %s", kiln_status_message(st));
  return e;
}

static void run_req(kiln_engine_t *e, const char *prompt, kiln_sampling_params_t *p, run_out_t *o) {
  memset(o, 0, sizeof(*o));
  kiln_request_desc_t d;
  memset(&d, 0, sizeof(d));
  d.struct_size = sizeof(d);
  d.prompt = prompt;
  d.params = p;
  kiln_request_t *r = NULL;
  kiln_status_t st = kiln_engine_submit(e, &d, &r);
  if (st) fail_msg("submit: %s", kiln_status_message(st));
  for (;;) {
    kiln_output_t *ev = NULL;
    assert_null(kiln_request_poll(r, -1, &ev));
    if (!ev) break;
    int32_t i = ev->index;
    strncat(o->text[i], ev->text, sizeof(o->text[i]) - strlen(o->text[i]) - 1);
    if (ev->num_tokens && ev->logprobs && o->ntok[i] == 0) {
      o->lp0[i] = ev->logprobs[0];
      for (int k = 0; k < ev->top_n && k < 5; k++) {
        o->top0[i][k] = ev->top_logprobs[k];
        o->topid0[i][k] = ev->top_ids[k];
      }
    }
    o->ntok[i] += ev->num_tokens;
    if (ev->finish_reason) o->finish[i] = ev->finish_reason;
    bool last = ev->request_finished;
    kiln_output_free(ev);
    if (last) break;
  }
  kiln_request_release(r);
}

static void test_engine_guided(void **state) {
  (void)state;
  const char *schema =
      "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":10},"
      "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\",\"c\"]},\"maxItems\":3},"
      "\"n\":{\"type\":\"integer\",\"minimum\":1,\"maximum\":50}},\"required\":[\"name\",\"n\"]}";
  kiln_guide_t *g = compile_ok(NULL, KILN_GUIDE_JSON_SCHEMA, schema);
  kiln_sampling_params_t p;
  kiln_sampling_params_init(&p);
  p.n = 3;
  p.max_tokens = 200;
  p.temperature = 0.9f;
  p.has_seed = true;
  p.seed = 11;
  p.logprobs = 3;
  p.guide = KILN_GUIDE_JSON_SCHEMA;
  p.guide_spec = schema;
  const char *prompt = "The record of the day is";
  kiln_engine_t *e = engine(NULL, NULL);
  run_out_t plain, again, pre;
  run_req(e, prompt, &p, &plain);
  run_req(e, prompt, &p, &again); /* the prefix cache serves the prompt */
  int finished = 0;
  for (int i = 0; i < 3; i++) {
    assert_string_equal(plain.text[i], again.text[i]);
    if (plain.finish[i] == KILN_FINISH_STOP) {
      finished++;
      if (!matches(g, plain.text[i], strlen(plain.text[i])))
        fail_msg("sequence %d: '%s' does not match the schema", i, plain.text[i]);
      kiln_json_doc_t *doc = NULL;
      kiln_status_t st = kiln_json_parse(plain.text[i], strlen(plain.text[i]), "output", &doc);
      if (st) fail_msg("%s", kiln_status_message(st));
      kiln_json_doc_free(doc);
    }
    /* logprobs are of the masked distribution: the first token is "{" (or whitespace is not
     * allowed before it), with probability 1 */
    assert_true(plain.lp0[i] > -1e-4f);
    assert_true(plain.top0[i][1] == -INFINITY);
  }
  printf("test_guide: engine: %d of 3 sequences finished: %s\n", finished, plain.text[0]);
  assert_true(finished >= 2);
  kiln_engine_destroy(e);
  /* chunked prefill (4 tokens a step) and preemption (a pool too small for 3 sequences at
   * once) give the same tokens */
  e = engine("engine.max_num_batched_tokens=4", "cache.num_blocks=10");
  kiln_sampling_params_t q = p;
  q.max_tokens = 60; /* 67 tokens: 9 blocks of 8 for one sequence; three need more */
  run_out_t ref;
  kiln_engine_t *e0 = engine(NULL, NULL);
  run_req(e0, prompt, &q, &ref);
  kiln_engine_destroy(e0);
  run_req(e, prompt, &q, &pre);
  kiln_metrics_t mt;
  kiln_engine_get_metrics(e, &mt);
  printf("test_guide: engine under preemption: %llu preemptions\n",
         (unsigned long long)mt.preemptions);
  assert_true(mt.preemptions > 0);
  for (int i = 0; i < 3; i++) {
    assert_string_equal(ref.text[i], pre.text[i]);
    assert_int_equal(ref.finish[i], pre.finish[i]);
  }
  kiln_engine_destroy(e);
  /* ignore_eos: the request still ends (with stop) when nothing may follow; choice and regex */
  e = engine(NULL, NULL);
  kiln_sampling_params_t c;
  kiln_sampling_params_init(&c);
  c.max_tokens = 30;
  c.ignore_eos = true;
  c.guide = KILN_GUIDE_CHOICE;
  c.guide_spec = "[\"alpha\", \"beta\", \"gamma delta\"]";
  run_out_t co;
  run_req(e, prompt, &c, &co);
  assert_int_equal(co.finish[0], KILN_FINISH_STOP);
  assert_true(!strcmp(co.text[0], "alpha") || !strcmp(co.text[0], "beta") ||
              !strcmp(co.text[0], "gamma delta"));
  c.guide = KILN_GUIDE_REGEX;
  c.guide_spec = "[0-9]{3}-[a-z]{2}";
  run_req(e, prompt, &c, &co);
  assert_int_equal(co.finish[0], KILN_FINISH_STOP);
  assert_int_equal(strlen(co.text[0]), 6);
  /* refusals name the kind's field */
  c.guide = KILN_GUIDE_JSON_SCHEMA;
  c.guide_spec = "{\"type\":\"object\",\"minProperties\":1}";
  kiln_request_desc_t d;
  memset(&d, 0, sizeof(d));
  d.struct_size = sizeof(d);
  d.prompt = prompt;
  d.params = &c;
  kiln_request_t *r = NULL;
  kiln_status_t st = kiln_engine_submit(e, &d, &r);
  assert_non_null(st);
  assert_null(r);
  assert_non_null(
      strstr(kiln_status_message(st), "json_schema: keyword 'minProperties' is not supported"));
  kiln_status_free(st);
  c.guide = (kiln_guide_kind_t)9;
  st = kiln_engine_submit(e, &d, &r);
  assert_non_null(strstr(kiln_status_message(st), "guide: unknown kind 9"));
  kiln_status_free(st);
  c.guide = KILN_GUIDE_REGEX;
  c.guide_spec = NULL;
  st = kiln_engine_submit(e, &d, &r);
  assert_non_null(strstr(kiln_status_message(st), "guide_spec is missing"));
  kiln_status_free(st);
  kiln_engine_destroy(e);
  kiln_guide_release(g);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The metrics once at least jobs precomputations ended (at most 20 s: the budget is 200 ms). */
static kiln_metrics_t precompute_metrics(kiln_engine_t *e, uint64_t jobs) {
  kiln_metrics_t mt;
  const double t0 = now_s();
  for (;;) {
    kiln_engine_get_metrics_sized(e, &mt, sizeof(mt));
    if (mt.guide_precompute_jobs >= jobs || now_s() - t0 > 20) return mt;
    struct timespec ts = {0, 5000000};
    nanosleep(&ts, NULL);
  }
}

/* [engine] guide_precompute_ms: the same tokens with the constraints' first contexts
 * classified ahead on the engine's precompute thread or not; a schema that comes again (a
 * cached compile, the same object) is precomputed once; destroy right after submit stops the
 * thread without waiting for its budget. */
static void test_engine_precompute(void **state) {
  (void)state;
  const char *schema_a =
      "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":10},"
      "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\",\"c\"]},\"maxItems\":3},"
      "\"n\":{\"type\":\"integer\",\"minimum\":1,\"maximum\":50}},\"required\":[\"name\",\"n\"]}";
  const char *schema_b =
      "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},"
      "\"zip\":{\"type\":\"string\",\"pattern\":\"^[0-9]{5}$\"},\"ok\":{\"type\":\"boolean\"}},"
      "\"required\":[\"city\",\"zip\",\"ok\"],\"additionalProperties\":false}";
  const char *specs[3] = {schema_a, schema_a, schema_b};
  const char *prompt = "The record of the day is";
  kiln_sampling_params_t p;
  kiln_sampling_params_init(&p);
  p.n = 2;
  p.max_tokens = slow_host() ? 24 : 80; /* the same comparisons, shorter under valgrind */
  p.temperature = 0.9f;
  p.has_seed = true;
  p.seed = 5;
  p.guide = KILN_GUIDE_JSON_SCHEMA;
  run_out_t *o = calloc(6, sizeof(run_out_t)); /* [off, on][request] */
  assert_non_null(o);
  const char *opt[2] = {"engine.guide_precompute_ms=0", "engine.guide_precompute_ms=200"};
  for (int on = 0; on < 2; on++) {
    kiln_engine_t *e = engine(opt[on], NULL);
    for (int k = 0; k < 3; k++) {
      p.guide_spec = specs[k];
      run_req(e, prompt, &p, &o[on * 3 + k]);
    }
    kiln_metrics_t mt = precompute_metrics(e, on ? 2 : 0);
    printf("test_guide: engine precompute %s: %llu jobs, %llu states\n", opt[on],
           (unsigned long long)mt.guide_precompute_jobs,
           (unsigned long long)mt.guide_precompute_states);
    assert_int_equal(mt.guide_precompute_jobs, on ? 2 : 0); /* schema_a once */
    if (on)
      assert_true(mt.guide_precompute_states > 0);
    else
      assert_int_equal(mt.guide_precompute_states, 0);
    kiln_engine_destroy(e);
  }
  for (int k = 0; k < 3; k++)
    for (int i = 0; i < 2; i++) {
      assert_true(o[k].ntok[i] > 0);
      assert_string_equal(o[k].text[i], o[3 + k].text[i]);
      assert_int_equal(o[k].ntok[i], o[3 + k].ntok[i]);
      assert_int_equal(o[k].finish[i], o[3 + k].finish[i]);
    }
  for (int i = 0; i < 2; i++) assert_string_equal(o[0].text[i], o[1].text[i]); /* same seed */
  printf("test_guide: engine precompute: same tokens on and off: %s | %s\n", o[0].text[0],
         o[2].text[0]);
  free(o);
  /* destroy right after submit: queued and running precomputations end, their constraints
   * released (valgrind / ASan see the rest) */
  kiln_engine_t *e = engine("engine.guide_precompute_ms=60000", NULL);
  const char *more[3] = {schema_a, schema_b,
                         "{\"type\":\"array\",\"items\":{\"type\":\"number\"}}"};
  for (int k = 0; k < 3; k++) {
    kiln_request_desc_t d;
    memset(&d, 0, sizeof(d));
    d.struct_size = sizeof(d);
    d.prompt = prompt;
    d.params = &p;
    p.guide_spec = more[k];
    kiln_request_t *r = NULL;
    kiln_status_t st = kiln_engine_submit(e, &d, &r);
    if (st) fail_msg("submit: %s", kiln_status_message(st));
    kiln_request_release(r);
  }
  const double t0 = now_s();
  kiln_engine_destroy(e);
  const double dt = now_s() - t0;
  printf("test_guide: engine destroyed %.1f ms after 3 guided submits\n", dt * 1e3);
  assert_true(dt < 10); /* the budget is 60 s; the stop flag ends it at the next state */
}

int main(int argc, char **argv) {
  if (argc > 1) cmocka_set_test_filter(argv[1]); /* e.g. test_guide 'test_engine*' */
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gbnf),
      cmocka_unit_test(test_gbnf_errors),
      cmocka_unit_test(test_regex),
      cmocka_unit_test(test_regex_vs_pcre2),
      cmocka_unit_test(test_schema),
      cmocka_unit_test(test_schema_errors),
      cmocka_unit_test(test_corpus_compiles),
      cmocka_unit_test(test_masks_synthetic),
      cmocka_unit_test(test_caches),
      cmocka_unit_test(test_masks_qwen3),
      cmocka_unit_test(test_precompute_corpus),
      cmocka_unit_test(test_engine_guided),
      cmocka_unit_test(test_engine_precompute),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
