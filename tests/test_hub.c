/* test_hub.c - cmocka tests for models/hub without a network: SHA-256 and SHA-1 against the
 * FIPS 180 test vectors and git's blob ids, streamed in every split; Hub id parsing (good and
 * bad ids, each error naming its part); the cache folder from the options and the environment;
 * resolution from a hand-made huggingface_hub cache (refs, snapshot links into blobs,
 * .no_exist, shards listed by an index, a .gguf) with the network forbidden, and the errors
 * that say what the cache lacks; kiln_model_resolve's rule that an existing path wins. The
 * HTTP side is tests/test_hub.sh's (against tests/fake_hub_server.py). */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/config.h"
#include "models/hub/hub.h"
#include "models/hub/sha.h"

/* ---- SHA ------------------------------------------------------------------------------------ */

static void sha256_hex(const void *p, size_t n, char hex[65]) {
  kiln_sha256_t c;
  kiln_sha256_init(&c);
  kiln_sha256_update(&c, p, n);
  kiln_sha256_final_hex(&c, hex);
}

static void sha1_hex(const void *p, size_t n, char hex[41]) {
  kiln_sha1_t c;
  kiln_sha1_init(&c);
  kiln_sha1_update(&c, p, n);
  kiln_sha1_final_hex(&c, hex);
}

static void test_sha_vectors(void **state) {
  (void)state;
  char h[65];
  /* FIPS 180-2 appendix B / C examples, and the empty message */
  sha256_hex("abc", 3, h);
  assert_string_equal(h, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  sha256_hex("", 0, h);
  assert_string_equal(h, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  const char *m448 = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  sha256_hex(m448, strlen(m448), h);
  assert_string_equal(h, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  sha1_hex("abc", 3, h);
  assert_string_equal(h, "a9993e364706816aba3e25717850c26c9cd0d89d");
  sha1_hex("", 0, h);
  assert_string_equal(h, "da39a3ee5e6b4b0d3255bfef95601890afd80709");
  sha1_hex(m448, strlen(m448), h);
  assert_string_equal(h, "84983e441c3bd26ebaae4aa1f95129e5e54670f1");
  /* one million 'a' */
  char *a = malloc(1000000);
  assert_non_null(a);
  memset(a, 'a', 1000000);
  sha256_hex(a, 1000000, h);
  assert_string_equal(h, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  sha1_hex(a, 1000000, h);
  assert_string_equal(h, "34aa973cd4c4daa4f61eeb2bdbad27316534016f");
  free(a);
}

/* Every split of a message into two updates (and byte-at-a-time) gives the one-shot digest. */
static void test_sha_streaming(void **state) {
  (void)state;
  unsigned char msg[300];
  for (int i = 0; i < 300; i++) msg[i] = (unsigned char)(i * 7 + 3);
  for (size_t n = 0; n <= sizeof(msg); n += 13) {
    char one256[65], one1[41];
    sha256_hex(msg, n, one256);
    sha1_hex(msg, n, one1);
    for (size_t k = 0; k <= n; k++) {
      kiln_sha256_t c;
      kiln_sha1_t d;
      kiln_sha256_init(&c);
      kiln_sha1_init(&d);
      kiln_sha256_update(&c, msg, k);
      kiln_sha256_update(&c, msg + k, n - k);
      kiln_sha1_update(&d, msg, k);
      kiln_sha1_update(&d, msg + k, n - k);
      char h[65], g[41];
      kiln_sha256_final_hex(&c, h);
      kiln_sha1_final_hex(&d, g);
      assert_string_equal(h, one256);
      assert_string_equal(g, one1);
    }
    kiln_sha256_t c;
    kiln_sha256_init(&c);
    for (size_t k = 0; k < n; k++) kiln_sha256_update(&c, msg + k, 1);
    char h[65];
    kiln_sha256_final_hex(&c, h);
    assert_string_equal(h, one256);
  }
}

/* git's blob ids (`git hash-object`): the empty file and "hello\n". */
static void test_git_blob_id(void **state) {
  (void)state;
  kiln_sha1_t c;
  char h[41];
  kiln_sha1_git_blob_init(&c, 0);
  kiln_sha1_final_hex(&c, h);
  assert_string_equal(h, "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391");
  kiln_sha1_git_blob_init(&c, 6);
  kiln_sha1_update(&c, "hello\n", 6);
  kiln_sha1_final_hex(&c, h);
  assert_string_equal(h, "ce013625030ba8dba906f756967f9e9ca394464a");
}

/* ---- ids ------------------------------------------------------------------------------------ */

static void test_parse_ids(void **state) {
  (void)state;
  kiln_hub_id_t id;
  assert_null(kiln_hub_parse_id("Qwen/Qwen3-0.6B", &id));
  assert_string_equal(id.repo, "Qwen/Qwen3-0.6B");
  assert_string_equal(id.revision, "main");
  assert_string_equal(id.file, "");
  assert_null(kiln_hub_parse_id("meta-llama/Llama-3.1-8B@refs/pr/12", &id));
  assert_string_equal(id.repo, "meta-llama/Llama-3.1-8B");
  assert_string_equal(id.revision, "refs/pr/12");
  assert_null(kiln_hub_parse_id("org_1/m.v2/sub/dir/model-Q4_K_M.gguf@v1.0", &id));
  assert_string_equal(id.repo, "org_1/m.v2");
  assert_string_equal(id.file, "sub/dir/model-Q4_K_M.gguf");
  assert_string_equal(id.revision, "v1.0");
  assert_null(kiln_hub_parse_id("a/b@0123456789abcdef0123456789abcdef01234567", &id));
  assert_string_equal(id.revision, "0123456789abcdef0123456789abcdef01234567");

  static const struct {
    const char *id, *says;
  } bad[] = {
      {"", "empty"},
      {"justaname", "want ORG/NAME"},
      {"/abs/path", "the organization is empty"},
      {"./models/x", "the organization may not start or end"},
      {"../x/y", "the organization may"},
      {"org/", "the name is empty"},
      {"org/na me", "the name may hold only"},
      {"org/a--b", "\"--\""},
      {"org/a..b", "\"--\" or \"..\""},
      {"org/-x", "may not start or end"},
      {"org/x.", "may not start or end"},
      {"org/name/weights.bin", "must be a .gguf file"},
      {"org/name/../x.gguf", "not a plain relative path"},
      {"org/name//x.gguf", "not a plain relative path"},
      {"org/name@", "the revision after @ is empty"},
      {"org/name@a..b", "is not a branch, tag or commit"},
      {"org/name@x y", "is not a branch, tag or commit"},
      {"org/name@/x", "is not a branch, tag or commit"},
      {"oooooooooooooooooooooooooooooooooooooooooooooooooo/"
       "nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn",
       "longer than 96"},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    memset(&id, 0x5a, sizeof(id));
    kiln_status_t st = kiln_hub_parse_id(bad[i].id, &id);
    if (!st) fail_msg("'%s' parsed as an id", bad[i].id);
    assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
    if (!strstr(kiln_status_message(st), bad[i].says))
      fail_msg("'%s': %s (want '%s')", bad[i].id, kiln_status_message(st), bad[i].says);
    assert_int_equal((unsigned char)id.repo[0], 0x5a); /* nothing written */
    kiln_status_free(st);
  }
}

/* ---- the cache ------------------------------------------------------------------------------ */

static char tmpdir[256];

static void write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

static void sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void sh(const char *fmt, ...) {
  char cmd[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof(cmd), fmt, ap);
  va_end(ap);
  assert_int_equal(system(cmd), 0);
}

static int setup_tmp(void **state) {
  (void)state;
  snprintf(tmpdir, sizeof(tmpdir), "/tmp/kiln-test-hub-XXXXXX");
  if (!mkdtemp(tmpdir)) return -1;
  unsetenv("HF_HUB_CACHE");
  unsetenv("HUGGINGFACE_HUB_CACHE");
  unsetenv("HF_HOME");
  unsetenv("XDG_CACHE_HOME");
  unsetenv("HF_HUB_OFFLINE");
  unsetenv("HF_ENDPOINT");
  return 0;
}

static int teardown_tmp(void **state) {
  (void)state;
  char cmd[300];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
  return system(cmd) == 0 ? 0 : -1;
}

static void test_cache_dir(void **state) {
  (void)state;
  char buf[4096];
  kiln_hub_options_t o = {0};
  char *home = getenv("HOME") ? strdup(getenv("HOME")) : NULL;
  setenv("HOME", "/home/someone", 1);
  assert_null(kiln_hub_cache_dir(&o, buf, sizeof(buf)));
  assert_string_equal(buf, "/home/someone/.cache/huggingface/hub");
  setenv("XDG_CACHE_HOME", "/xdg", 1);
  assert_null(kiln_hub_cache_dir(&o, buf, sizeof(buf)));
  assert_string_equal(buf, "/xdg/huggingface/hub");
  setenv("HF_HOME", "/hf/home/", 1);
  assert_null(kiln_hub_cache_dir(&o, buf, sizeof(buf)));
  assert_string_equal(buf, "/hf/home//hub");
  setenv("HF_HUB_CACHE", "/the/cache/", 1);
  assert_null(kiln_hub_cache_dir(&o, buf, sizeof(buf)));
  assert_string_equal(buf, "/the/cache");
  o.cache_dir = "~/mine";
  assert_null(kiln_hub_cache_dir(&o, buf, sizeof(buf)));
  assert_string_equal(buf, "/home/someone/mine");
  char tiny[8];
  kiln_status_t st = kiln_hub_cache_dir(&o, tiny, sizeof(tiny));
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  kiln_status_free(st);
  unsetenv("HF_HUB_CACHE");
  unsetenv("HF_HOME");
  unsetenv("XDG_CACHE_HOME");
  if (home)
    setenv("HOME", home, 1);
  else
    unsetenv("HOME");
  free(home);
}

#define C40 "0123456789abcdef0123456789abcdef01234567"
#define C40B "89abcdef0123456789abcdef0123456789abcdef"

/* A huggingface_hub cache written by hand: models--org--tiny at main = C40, config.json and
 * the weights linked into blobs, tokenizer.json marked absent in .no_exist. */
static void make_cache(const char *cache) {
  sh("mkdir -p %s/models--org--tiny/refs %s/models--org--tiny/blobs "
     "%s/models--org--tiny/snapshots/" C40 " %s/models--org--tiny/.no_exist/" C40,
     cache, cache, cache, cache);
  char p[1024];
  snprintf(p, sizeof(p), "%s/models--org--tiny/refs/main", cache);
  write_file(p, C40); /* no newline, as huggingface_hub writes it */
  snprintf(p, sizeof(p), "%s/models--org--tiny/blobs/aaaa", cache);
  write_file(p, "{}");
  snprintf(p, sizeof(p), "%s/models--org--tiny/blobs/bbbb", cache);
  write_file(p, "weights");
  sh("ln -s ../../blobs/aaaa %s/models--org--tiny/snapshots/" C40 "/config.json", cache);
  sh("ln -s ../../blobs/bbbb %s/models--org--tiny/snapshots/" C40 "/model.safetensors", cache);
  snprintf(p, sizeof(p), "%s/models--org--tiny/.no_exist/" C40 "/tokenizer.json", cache);
  write_file(p, "");
}

static kiln_status_t resolve_offline(const char *cache, const char *s, kiln_hub_result_t *r) {
  kiln_hub_id_t id;
  kiln_status_t st = kiln_hub_parse_id(s, &id);
  if (st) return st;
  kiln_hub_options_t o = {0};
  o.cache_dir = cache;
  o.offline = true;
  o.progress = KILN_HUB_PROGRESS_NONE;
  return kiln_hub_resolve(&o, &id, r);
}

static void expect_error(kiln_status_t st, kiln_status_code_t code, const char *says) {
  if (!st) fail_msg("no error (want '%s')", says);
  if (kiln_status_code(st) != code || !strstr(kiln_status_message(st), says))
    fail_msg("%s: %s (want '%s')", kiln_status_code_name(kiln_status_code(st)),
             kiln_status_message(st), says);
  kiln_status_free(st);
}

static void test_resolve_from_cache(void **state) {
  (void)state;
  char cache[512], want[1024];
  snprintf(cache, sizeof(cache), "%s/c1", tmpdir);
  make_cache(cache);
  kiln_hub_result_t *r = malloc(sizeof(*r));
  assert_non_null(r);
  assert_null(resolve_offline(cache, "org/tiny", r));
  snprintf(want, sizeof(want), "%s/models--org--tiny/snapshots/" C40, cache);
  assert_string_equal(r->path, want);
  assert_string_equal(r->commit, C40);
  assert_false(r->network);
  assert_int_equal(r->files_downloaded, 0);
  assert_null(resolve_offline(cache, "org/tiny@" C40, r)); /* a commit: no ref needed */
  assert_string_equal(r->path, want);

  /* an unknown revision, another commit, an unknown repository: each says what is there */
  expect_error(resolve_offline(cache, "org/tiny@dev", r), KILN_ERR_NOT_FOUND,
               "has org/tiny but not its revision 'dev'");
  expect_error(resolve_offline(cache, "org/tiny@" C40B, r), KILN_ERR_NOT_FOUND,
               "with 0 of its files; missing: config.json");
  expect_error(resolve_offline(cache, "org/other", r), KILN_ERR_NOT_FOUND,
               "holds nothing of org/other");
  setenv("HF_HUB_OFFLINE", "1", 1);
  kiln_hub_id_t id;
  assert_null(kiln_hub_parse_id("org/other", &id));
  kiln_hub_options_t o = {0};
  o.cache_dir = cache;
  expect_error(kiln_hub_resolve(&o, &id, r), KILN_ERR_NOT_FOUND, "HF_HUB_OFFLINE is set");
  unsetenv("HF_HUB_OFFLINE");

  /* without the .no_exist marker, tokenizer.json is needed */
  char p[1024];
  snprintf(p, sizeof(p), "%s/models--org--tiny/.no_exist/" C40 "/tokenizer.json", cache);
  assert_int_equal(unlink(p), 0);
  expect_error(resolve_offline(cache, "org/tiny", r), KILN_ERR_NOT_FOUND,
               "missing: tokenizer.json");
  write_file(p, "");

  /* a link whose blob is gone is missing */
  snprintf(p, sizeof(p), "%s/models--org--tiny/blobs/bbbb", cache);
  char moved[1100];
  snprintf(moved, sizeof(moved), "%s.gone", p);
  assert_int_equal(rename(p, moved), 0);
  expect_error(resolve_offline(cache, "org/tiny", r), KILN_ERR_NOT_FOUND,
               "missing: model.safetensors");
  assert_int_equal(rename(moved, p), 0);

  /* sharded: the index names two shards, one is missing; then both */
  sh("cd %s/models--org--tiny && rm snapshots/" C40
     "/model.safetensors && "
     "printf '{\"weight_map\": {\"a\": \"s-1.safetensors\", \"b\": \"s-2.safetensors\", "
     "\"c\": \"s-1.safetensors\"}}' > blobs/iiii && echo 1 > blobs/s1 && "
     "ln -s ../../blobs/iiii snapshots/" C40
     "/model.safetensors.index.json && "
     "ln -s ../../blobs/s1 snapshots/" C40 "/s-1.safetensors",
     cache);
  expect_error(resolve_offline(cache, "org/tiny", r), KILN_ERR_NOT_FOUND,
               "missing: s-2.safetensors");
  sh("cd %s/models--org--tiny && ln -s ../../blobs/s1 snapshots/" C40 "/s-2.safetensors", cache);
  assert_null(resolve_offline(cache, "org/tiny", r));
  assert_int_equal(r->files, 4); /* config, index, two shards */

  /* a .gguf by name, in a subfolder (links one ../ deeper) */
  sh("cd %s/models--org--tiny && mkdir -p snapshots/" C40
     "/q && "
     "ln -s ../../../blobs/bbbb snapshots/" C40 "/q/m.gguf",
     cache);
  assert_null(resolve_offline(cache, "org/tiny/q/m.gguf", r));
  snprintf(want, sizeof(want), "%s/models--org--tiny/snapshots/" C40 "/q/m.gguf", cache);
  assert_string_equal(r->path, want);
  expect_error(resolve_offline(cache, "org/tiny/q/other.gguf", r), KILN_ERR_NOT_FOUND,
               "missing: q/other.gguf");
  free(r);
}

/* kiln_model_resolve: an existing path wins; a Hub id goes to the cache ([hub] keys). */
static void test_model_resolve(void **state) {
  (void)state;
  char cache[512], set[700];
  snprintf(cache, sizeof(cache), "%s/c2", tmpdir);
  make_cache(cache);
  kiln_config_t *cfg = NULL;
  assert_null(kiln_config_create(&cfg));
  snprintf(set, sizeof(set), "hub.cache_dir=%s", cache);
  assert_null(kiln_config_set(cfg, set));
  assert_null(kiln_config_set(cfg, "hub.offline=true"));
  assert_null(kiln_config_set(cfg, "hub.progress=none"));
  kiln_model_location_t *loc = malloc(sizeof(*loc));
  assert_non_null(loc);

  assert_null(kiln_model_resolve(cfg, "org/tiny", loc));
  assert_string_equal(loc->hub_repo, "org/tiny");
  assert_non_null(strstr(loc->path, "/models--org--tiny/snapshots/" C40));

  /* [model] path as an id */
  assert_null(kiln_config_set(cfg, "model.path=org/tiny@" C40));
  assert_null(kiln_model_resolve(cfg, NULL, loc));
  assert_string_equal(loc->hub_repo, "org/tiny");

  /* a folder of that name in the current directory wins */
  char old[1024];
  assert_non_null(getcwd(old, sizeof(old)));
  sh("mkdir -p %s/cwd/org/tiny", tmpdir);
  char cwd[600];
  snprintf(cwd, sizeof(cwd), "%s/cwd", tmpdir);
  assert_int_equal(chdir(cwd), 0);
  assert_null(kiln_model_resolve(cfg, "org/tiny", loc));
  assert_string_equal(loc->path, "org/tiny");
  assert_string_equal(loc->hub_repo, "");
  assert_int_equal(chdir(old), 0);

  /* not an id and not there: the path as given, for the loader to report */
  assert_null(kiln_model_resolve(cfg, "no/such/dir", loc));
  assert_string_equal(loc->path, "no/such/dir");
  /* an id that the cache lacks: the error says both */
  expect_error(kiln_model_resolve(cfg, "org/absent", loc), KILN_ERR_NOT_FOUND,
               "model org/absent (no such file or folder; as a Hugging Face Hub id): "
               "org/absent@main: offline ([hub] offline) and not in the cache");
  free(loc);
  kiln_config_free(cfg);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sha_vectors),   cmocka_unit_test(test_sha_streaming),
      cmocka_unit_test(test_git_blob_id),   cmocka_unit_test(test_parse_ids),
      cmocka_unit_test(test_cache_dir),     cmocka_unit_test(test_resolve_from_cache),
      cmocka_unit_test(test_model_resolve),
  };
  return cmocka_run_group_tests(tests, setup_tmp, teardown_tmp);
}
