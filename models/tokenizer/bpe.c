/* bpe.c - the BPE model of tokenizer.json: vocabulary and merge tables, the merge loop
 * (linked list of symbols + a min-heap of candidate pairs keyed by rank then position, as HF's
 * Word::merge_all), byte fallback, unk fusing and a bounded word cache. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/tokenizer/tok_internal.h"

#define TOK_MAX_ID (1 << 24) /* refuse absurd ids instead of allocating gigabytes */

typedef struct ktok_symbol {
  int32_t id;
  int32_t prev, next; /* indices, -1 = none */
  uint32_t len;       /* bytes covered; 0 = merged away */
} ktok_symbol_t;

typedef struct ktok_heap_item {
  int32_t rank, pos, new_id;
} ktok_heap_item_t;

/* ---- merge table ----------------------------------------------------------------------- */

static inline uint64_t merge_key(int32_t a, int32_t b) {
  return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
}

static inline size_t merge_slot(uint64_t key, size_t mask) {
  uint64_t h = key * 0x9e3779b97f4a7c15ull;
  return (size_t)(h >> 29) & mask;
}

static inline const ktok_merge_entry_t *merge_get(const ktok_bpe_t *b, int32_t l, int32_t r) {
  uint64_t key = merge_key(l, r);
  size_t i = merge_slot(key, b->merge_mask);
  for (;;) {
    const ktok_merge_entry_t *e = &b->merges[i];
    if (e->rank < 0) return NULL;
    if (e->key == key) return e;
    i = (i + 1) & b->merge_mask;
  }
}

/* Later duplicates overwrite earlier ones (HF collects the merges into a HashMap). */
static void merge_put(ktok_bpe_t *b, int32_t l, int32_t r, int32_t rank, int32_t new_id) {
  uint64_t key = merge_key(l, r);
  size_t i = merge_slot(key, b->merge_mask);
  for (;;) {
    ktok_merge_entry_t *e = &b->merges[i];
    if (e->rank < 0 || e->key == key) {
      e->key = key;
      e->rank = rank;
      e->new_id = new_id;
      return;
    }
    i = (i + 1) & b->merge_mask;
  }
}

/* ---- loading --------------------------------------------------------------------------- */

static kiln_status_t bpe_check_affix(const kiln_json_t *m, const char *key, const char *path) {
  const kiln_json_t *v = kiln_json_get(m, key);
  if (!v || kiln_json_is(v, KILN_JSON_NULL)) return NULL;
  size_t n = 0;
  if (!kiln_json_string(v, &n)) {
    return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "%s must be a string or null", key);
  }
  if (n) return ktok_err(KILN_ERR_UNSUPPORTED, path, "a non-empty %s is not supported", key);
  return NULL;
}

static kiln_status_t bpe_load_vocab(ktok_bpe_t *b, kiln_arena_t *a, const kiln_json_t *vocab,
                                    const char *path) {
  if (!kiln_json_is(vocab, KILN_JSON_OBJECT)) {
    return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "vocab must be an object, not %s",
                    kiln_json_type_name(kiln_json_type(vocab)));
  }
  size_t n = kiln_json_len(vocab);
  int64_t max_id = -1;
  for (size_t i = 0; i < n; i++) {
    int64_t id;
    size_t klen;
    const char *k = kiln_json_key_at(vocab, i, &klen);
    if (!kiln_json_int64(kiln_json_value_at(vocab, i), &id) || id < 0 || id >= TOK_MAX_ID) {
      return ktok_err(KILN_ERR_INVALID_ARGUMENT, path,
                      "vocab['%.*s'] must be an integer id in [0, %d)",
                      (int)(klen > 64 ? 64 : klen), k, TOK_MAX_ID);
    }
    if (id > max_id) max_id = id;
  }
  if (!ktok_map_init(&b->vocab, n)) goto oom;
  b->n_ids_r = (size_t)(max_id + 1);
  b->id_to_str = calloc(b->n_ids_r ? b->n_ids_r : 1, sizeof(*b->id_to_str));
  b->id_to_len = calloc(b->n_ids_r ? b->n_ids_r : 1, sizeof(*b->id_to_len));
  if (!b->id_to_str || !b->id_to_len) goto oom;
  for (size_t i = 0; i < n; i++) {
    int64_t id;
    size_t klen;
    const char *k = kiln_json_key_at(vocab, i, &klen);
    kiln_json_int64(kiln_json_value_at(vocab, i), &id);
    char *key = kiln_arena_strndup(a, k, klen);
    if (!key) goto oom;
    int32_t old;
    if (!ktok_map_put(&b->vocab, key, klen, (int32_t)id, &old)) goto oom;
    if (old >= 0 && old != id) b->id_to_str[old] = NULL; /* duplicate key: last one wins */
    if (b->id_to_str[id] && !(b->id_to_len[id] == klen && memcmp(b->id_to_str[id], k, klen) == 0)) {
      return ktok_err(KILN_ERR_INVALID_ARGUMENT, path,
                      "vocab: id %lld is used by both '%.*s' and '%.*s'", (long long)id,
                      (int)(b->id_to_len[id] > 64 ? 64 : b->id_to_len[id]), b->id_to_str[id],
                      (int)(klen > 64 ? 64 : klen), k);
    }
    b->id_to_str[id] = key;
    b->id_to_len[id] = (uint32_t)klen;
  }
  return NULL;
oom:
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory loading the vocab", path);
}

static kiln_status_t bpe_load_merges(ktok_bpe_t *b, const kiln_json_t *merges, const char *path) {
  if (merges && !kiln_json_is(merges, KILN_JSON_ARRAY)) {
    return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "merges must be an array");
  }
  size_t n = kiln_json_len(merges);
  size_t slots = 16;
  while (slots < n * 2 + 2) slots <<= 1;
  b->merges = malloc(slots * sizeof(*b->merges));
  if (!b->merges) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
  for (size_t i = 0; i < slots; i++) b->merges[i].rank = -1;
  b->merge_mask = slots - 1;
  kiln_strbuf_t cat = KILN_STRBUF_INIT;
  kiln_status_t st = NULL;
  for (size_t i = 0; i < n && !st; i++) {
    const kiln_json_t *m = kiln_json_at(merges, i);
    const char *l = NULL, *r = NULL;
    size_t ll = 0, rl = 0;
    if (kiln_json_is(m, KILN_JSON_STRING)) {
      size_t len;
      const char *s = kiln_json_string(m, &len);
      const char *sp = memchr(s, ' ', len);
      if (sp) {
        l = s, ll = (size_t)(sp - s);
        r = sp + 1, rl = len - ll - 1;
      }
    } else if (kiln_json_is(m, KILN_JSON_ARRAY) && kiln_json_len(m) == 2) {
      l = kiln_json_string(kiln_json_at(m, 0), &ll);
      r = kiln_json_string(kiln_json_at(m, 1), &rl);
    }
    if (!l || !r) {
      st = ktok_err(KILN_ERR_INVALID_ARGUMENT, path,
                    "merges[%zu] must be \"a b\" or [\"a\", \"b\"]", i);
      break;
    }
    int32_t li = ktok_map_get(&b->vocab, l, ll), ri = ktok_map_get(&b->vocab, r, rl);
    kiln_strbuf_reset(&cat);
    kiln_strbuf_append(&cat, l, ll);
    kiln_strbuf_append(&cat, r, rl);
    if (!kiln_strbuf_ok(&cat)) {
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
      break;
    }
    int32_t ni = ktok_map_get(&b->vocab, cat.data, cat.len);
    if (li < 0 || ri < 0 || ni < 0) {
      const char *bad = li < 0 ? l : ri < 0 ? r : cat.data;
      size_t bl = li < 0 ? ll : ri < 0 ? rl : cat.len;
      st = ktok_err(KILN_ERR_INVALID_ARGUMENT, path,
                    "merges[%zu]: token '%.*s' is not in the vocabulary", i,
                    (int)(bl > 64 ? 64 : bl), bad);
      break;
    }
    merge_put(b, li, ri, (int32_t)i, ni);
  }
  kiln_strbuf_free(&cat);
  return st;
}

kiln_status_t ktok_bpe_parse(kiln_arena_t *a, const kiln_json_t *v, const char *path,
                             ktok_bpe_t **out) {
  static const char *const keys[] = {"type",
                                     "dropout",
                                     "unk_token",
                                     "continuing_subword_prefix",
                                     "end_of_word_suffix",
                                     "fuse_unk",
                                     "byte_fallback",
                                     "ignore_merges",
                                     "vocab",
                                     "merges",
                                     NULL};
  *out = NULL;
  kiln_status_t st = ktok_json_only(v, path, keys);
  if (st) return st;
  const kiln_json_t *dropout = kiln_json_get(v, "dropout");
  if (dropout && !kiln_json_is(dropout, KILN_JSON_NULL) &&
      !(kiln_json_is(dropout, KILN_JSON_NUMBER) && kiln_json_number(dropout) == 0.0)) {
    return ktok_err(KILN_ERR_UNSUPPORTED, path,
                    "dropout must be null (BPE dropout is not supported)");
  }
  if ((st = bpe_check_affix(v, "continuing_subword_prefix", path))) return st;
  if ((st = bpe_check_affix(v, "end_of_word_suffix", path))) return st;

  ktok_bpe_t *b = calloc(1, sizeof(*b));
  if (!b) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
  pthread_mutex_init(&b->cache_lock, NULL);
  b->unk_id = -1;
  if ((st = ktok_json_bool(v, "fuse_unk", false, path, &b->fuse_unk))) goto fail;
  if ((st = ktok_json_bool(v, "byte_fallback", false, path, &b->byte_fallback))) goto fail;
  if ((st = ktok_json_bool(v, "ignore_merges", false, path, &b->ignore_merges))) goto fail;
  const kiln_json_t *vocab = kiln_json_get(v, "vocab");
  if (!vocab) {
    st = ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "vocab is missing");
    goto fail;
  }
  if ((st = bpe_load_vocab(b, a, vocab, path))) goto fail;
  if ((st = bpe_load_merges(b, kiln_json_get(v, "merges"), path))) goto fail;

  char *unk = NULL;
  size_t unk_len = 0;
  if ((st = ktok_json_str(a, v, "unk_token", path, &unk, &unk_len))) goto fail;
  if (unk) {
    b->unk_id = ktok_map_get(&b->vocab, unk, unk_len);
    if (b->unk_id < 0) {
      st =
          ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "unk_token '%s' is not in the vocabulary", unk);
      goto fail;
    }
  }
  for (uint32_t cp = 0; cp < 0x10000; cp++) b->char_ids[cp] = -1;
  for (size_t i = 0; i < b->vocab.n; i++) {
    const char *k = b->vocab.keys[i];
    uint32_t kl = b->vocab.key_lens[i];
    if (kl == 0 || kl > 3 || (uint32_t)ktok_utf8_len((unsigned char)k[0]) != kl) continue;
    uint32_t cp;
    ktok_utf8_decode(k, &cp);
    b->char_ids[cp] = b->vocab.vals[i];
  }
  for (int i = 0; i < 256; i++) {
    char name[8];
    snprintf(name, sizeof(name), "<0x%02X>", i);
    b->byte_ids[i] = b->byte_fallback ? ktok_map_get(&b->vocab, name, 6) : -1;
  }
  b->cache = calloc(TOK_CACHE_SLOTS, sizeof(*b->cache));
  if (!b->cache) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    goto fail;
  }
  *out = b;
  return NULL;
fail:
  ktok_bpe_free(b);
  return st;
}

void ktok_bpe_free(ktok_bpe_t *b) {
  if (!b) return;
  ktok_map_free(&b->vocab);
  free(b->id_to_str);
  free(b->id_to_len);
  free(b->merges);
  if (b->cache) {
    for (size_t i = 0; i < TOK_CACHE_SLOTS; i++) {
      free(b->cache[i].word);
      free(b->cache[i].ids);
    }
    free(b->cache);
  }
  pthread_mutex_destroy(&b->cache_lock);
  free(b);
}

void ktok_bpe_work_free(ktok_bpe_work_t *w) {
  free(w->sym);
  free(w->heap);
  free(w->ids);
  memset(w, 0, sizeof(*w));
}

/* ---- the word cache -------------------------------------------------------------------- */

static bool cache_lookup(ktok_bpe_t *b, const char *s, size_t n, uint64_t h, kiln_tokens_t *out,
                         bool *oom) {
  bool hit = false;
  if (pthread_mutex_trylock(&b->cache_lock) != 0) return false;
  ktok_cache_entry_t *e = &b->cache[h & (TOK_CACHE_SLOTS - 1)];
  if (e->word && e->word_len == n && memcmp(e->word, s, n) == 0) {
    hit = true;
    for (uint32_t i = 0; i < e->n_ids; i++) {
      if (!kiln_tokens_push(out, e->ids[i])) {
        *oom = true;
        break;
      }
    }
  }
  pthread_mutex_unlock(&b->cache_lock);
  return hit;
}

static void cache_store(ktok_bpe_t *b, const char *s, size_t n, uint64_t h, const int32_t *ids,
                        size_t n_ids) {
  char *word = malloc(n);
  int32_t *copy = malloc(n_ids * sizeof(*copy) + 1);
  if (!word || !copy) {
    free(word);
    free(copy);
    return; /* the cache is an optimisation */
  }
  memcpy(word, s, n);
  memcpy(copy, ids, n_ids * sizeof(*copy));
  if (pthread_mutex_trylock(&b->cache_lock) != 0) {
    free(word);
    free(copy);
    return;
  }
  ktok_cache_entry_t *e = &b->cache[h & (TOK_CACHE_SLOTS - 1)];
  char *old_word = e->word;
  int32_t *old_ids = e->ids;
  e->word = word;
  e->word_len = (uint32_t)n;
  e->ids = copy;
  e->n_ids = (uint32_t)n_ids;
  pthread_mutex_unlock(&b->cache_lock);
  free(old_word);
  free(old_ids);
}

/* ---- the merge loop -------------------------------------------------------------------- */

static inline bool heap_less(const ktok_heap_item_t *x, const ktok_heap_item_t *y) {
  return x->rank < y->rank || (x->rank == y->rank && x->pos < y->pos);
}

static void heap_push(ktok_heap_item_t *h, size_t *n, ktok_heap_item_t it) {
  size_t i = (*n)++;
  while (i > 0) {
    size_t p = (i - 1) / 2;
    if (!heap_less(&it, &h[p])) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = it;
}

static ktok_heap_item_t heap_pop(ktok_heap_item_t *h, size_t *n) {
  ktok_heap_item_t top = h[0];
  ktok_heap_item_t last = h[--(*n)];
  size_t i = 0, m = *n;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= m) break;
    if (c + 1 < m && heap_less(&h[c + 1], &h[c])) c++;
    if (!heap_less(&h[c], &last)) break;
    h[i] = h[c];
    i = c;
  }
  if (m) h[i] = last;
  return top;
}

static bool work_reserve(ktok_bpe_work_t *w, size_t n) {
  if (n > w->sym_cap) {
    size_t cap = n < 64 ? 64 : n * 2;
    ktok_symbol_t *s = realloc(w->sym, cap * sizeof(*s));
    if (!s) return false;
    w->sym = s;
    w->sym_cap = cap;
  }
  /* Each merge pushes at most two new pairs; n - 1 initial pairs. */
  size_t hcap = 3 * n + 4;
  if (hcap > w->heap_cap) {
    ktok_heap_item_t *h = realloc(w->heap, hcap * 2 * sizeof(*h));
    if (!h) return false;
    w->heap = h;
    w->heap_cap = hcap * 2;
  }
  if (n > w->ids_cap) {
    size_t cap = n < 64 ? 64 : n * 2;
    int32_t *ids = realloc(w->ids, cap * sizeof(*ids));
    if (!ids) return false;
    w->ids = ids;
    w->ids_cap = cap;
  }
  return true;
}

static void sym_add(ktok_symbol_t *sym, size_t *ns, int32_t id, uint32_t len) {
  size_t i = (*ns)++;
  sym[i].id = id;
  sym[i].len = len;
  sym[i].prev = (int32_t)i - 1;
  sym[i].next = -1;
  if (i > 0) sym[i - 1].next = (int32_t)i;
}

kiln_status_t ktok_bpe_tokenize(ktok_bpe_t *b, ktok_bpe_work_t *w, const char *s, size_t n,
                                kiln_tokens_t *out) {
  if (n == 0) return NULL;
  size_t start_len = out->len;
  if (b->ignore_merges) {
    int32_t id = ktok_map_get(&b->vocab, s, n);
    if (id >= 0) {
      if (!kiln_tokens_push(out, id)) goto oom;
      return NULL;
    }
  }
  uint64_t h = 0;
  bool cacheable = n <= TOK_CACHE_MAX_WORD;
  if (cacheable) {
    bool oom = false;
    h = ktok_hash(s, n);
    if (cache_lookup(b, s, n, h, out, &oom)) {
      if (oom) goto oom;
      return NULL;
    }
  }
  /* Every byte can become one symbol (byte fallback), so n bounds the symbol count. */
  if (!work_reserve(w, n)) goto oom;
  ktok_symbol_t *sym = w->sym;
  size_t ns = 0;
  int32_t unk_pending = 0; /* byte length of a pending unk, 0 = none */
  for (size_t i = 0; i < n;) {
    uint32_t cp;
    int cl = ktok_utf8_decode(s + i, &cp);
    int32_t id = cp < 0x10000 ? b->char_ids[cp] : ktok_map_get(&b->vocab, s + i, (size_t)cl);
    if (id >= 0) {
      if (unk_pending) {
        sym_add(sym, &ns, b->unk_id, (uint32_t)unk_pending);
        unk_pending = 0;
      }
      sym_add(sym, &ns, id, (uint32_t)cl);
    } else {
      bool fell_back = false;
      if (b->byte_fallback) {
        fell_back = true;
        for (int k = 0; k < cl; k++) {
          if (b->byte_ids[(unsigned char)s[i + (size_t)k]] < 0) fell_back = false;
        }
        /* As HF: the byte tokens go in before a pending unk is flushed. */
        for (int k = 0; fell_back && k < cl; k++) {
          sym_add(sym, &ns, b->byte_ids[(unsigned char)s[i + (size_t)k]], 1);
        }
      }
      if (!fell_back && b->unk_id >= 0) {
        if (unk_pending && b->fuse_unk) {
          unk_pending += cl;
        } else {
          if (unk_pending) sym_add(sym, &ns, b->unk_id, (uint32_t)unk_pending);
          unk_pending = cl;
        }
      }
      /* No unk token and no fallback: the character is dropped, as HF does. */
    }
    i += (size_t)cl;
  }
  if (unk_pending) sym_add(sym, &ns, b->unk_id, (uint32_t)unk_pending);

  ktok_heap_item_t *heap = w->heap;
  size_t hn = 0;
  for (size_t i = 0; i + 1 < ns; i++) {
    const ktok_merge_entry_t *m = merge_get(b, sym[i].id, sym[i + 1].id);
    if (m) heap_push(heap, &hn, (ktok_heap_item_t){m->rank, (int32_t)i, m->new_id});
  }
  while (hn > 0) {
    ktok_heap_item_t top = heap_pop(heap, &hn);
    ktok_symbol_t *cur = &sym[top.pos];
    if (cur->len == 0 || cur->next < 0) continue;
    int32_t next_pos = cur->next;
    ktok_symbol_t right = sym[next_pos];
    const ktok_merge_entry_t *m = merge_get(b, cur->id, right.id);
    if (!m || m->new_id != top.new_id) continue; /* stale entry */
    cur->id = top.new_id;
    cur->len += right.len;
    cur->next = right.next;
    sym[next_pos].len = 0;
    if (right.next >= 0) sym[right.next].prev = top.pos;
    if (cur->prev >= 0) {
      const ktok_merge_entry_t *pm = merge_get(b, sym[cur->prev].id, cur->id);
      if (pm) heap_push(heap, &hn, (ktok_heap_item_t){pm->rank, cur->prev, pm->new_id});
    }
    if (cur->next >= 0) {
      const ktok_merge_entry_t *nm = merge_get(b, cur->id, sym[cur->next].id);
      if (nm) heap_push(heap, &hn, (ktok_heap_item_t){nm->rank, top.pos, nm->new_id});
    }
  }
  size_t nid = 0;
  for (size_t i = 0; i < ns; i++) {
    if (sym[i].len) w->ids[nid++] = sym[i].id;
  }
  for (size_t i = 0; i < nid; i++) {
    if (!kiln_tokens_push(out, w->ids[i])) goto oom;
  }
  if (cacheable) cache_store(b, s, n, h, w->ids, nid);
  return NULL;
oom:
  out->len = start_len;
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "bpe: out of memory");
}
