/* added.c - added tokens: a byte trie per matching set and the leftmost-longest split of a
 * text around them, with single_word / lstrip / rstrip handled as HF's
 * AddedVocabulary::find_matches does. */
#include <stdlib.h>
#include <string.h>

#include "models/tokenizer/tok_internal.h"

static int32_t trie_new_node(ktok_trie_t *t, unsigned char byte) {
  if (t->n == t->cap) {
    size_t cap = t->cap ? t->cap * 2 : 256;
    ktok_trie_node_t *v = realloc(t->nodes, cap * sizeof(*v));
    if (!v) return -1;
    t->nodes = v;
    t->cap = cap;
  }
  t->nodes[t->n] = (ktok_trie_node_t){-1, -1, -1, byte};
  return (int32_t)t->n++;
}

static bool trie_insert(ktok_trie_t *t, const char *s, size_t n, int32_t token) {
  if (n == 0) return true; /* HF ignores empty added tokens */
  unsigned char c = (unsigned char)s[0];
  int32_t node = t->root_child[c];
  if (node < 0) {
    node = trie_new_node(t, c);
    if (node < 0) return false;
    t->root_child[c] = node;
  }
  for (size_t i = 1; i < n; i++) {
    c = (unsigned char)s[i];
    int32_t child = t->nodes[node].first_child;
    while (child >= 0 && t->nodes[child].byte != c) child = t->nodes[child].next_sibling;
    if (child < 0) {
      child = trie_new_node(t, c);
      if (child < 0) return false;
      t->nodes[child].next_sibling = t->nodes[node].first_child;
      t->nodes[node].first_child = child;
    }
    node = child;
  }
  t->nodes[node].token = token;
  return true;
}

kiln_status_t ktok_trie_build(ktok_trie_t *t, const ktok_added_t *added, size_t n,
                              bool want_normalized, const ktok_normalizer_t *nz,
                              ktok_match_ctx_t *mc, kiln_arena_t *a) {
  (void)a;
  memset(t, 0, sizeof(*t));
  for (int i = 0; i < 256; i++) t->root_child[i] = -1;
  kiln_strbuf_t buf = KILN_STRBUF_INIT;
  kiln_status_t st = NULL;
  for (size_t i = 0; i < n && !st; i++) {
    if (added[i].normalized != want_normalized) continue;
    const char *s = added[i].content;
    size_t len = added[i].len;
    if (want_normalized && nz) {
      kiln_strbuf_reset(&buf);
      if ((st = ktok_normalize(nz, mc, s, len, &buf))) break;
      s = buf.data ? buf.data : "";
      len = buf.len;
    }
    if (!trie_insert(t, s, len, (int32_t)i)) {
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "added tokens: out of memory");
    }
  }
  kiln_strbuf_free(&buf);
  return st;
}

void ktok_trie_free(ktok_trie_t *t) {
  free(t->nodes);
  memset(t, 0, sizeof(*t));
}

/* The longest token starting at s[i], or -1; *out_end receives its end. */
static int32_t trie_longest(const ktok_trie_t *t, const char *s, size_t n, size_t i,
                            size_t *out_end) {
  int32_t node = t->root_child[(unsigned char)s[i]];
  int32_t best = -1;
  size_t j = i + 1;
  while (node >= 0) {
    if (t->nodes[node].token >= 0) {
      best = t->nodes[node].token;
      *out_end = j;
    }
    if (j >= n) break;
    unsigned char c = (unsigned char)s[j];
    int32_t child = t->nodes[node].first_child;
    while (child >= 0 && t->nodes[child].byte != c) child = t->nodes[child].next_sibling;
    node = child;
    j++;
  }
  return best;
}

static uint32_t last_cp(const char *s, size_t end) {
  size_t p = end - 1;
  while (p > 0 && ((unsigned char)s[p] & 0xC0) == 0x80) p--;
  uint32_t cp;
  ktok_utf8_decode(s + p, &cp);
  return cp;
}

static bool push_split(ktok_split_t **v, size_t *n, size_t *cap, size_t a, size_t b, int32_t tok) {
  if (*n == *cap) {
    size_t c = *cap ? *cap * 2 : 16;
    ktok_split_t *nv = realloc(*v, c * sizeof(*nv));
    if (!nv) return false;
    *v = nv;
    *cap = c;
  }
  (*v)[(*n)++] = (ktok_split_t){a, b, tok};
  return true;
}

kiln_status_t ktok_added_split(const ktok_trie_t *t, const ktok_added_t *added, const char *s,
                               size_t n, ktok_split_t **out, size_t *out_n) {
  ktok_split_t *v = NULL;
  size_t cnt = 0, cap = 0, start_offset = 0;
  *out = NULL;
  *out_n = 0;
  if (t->n > 0) {
    size_t i = 0;
    while (i < n) {
      size_t end = 0;
      int32_t tk = trie_longest(t, s, n, i, &end);
      if (tk < 0) {
        i++;
        continue;
      }
      size_t start = i, stop = end;
      i = end; /* matches never overlap, even rejected ones */
      const ktok_added_t *at = &added[tk];
      if (at->single_word) {
        bool start_space = start == 0 || !ktok_is_word_char(last_cp(s, start));
        uint32_t next_cp = 0;
        if (stop < n) ktok_utf8_decode(s + stop, &next_cp);
        bool stop_space = stop == n || !ktok_is_word_char(next_cp);
        if (!start_space || !stop_space) continue;
      }
      if (at->lstrip) {
        size_t ns = start;
        while (ns > start_offset && ktok_is_whitespace(last_cp(s, ns))) {
          size_t p = ns - 1;
          while (p > 0 && ((unsigned char)s[p] & 0xC0) == 0x80) p--;
          ns = p;
        }
        start = ns;
      }
      if (at->rstrip) {
        while (stop < n) {
          uint32_t cp;
          int cl = ktok_utf8_decode(s + stop, &cp);
          if (!ktok_is_whitespace(cp)) break;
          stop += (size_t)cl;
        }
        i = stop;
      }
      if (start_offset < start && !push_split(&v, &cnt, &cap, start_offset, start, -1)) goto oom;
      if (!push_split(&v, &cnt, &cap, start, stop, tk)) goto oom;
      start_offset = stop;
    }
  }
  if (start_offset != n && !push_split(&v, &cnt, &cap, start_offset, n, -1)) goto oom;
  *out = v;
  *out_n = cnt;
  return NULL;
oom:
  free(v);
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "added tokens: out of memory");
}
