#define _POSIX_C_SOURCE 200809L
/* guide.c - the pushdown automaton over a byte grammar, the vocabulary index, token
 * classification and masks (see guide.h for the design).
 *
 * Stacks. A stack node is (pos, parent): pos is the grammar element to match next (never an
 * END: a node whose element would be END is its parent, so right recursion such as
 * x ::= "a" x | "" keeps the stack flat), parent the node to resume when pos's alternative is
 * done, or a sentinel: ROOT (the start rule is done: the text may end) or BOTTOM (used while
 * classifying tokens: the part of the stack below the context chain, unknown). Nodes are
 * hash-consed in a store, so a stack is identified by its top node's id, and a state (the
 * stacks a text can be in) is a set of ids whose top element is a byte set ("leaves").
 *
 * Resuming a node expands rule references at its top (closure), collecting leaves; advancing
 * a state by a byte keeps the leaves whose byte set holds it and resumes each one's next node.
 * The grammar has no left recursion (grammar.c refuses it), so closures terminate; stamps on
 * nodes make each closure visit a node once. */
#include "core/guide/guide.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#define SENT_ROOT (-1)
#define SENT_BOTTOM (-2)
#define SENT_OOM (-3)
#define CHAIN_K 3          /* stack nodes in a context chain */
#define MASK_CACHE 4       /* masks a matcher keeps, by state */
#define COMPACT_AT 65536   /* a matcher's store is compacted beyond this many nodes */
#define DFA_TRANS_CAP 8192 /* DFA states with a transition table while classifying */
#define GUIDE_CACHE 64     /* compiled constraints a vocabulary keeps */
#define CLASS_CACHE_BYTES (512ull << 20)
#define LENMASK_MAX 256    /* token-length bitsets a vocabulary keeps (lengths 1 .. this) */

/* ============================================================================================
 * Stack nodes and states
 * ==========================================================================================*/

typedef struct pnode {
  int32_t pos, parent;
} pnode_t;

typedef struct pstore {
  pnode_t *n;
  uint32_t *stamp;
  int32_t num, cap;
  int32_t *ht; /* id + 1 */
  int32_t hcap;
  uint32_t cur;
  int32_t *wl; /* closure work list */
  int32_t wn, wcap;
  bool oom;
} pstore_t;

typedef struct pstate {
  int32_t *leaf;
  int32_t n, cap;
  bool accept, bottom, oom;
} pstate_t;

static inline uint32_t pn_hash(int32_t pos, int32_t parent) {
  uint64_t k = ((uint64_t)(uint32_t)pos << 32) | (uint32_t)parent;
  k *= 0x9E3779B97F4A7C15ull;
  return (uint32_t)(k >> 33);
}

static void ps_free(pstore_t *s) {
  free(s->n);
  free(s->stamp);
  free(s->ht);
  free(s->wl);
  memset(s, 0, sizeof(*s));
}

static bool ps_rehash(pstore_t *s, int32_t hcap) {
  int32_t *ht = calloc((size_t)hcap, sizeof(int32_t));
  if (!ht) return false;
  for (int32_t i = 0; i < s->num; i++) {
    uint32_t j = pn_hash(s->n[i].pos, s->n[i].parent) & (uint32_t)(hcap - 1);
    while (ht[j]) j = (j + 1) & (uint32_t)(hcap - 1);
    ht[j] = i + 1;
  }
  free(s->ht);
  s->ht = ht;
  s->hcap = hcap;
  return true;
}

/* The node (pos, parent), created when new; SENT_OOM when out of memory. */
static int32_t ps_node(pstore_t *s, int32_t pos, int32_t parent) {
  if (s->hcap) {
    uint32_t j = pn_hash(pos, parent) & (uint32_t)(s->hcap - 1);
    for (int32_t id; (id = s->ht[j]); j = (j + 1) & (uint32_t)(s->hcap - 1))
      if (s->n[id - 1].pos == pos && s->n[id - 1].parent == parent) return id - 1;
  }
  if (s->num == s->cap) {
    int32_t nc = s->cap ? s->cap * 2 : 256;
    pnode_t *nn = realloc(s->n, (size_t)nc * sizeof(*nn));
    if (!nn) goto oom;
    s->n = nn;
    uint32_t *ns = realloc(s->stamp, (size_t)nc * sizeof(*ns));
    if (!ns) goto oom;
    s->stamp = ns;
    s->cap = nc;
  }
  if ((s->num + 1) * 2 > s->hcap && !ps_rehash(s, s->hcap ? s->hcap * 2 : 512)) goto oom;
  int32_t id = s->num++;
  s->n[id] = (pnode_t){pos, parent};
  s->stamp[id] = 0;
  uint32_t j = pn_hash(pos, parent) & (uint32_t)(s->hcap - 1);
  while (s->ht[j]) j = (j + 1) & (uint32_t)(s->hcap - 1);
  s->ht[j] = id + 1;
  return id;
oom:
  s->oom = true;
  return SENT_OOM;
}

static void ps_new_stamp(pstore_t *s) {
  if (++s->cur == 0) {
    memset(s->stamp, 0, (size_t)s->num * sizeof(uint32_t));
    s->cur = 1;
  }
}

static void st_free(pstate_t *st) {
  free(st->leaf);
  memset(st, 0, sizeof(*st));
}

static void st_clear(pstate_t *st) {
  st->n = 0;
  st->accept = st->bottom = st->oom = false;
}

static void st_push(pstate_t *st, int32_t c) {
  if (st->n == st->cap) {
    int32_t nc = st->cap ? st->cap * 2 : 8;
    int32_t *nl = realloc(st->leaf, (size_t)nc * sizeof(int32_t));
    if (!nl) {
      st->oom = true;
      return;
    }
    st->leaf = nl;
    st->cap = nc;
  }
  st->leaf[st->n++] = c;
}

static bool st_copy(pstate_t *dst, const pstate_t *src) {
  st_clear(dst);
  for (int32_t i = 0; i < src->n; i++) st_push(dst, src->leaf[i]);
  dst->accept = src->accept;
  dst->bottom = src->bottom;
  return !dst->oom;
}

static void wl_push(pstore_t *s, int32_t c) {
  if (s->wn == s->wcap) {
    int32_t nc = s->wcap ? s->wcap * 2 : 64;
    int32_t *nw = realloc(s->wl, (size_t)nc * sizeof(int32_t));
    if (!nw) {
      s->oom = true;
      return;
    }
    s->wl = nw;
    s->wcap = nc;
  }
  s->wl[s->wn++] = c;
}

/* The node that continues after element pos of an alternative: pos + 1's node, or parent
 * when pos + 1 ends the alternative. */
static inline int32_t next_node(const kiln_grammar_t *g, pstore_t *s, int32_t pos, int32_t parent) {
  return g->el[pos + 1].kind == KILN_GEL_END ? parent : ps_node(s, pos + 1, parent);
}

/* Adds node c's closure to st (under the store's current stamp). */
static void resume(const kiln_grammar_t *g, pstore_t *s, int32_t c, pstate_t *st) {
  s->wn = 0;
  wl_push(s, c);
  while (s->wn > 0) {
    c = s->wl[--s->wn];
    if (c < 0) {
      if (c == SENT_ROOT)
        st->accept = true;
      else if (c == SENT_BOTTOM)
        st->bottom = true;
      else
        st->oom = true;
      continue;
    }
    if (s->stamp[c] == s->cur) continue;
    s->stamp[c] = s->cur;
    const int32_t pos = s->n[c].pos, par = s->n[c].parent;
    const kiln_gel_t e = g->el[pos];
    if (e.kind == KILN_GEL_BYTES) {
      st_push(st, c);
      continue;
    }
    const int32_t cont = next_node(g, s, pos, par);
    for (int32_t a = g->rule_alt[e.arg]; a < g->rule_alt[e.arg + 1]; a++) {
      const int32_t start = g->alt_start[a];
      wl_push(s, g->el[start].kind == KILN_GEL_END ? cont : ps_node(s, start, cont));
    }
  }
  if (s->oom) st->oom = true;
}

/* to = from advanced by byte b. */
static void advance(const kiln_grammar_t *g, pstore_t *s, const pstate_t *from, unsigned b,
                    pstate_t *to) {
  ps_new_stamp(s);
  st_clear(to);
  for (int32_t i = 0; i < from->n; i++) {
    const int32_t c = from->leaf[i];
    const int32_t pos = s->n[c].pos;
    if (!kiln_byteset_has(g->sets[g->el[pos].arg], b)) continue;
    resume(g, s, next_node(g, s, pos, s->n[c].parent), to);
  }
}

/* The state at the start of rule root under parent (SENT_ROOT for a whole text). */
static void start_state(const kiln_grammar_t *g, pstore_t *s, pstate_t *st) {
  ps_new_stamp(s);
  st_clear(st);
  for (int32_t a = g->rule_alt[g->root]; a < g->rule_alt[g->root + 1]; a++) {
    const int32_t start = g->alt_start[a];
    resume(g, s, g->el[start].kind == KILN_GEL_END ? SENT_ROOT : ps_node(s, start, SENT_ROOT), st);
  }
}

static int cmp_i32(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return x < y ? -1 : x > y;
}

/* ============================================================================================
 * The vocabulary
 * ==========================================================================================*/

typedef struct cls {
  uint64_t key[2];
  int32_t refs; /* constraints holding it (under the vocabulary's lock) */
  size_t bytes;
  uint32_t *acc_bits; /* [W] or NULL */
  int32_t *acc_ids;   /* [nacc] when acc_bits is NULL */
  int32_t nacc;
  /* the uncertain tokens' remaining bytes, as a preorder trie */
  int32_t un;
  uint8_t *u_byte;
  uint16_t *u_depth;
  int32_t *u_end;
  int32_t *u_tok0; /* [un + 1] */
  int32_t *u_toks;
  struct cls *hnext, *lprev, *lnext;
} cls_t;

struct kiln_guide_vocab {
  int32_t V, W;
  uint32_t *off; /* [V + 1] into bytes; allowed tokens only have bytes */
  uint8_t *bytes;
  uint8_t *ok; /* [V] */
  int32_t max_len;
  bool strip_first;
  /* the trie over allowed tokens, in preorder (nodes at depth >= 1) */
  int32_t nn;
  uint8_t *n_byte;
  uint16_t *n_depth;
  int32_t *n_end;
  int32_t *n_tok0; /* [nn + 1] */
  int32_t *toks;   /* allowed ids in byte order */
  int32_t ntoks;
  uint16_t *n_maxlen; /* [nn] the longest token in node i's subtree (bytes, capped at 65535) */
  uint32_t **lenmask; /* [LENMASK_MAX + 1], lazily, under mu: the tokens of at most c bytes */
  /* caches, under mu */
  pthread_mutex_t mu;
  cls_t **cht; /* classification hash table */
  int32_t chcap, ncls;
  cls_t *lru_head, *lru_tail; /* most recently used first */
  uint64_t cbytes, ccap;
  kiln_guide_t *g_head; /* compiled constraints, most recently used first */
  int32_t ng;
  kiln_guide_stats_t stats;
  /* classifications in progress (keys), under mu; cv wakes the threads waiting for one */
  uint64_t (*pend)[2];
  int32_t npend, pendcap;
  pthread_cond_t cv;
};

typedef struct chain_ent {
  int32_t key[CHAIN_K + 1]; /* positions, then length | endroot << 8; key[0] = -1: empty */
  cls_t *c;
} chain_ent_t;

struct kiln_guide {
  atomic_int refs;
  kiln_grammar_t *g;
  kiln_guide_vocab_t *v;
  uint64_t key[2];
  pthread_mutex_t mu;
  chain_ent_t *cm;
  int32_t cm_n, cm_cap;
  struct kiln_guide *prev, *next; /* in the vocabulary's cache */
  bool cached;
  atomic_bool pc_claimed; /* kiln_guide_claim_precompute */
};

static const kiln_guide_vocab_t *sort_v; /* qsort has no context argument; guarded by sort_mu */
static pthread_mutex_t sort_mu = PTHREAD_MUTEX_INITIALIZER;

static int tok_cmp(const void *a, const void *b) {
  const kiln_guide_vocab_t *v = sort_v;
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  uint32_t lx = v->off[x + 1] - v->off[x], ly = v->off[y + 1] - v->off[y];
  int c = memcmp(v->bytes + v->off[x], v->bytes + v->off[y], lx < ly ? lx : ly);
  if (c) return c;
  if (lx != ly) return lx < ly ? -1 : 1;
  return x < y ? -1 : x > y;
}

/* Builds a preorder trie over the byte strings of items[0..n) (sorted), where item i's string
 * is str(i). Output arrays are malloc'ed. */
typedef struct trie_out {
  int32_t nn;
  uint8_t *byte;
  uint16_t *depth;
  int32_t *end;
  int32_t *tok0;
} trie_out_t;

static bool trie_build(int32_t n, const uint8_t *(*str)(void *, int32_t, uint32_t *), void *ctx,
                       trie_out_t *t) {
  memset(t, 0, sizeof(*t));
  int64_t total = 0;
  for (int32_t i = 0; i < n; i++) {
    uint32_t l;
    str(ctx, i, &l);
    total += l;
  }
  int64_t cap = total + 1;
  t->byte = malloc((size_t)cap);
  t->depth = malloc((size_t)cap * sizeof(uint16_t));
  t->end = malloc((size_t)cap * sizeof(int32_t));
  t->tok0 = malloc(((size_t)cap + 1) * sizeof(int32_t));
  int32_t *stack = malloc((size_t)(65536 + 1) * sizeof(int32_t));
  if (!t->byte || !t->depth || !t->end || !t->tok0 || !stack) {
    free(stack);
    return false;
  }
  int32_t nn = 0, sp = 0;
  const uint8_t *prev = NULL;
  uint32_t plen = 0;
  for (int32_t i = 0; i < n; i++) {
    uint32_t l;
    const uint8_t *s = str(ctx, i, &l);
    if (l > 65535) l = 65535;
    uint32_t lcp = 0;
    while (prev && lcp < l && lcp < plen && prev[lcp] == s[lcp]) lcp++;
    while ((uint32_t)sp > lcp) t->end[stack[--sp]] = nn;
    for (uint32_t d = lcp + 1; d <= l; d++) {
      t->byte[nn] = s[d - 1];
      t->depth[nn] = (uint16_t)d;
      t->tok0[nn] = i;
      stack[sp++] = nn++;
    }
    prev = s;
    plen = l;
  }
  while (sp > 0) t->end[stack[--sp]] = nn;
  t->tok0[nn] = n;
  t->nn = nn;
  free(stack);
  return true;
}

static const uint8_t *vocab_str(void *ctx, int32_t i, uint32_t *len) {
  kiln_guide_vocab_t *v = ctx;
  int32_t id = v->toks[i];
  *len = v->off[id + 1] - v->off[id];
  return v->bytes + v->off[id];
}

static kiln_status_t vocab_finish(kiln_guide_vocab_t *v) {
  v->W = (v->V + 31) / 32;
  v->ccap = CLASS_CACHE_BYTES;
  v->toks = malloc((size_t)(v->V ? v->V : 1) * sizeof(int32_t));
  if (!v->toks) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide vocabulary: out of memory");
  v->ntoks = 0;
  for (int32_t i = 0; i < v->V; i++) {
    uint32_t l = v->off[i + 1] - v->off[i];
    if (v->ok[i] && l) {
      v->toks[v->ntoks++] = i;
      if ((int32_t)l > v->max_len) v->max_len = (int32_t)l;
    } else {
      v->ok[i] = 0;
    }
  }
  pthread_mutex_lock(&sort_mu);
  sort_v = v;
  if (v->ntoks > 1) qsort(v->toks, (size_t)v->ntoks, sizeof(int32_t), tok_cmp);
  sort_v = NULL;
  pthread_mutex_unlock(&sort_mu);
  trie_out_t t;
  if (!trie_build(v->ntoks, vocab_str, v, &t)) {
    free(t.byte);
    free(t.depth);
    free(t.end);
    free(t.tok0);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide vocabulary: out of memory");
  }
  v->nn = t.nn;
  v->n_byte = t.byte;
  v->n_depth = t.depth;
  v->n_end = t.end;
  v->n_tok0 = t.tok0;
  v->n_maxlen = malloc((size_t)(t.nn ? t.nn : 1) * sizeof(uint16_t));
  v->lenmask = calloc(LENMASK_MAX + 1, sizeof(uint32_t *));
  if (!v->n_maxlen || !v->lenmask)
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide vocabulary: out of memory");
  /* subtree maxima, children before parents (preorder backwards) */
  for (int32_t i = t.nn - 1; i >= 0; i--) {
    uint16_t mx = t.depth[i];
    for (int32_t j = i + 1; j < t.end[i]; j = t.end[j])
      if (v->n_maxlen[j] > mx) mx = v->n_maxlen[j];
    v->n_maxlen[i] = mx;
  }
  pthread_mutex_init(&v->mu, NULL);
  pthread_cond_init(&v->cv, NULL);
  return NULL;
}

kiln_status_t kiln_guide_vocab_create_bytes(int32_t V, const char *const *tokens,
                                            const size_t *lens, const bool *special,
                                            kiln_guide_vocab_t **out) {
  *out = NULL;
  if (V < 1)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "guide vocabulary: size %d", (int)V);
  kiln_guide_vocab_t *v = calloc(1, sizeof(*v));
  if (!v) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide vocabulary: out of memory");
  v->V = V;
  size_t total = 0;
  for (int32_t i = 0; i < V; i++) total += tokens[i] ? lens[i] : 0;
  v->off = malloc(((size_t)V + 1) * sizeof(uint32_t));
  v->bytes = malloc(total + 1);
  v->ok = calloc((size_t)V, 1);
  if (!v->off || !v->bytes || !v->ok || total > UINT32_MAX) {
    kiln_guide_vocab_free(v);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide vocabulary: out of memory");
  }
  size_t at = 0;
  for (int32_t i = 0; i < V; i++) {
    v->off[i] = (uint32_t)at;
    if (tokens[i] && !(special && special[i])) {
      if (lens[i]) memcpy(v->bytes + at, tokens[i], lens[i]);
      at += lens[i];
      v->ok[i] = 1;
    }
  }
  v->off[V] = (uint32_t)at;
  kiln_status_t st = vocab_finish(v);
  if (st) {
    kiln_guide_vocab_free(v);
    return st;
  }
  *out = v;
  return NULL;
}

kiln_status_t kiln_guide_vocab_create(const kiln_tokenizer_t *tok, int32_t V,
                                      kiln_guide_vocab_t **out) {
  *out = NULL;
  if (V < 1)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "guide vocabulary: size %d", (int)V);
  kiln_guide_vocab_t *v = calloc(1, sizeof(*v));
  if (!v) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide vocabulary: out of memory");
  v->V = V;
  v->strip_first = kiln_tokenizer_strips_first_space(tok);
  kiln_strbuf_t all = KILN_STRBUF_INIT;
  v->off = malloc(((size_t)V + 1) * sizeof(uint32_t));
  v->ok = calloc((size_t)V, 1);
  kiln_status_t st = NULL;
  if (!v->off || !v->ok)
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide vocabulary: out of memory");
  int32_t tv = (int32_t)kiln_tokenizer_vocab_size(tok);
  for (int32_t i = 0; !st && i < V; i++) {
    v->off[i] = (uint32_t)all.len;
    if (i >= tv || kiln_tokenizer_is_special(tok, i) || !kiln_tokenizer_id_to_token(tok, i, NULL))
      continue;
    kiln_status_t tst = kiln_tokenizer_token_bytes(tok, i, &all);
    if (tst) {
      if (kiln_status_code(tst) == KILN_ERR_OUT_OF_MEMORY)
        st = tst;
      else
        kiln_status_free(tst);
      continue;
    }
    v->ok[i] = 1;
  }
  if (!st) {
    v->off[V] = (uint32_t)all.len;
    if (!kiln_strbuf_ok(&all) || all.len > UINT32_MAX)
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide vocabulary: out of memory");
  }
  if (!st) {
    size_t n;
    v->bytes = (uint8_t *)kiln_strbuf_detach(&all, &n);
    if (!v->bytes) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide vocabulary: out of memory");
  }
  kiln_strbuf_free(&all);
  if (!st) st = vocab_finish(v);
  if (st) {
    kiln_guide_vocab_free(v);
    return st;
  }
  *out = v;
  return NULL;
}

static void cls_free(cls_t *c) {
  if (!c) return;
  free(c->acc_bits);
  free(c->acc_ids);
  free(c->u_byte);
  free(c->u_depth);
  free(c->u_end);
  free(c->u_tok0);
  free(c->u_toks);
  free(c);
}

static void guide_free(kiln_guide_t *g);

void kiln_guide_vocab_free(kiln_guide_vocab_t *v) {
  if (!v) return;
  for (kiln_guide_t *g = v->g_head, *nx; g; g = nx) {
    nx = g->next;
    g->cached = false;
    if (atomic_fetch_sub(&g->refs, 1) == 1) guide_free(g);
  }
  for (cls_t *c = v->lru_head, *nx; c; c = nx) {
    nx = c->lnext;
    cls_free(c);
  }
  free(v->cht);
  if (v->n_maxlen && v->lenmask) {
    pthread_mutex_destroy(&v->mu);
    pthread_cond_destroy(&v->cv);
  }
  free(v->pend);
  free(v->off);
  free(v->bytes);
  free(v->ok);
  free(v->n_byte);
  free(v->n_depth);
  free(v->n_end);
  free(v->n_tok0);
  free(v->n_maxlen);
  if (v->lenmask)
    for (int32_t c = 0; c <= LENMASK_MAX; c++) free(v->lenmask[c]);
  free(v->lenmask);
  free(v->toks);
  free(v);
}

int32_t kiln_guide_vocab_size(const kiln_guide_vocab_t *v) { return v->V; }
int32_t kiln_guide_mask_words(const kiln_guide_vocab_t *v) { return v->W; }

const uint8_t *kiln_guide_vocab_token(const kiln_guide_vocab_t *v, int32_t id, size_t *len) {
  if (id < 0 || id >= v->V || !v->ok[id]) return NULL;
  if (len) *len = v->off[id + 1] - v->off[id];
  return v->bytes + v->off[id];
}

void kiln_guide_vocab_stats(kiln_guide_vocab_t *v, kiln_guide_stats_t *out) {
  pthread_mutex_lock(&v->mu);
  *out = v->stats;
  out->class_bytes = v->cbytes;
  pthread_mutex_unlock(&v->mu);
}

/* ---- the classification cache (under v->mu) ----------------------------------------------- */

static void lru_unlink(kiln_guide_vocab_t *v, cls_t *c) {
  if (c->lprev)
    c->lprev->lnext = c->lnext;
  else
    v->lru_head = c->lnext;
  if (c->lnext)
    c->lnext->lprev = c->lprev;
  else
    v->lru_tail = c->lprev;
  c->lprev = c->lnext = NULL;
}

static void lru_front(kiln_guide_vocab_t *v, cls_t *c) {
  c->lnext = v->lru_head;
  c->lprev = NULL;
  if (v->lru_head) v->lru_head->lprev = c;
  v->lru_head = c;
  if (!v->lru_tail) v->lru_tail = c;
}

static cls_t *cls_find(kiln_guide_vocab_t *v, const uint64_t key[2]) {
  if (!v->chcap) return NULL;
  for (cls_t *c = v->cht[key[0] & (uint64_t)(v->chcap - 1)]; c; c = c->hnext)
    if (c->key[0] == key[0] && c->key[1] == key[1]) return c;
  return NULL;
}

static void cls_unhash(kiln_guide_vocab_t *v, cls_t *c) {
  cls_t **p = &v->cht[c->key[0] & (uint64_t)(v->chcap - 1)];
  while (*p && *p != c) p = &(*p)->hnext;
  if (*p) *p = c->hnext;
}

/* Inserts c (refs 1); false when out of memory. Evicts unreferenced entries over the cap. */
static bool cls_insert(kiln_guide_vocab_t *v, cls_t *c) {
  if ((v->ncls + 1) * 2 > v->chcap) {
    int32_t nc = v->chcap ? v->chcap * 2 : 256;
    cls_t **nt = calloc((size_t)nc, sizeof(*nt));
    if (!nt) return false;
    for (cls_t *x = v->lru_head; x; x = x->lnext) {
      size_t j = x->key[0] & (uint64_t)(nc - 1);
      x->hnext = nt[j];
      nt[j] = x;
    }
    free(v->cht);
    v->cht = nt;
    v->chcap = nc;
  }
  size_t j = c->key[0] & (uint64_t)(v->chcap - 1);
  c->hnext = v->cht[j];
  v->cht[j] = c;
  c->refs = 1;
  lru_front(v, c);
  v->ncls++;
  v->cbytes += c->bytes;
  for (cls_t *x = v->lru_tail, *pv; x && v->cbytes > v->ccap; x = pv) {
    pv = x->lprev;
    if (x->refs > 0) continue;
    cls_unhash(v, x);
    lru_unlink(v, x);
    v->ncls--;
    v->cbytes -= x->bytes;
    cls_free(x);
  }
  return true;
}

/* ============================================================================================
 * Classifying a context chain
 * ==========================================================================================*/

/* A lazily built DFA over states of the classification store. */
typedef struct dfa {
  const kiln_grammar_t *g;
  pstore_t s;
  int32_t *off; /* [nst + 1] into leaves */
  int32_t *leaves;
  int32_t nst, cst, nl, cl;
  int32_t *ht;
  int32_t hcap;
  int32_t *trans; /* [min(nst, cap) * 256]: -1 unknown, else next << 2 | bottom << 1 | accept */
  int32_t tcap;
  pstate_t a, b;
  bool oom;
} dfa_t;

static uint64_t leaves_hash(const int32_t *l, int32_t n) {
  return XXH3_64bits(l, (size_t)n * sizeof(int32_t));
}

/* The id of the state with leaves l[0..n) (sorted), interned. */
static int32_t dfa_intern(dfa_t *d, const int32_t *l, int32_t n) {
  uint64_t h = leaves_hash(l, n);
  if (d->hcap) {
    for (uint32_t j = (uint32_t)h & (uint32_t)(d->hcap - 1); d->ht[j];
         j = (j + 1) & (uint32_t)(d->hcap - 1)) {
      int32_t id = d->ht[j] - 1;
      if (d->off[id + 1] - d->off[id] == n &&
          (!n || !memcmp(d->leaves + d->off[id], l, (size_t)n * 4)))
        return id;
    }
  }
  if (d->nst + 2 > d->cst) {
    int32_t nc = d->cst ? d->cst * 2 : 256;
    int32_t *no = realloc(d->off, ((size_t)nc + 1) * sizeof(int32_t));
    if (!no) goto oom;
    d->off = no;
    d->cst = nc;
  }
  if (d->nl + n > d->cl) {
    int32_t nc = d->cl ? d->cl * 2 : 1024;
    while (nc < d->nl + n) nc *= 2;
    int32_t *nl = realloc(d->leaves, (size_t)nc * sizeof(int32_t));
    if (!nl) goto oom;
    d->leaves = nl;
    d->cl = nc;
  }
  if ((d->nst + 1) * 2 > d->hcap) {
    int32_t nc = d->hcap ? d->hcap * 2 : 512;
    int32_t *nt = calloc((size_t)nc, sizeof(int32_t));
    if (!nt) goto oom;
    for (int32_t i = 0; i < d->nst; i++) {
      uint32_t j = (uint32_t)leaves_hash(d->leaves + d->off[i], d->off[i + 1] - d->off[i]) &
                   (uint32_t)(nc - 1);
      while (nt[j]) j = (j + 1) & (uint32_t)(nc - 1);
      nt[j] = i + 1;
    }
    free(d->ht);
    d->ht = nt;
    d->hcap = nc;
  }
  if (d->nst < DFA_TRANS_CAP && d->nst >= d->tcap) {
    int32_t nc = d->tcap ? d->tcap * 2 : 64;
    if (nc > DFA_TRANS_CAP) nc = DFA_TRANS_CAP;
    int32_t *nt = realloc(d->trans, (size_t)nc * 256 * sizeof(int32_t));
    if (!nt) goto oom;
    memset(nt + (size_t)d->tcap * 256, 0xff, (size_t)(nc - d->tcap) * 256 * sizeof(int32_t));
    d->trans = nt;
    d->tcap = nc;
  }
  int32_t id = d->nst++;
  d->off[id] = d->nl;
  if (n) memcpy(d->leaves + d->nl, l, (size_t)n * sizeof(int32_t));
  d->nl += n;
  d->off[id + 1] = d->nl;
  uint32_t j = (uint32_t)h & (uint32_t)(d->hcap - 1);
  while (d->ht[j]) j = (j + 1) & (uint32_t)(d->hcap - 1);
  d->ht[j] = id + 1;
  return id;
oom:
  d->oom = true;
  return 0;
}

/* next << 2 | bottom << 1 | accept for state id and byte b. */
static int32_t dfa_step(dfa_t *d, int32_t id, unsigned b) {
  if (id < d->tcap) {
    int32_t t = d->trans[(size_t)id * 256 + b];
    if (t >= 0) return t;
  }
  st_clear(&d->a);
  for (int32_t i = d->off[id]; i < d->off[id + 1]; i++) st_push(&d->a, d->leaves[i]);
  advance(d->g, &d->s, &d->a, b, &d->b);
  if (d->a.oom || d->b.oom || d->s.oom) d->oom = true;
  if (d->b.n > 1) qsort(d->b.leaf, (size_t)d->b.n, sizeof(int32_t), cmp_i32);
  int32_t nx = d->b.n ? dfa_intern(d, d->b.leaf, d->b.n) : 0;
  int32_t t = nx << 2 | (d->b.bottom ? 2 : 0) | (d->b.accept ? 1 : 0);
  if (id < d->tcap) d->trans[(size_t)id * 256 + b] = t;
  return t;
}

static void dfa_free(dfa_t *d) {
  ps_free(&d->s);
  free(d->off);
  free(d->leaves);
  free(d->ht);
  free(d->trans);
  st_free(&d->a);
  st_free(&d->b);
}

typedef struct i32vec {
  int32_t *v;
  int64_t n, cap;
  bool oom;
} i32vec_t;

static void iv_push(i32vec_t *a, int32_t x) {
  if (a->n == a->cap) {
    int64_t nc = a->cap ? a->cap * 2 : 1024;
    int32_t *nv = realloc(a->v, (size_t)nc * sizeof(int32_t));
    if (!nv) {
      a->oom = true;
      return;
    }
    a->v = nv;
    a->cap = nc;
  }
  a->v[a->n++] = x;
}

/* Uncertain entries: (token, offset) pairs, sorted by the token's bytes from offset on. */
typedef struct uent {
  int32_t tok, k;
} uent_t;

static const kiln_guide_vocab_t *usort_v;
static int uent_cmp(const void *a, const void *b) {
  const kiln_guide_vocab_t *v = usort_v;
  const uent_t *x = a, *y = b;
  uint32_t lx = v->off[x->tok + 1] - v->off[x->tok] - (uint32_t)x->k;
  uint32_t ly = v->off[y->tok + 1] - v->off[y->tok] - (uint32_t)y->k;
  int c =
      memcmp(v->bytes + v->off[x->tok] + x->k, v->bytes + v->off[y->tok] + y->k, lx < ly ? lx : ly);
  if (c) return c;
  if (lx != ly) return lx < ly ? -1 : 1;
  return x->tok < y->tok ? -1 : x->tok > y->tok;
}

typedef struct ustr_ctx {
  const kiln_guide_vocab_t *v;
  const uent_t *e;
} ustr_ctx_t;

static const uint8_t *ustr(void *ctx, int32_t i, uint32_t *len) {
  ustr_ctx_t *u = ctx;
  const uent_t *e = &u->e[i];
  *len = u->v->off[e->tok + 1] - u->v->off[e->tok] - (uint32_t)e->k;
  return u->v->bytes + u->v->off[e->tok] + e->k;
}

static inline int32_t tok_len(const kiln_guide_vocab_t *v, int32_t id) {
  return (int32_t)(v->off[id + 1] - v->off[id]);
}

/* Finishes classification c: the accepted tokens acc (its array is taken) or'ed with bits
 * (may be NULL), as a bitset when that is smaller than a list; the uncertain entries un[0..nun)
 * (freed here) as a trie. NULL, with c freed, when oom or out of memory now. */
static cls_t *cls_build(const kiln_guide_vocab_t *v, cls_t *c, i32vec_t *acc, const uint32_t *bits,
                        uent_t *un, int64_t nun, bool oom) {
  if (!oom && (bits || acc->n > v->W)) {
    c->acc_bits = malloc((size_t)v->W * sizeof(uint32_t));
    if (!c->acc_bits) oom = true;
    for (int32_t w = 0; !oom && w < v->W; w++) c->acc_bits[w] = bits ? bits[w] : 0;
    for (int64_t j = 0; !oom && j < acc->n; j++)
      c->acc_bits[acc->v[j] >> 5] |= 1u << (acc->v[j] & 31);
    int64_t n = 0;
    for (int32_t w = 0; !oom && w < v->W; w++) n += __builtin_popcount(c->acc_bits[w]);
    c->nacc = (int32_t)n;
    c->bytes += (size_t)v->W * 4;
  } else if (!oom) {
    c->nacc = (int32_t)acc->n;
    c->acc_ids = acc->v;
    c->bytes += (size_t)acc->n * 4;
    acc->v = NULL;
  }
  if (!oom && nun) {
    pthread_mutex_lock(&sort_mu);
    usort_v = v;
    qsort(un, (size_t)nun, sizeof(*un), uent_cmp);
    usort_v = NULL;
    pthread_mutex_unlock(&sort_mu);
    ustr_ctx_t ctx = {v, un};
    trie_out_t t;
    if (!trie_build((int32_t)nun, ustr, &ctx, &t)) {
      free(t.byte);
      free(t.depth);
      free(t.end);
      free(t.tok0);
      oom = true;
    } else {
      c->un = t.nn;
      c->u_byte = t.byte;
      c->u_depth = t.depth;
      c->u_end = t.end;
      c->u_tok0 = t.tok0;
      c->u_toks = malloc((size_t)nun * sizeof(int32_t));
      if (!c->u_toks) oom = true;
      for (int64_t j = 0; !oom && j < nun; j++) c->u_toks[j] = un[j].tok;
      c->bytes += (size_t)t.nn * 11 + (size_t)nun * 4;
    }
  }
  free(un);
  free(acc->v);
  acc->v = NULL;
  if (oom) {
    cls_free(c);
    return NULL;
  }
  c->bytes += sizeof(*c);
  return c;
}

/* The tokens of at most c bytes (1 <= c <= LENMASK_MAX), made on first use; NULL when out of
 * memory. */
static const uint32_t *lenmask_get(kiln_guide_vocab_t *v, int32_t c) {
  pthread_mutex_lock(&v->mu);
  uint32_t *m = v->lenmask[c];
  if (!m && (m = calloc((size_t)v->W, sizeof(uint32_t)))) {
    for (int32_t j = 0; j < v->ntoks; j++) {
      const int32_t id = v->toks[j];
      if (tok_len(v, id) <= c) m[id >> 5] |= 1u << (id & 31);
    }
    v->lenmask[c] = m;
    v->cbytes += (size_t)v->W * 4;
  }
  pthread_mutex_unlock(&v->mu);
  return m;
}

/* Classifies every token of the vocabulary for the chain pos[0..L) (top first); endroot:
 * the chain's bottom is the end of the text (else the unknown rest of a stack).
 *
 * With base (cut > 0), the tokens of at most cut bytes take base's classification and only
 * the longer ones are walked: the chain is a link of a bounded repetition with cut - 1 more
 * x to go and base the same chain with x* in its place (get_cls), where a token of at most
 * cut bytes cannot tell the two apart (it finishes the current x and starts at most cut - 1
 * more, each at least one byte long). The walk skips every trie subtree without a longer
 * token, so a link far from its bound costs a small fraction of a whole walk. */
static cls_t *classify(kiln_guide_vocab_t *v, const kiln_grammar_t *g, const int32_t *pos,
                       int32_t L, bool endroot, const cls_t *base, int32_t cut) {
  dfa_t d;
  memset(&d, 0, sizeof(d));
  d.g = g;
  cls_t *c = calloc(1, sizeof(*c));
  i32vec_t acc = {0};
  uent_t *un = NULL;
  int64_t nun = 0, cun = 0;
  int32_t *st = malloc(((size_t)v->max_len + 2) * sizeof(int32_t));
  int32_t *nb = malloc(((size_t)v->max_len + 2) * sizeof(int32_t));
  uint8_t *bot = malloc((size_t)v->max_len + 2);
  bool oom = !c || !st || !nb || !bot;
  if (!oom) {
    int32_t below = endroot ? SENT_ROOT : SENT_BOTTOM;
    for (int32_t i = L - 1; i >= 0; i--) below = ps_node(&d.s, pos[i], below);
    /* the chain's top is a leaf (a byte set) */
    d.nst = 0;
    dfa_intern(&d, (int32_t[1]){0}, 0); /* state 0: dead */
    st[0] = dfa_intern(&d, &below, 1);
    nb[0] = 0;
    bot[0] = 0;
    oom = d.oom || d.s.oom;
  }
#define ADD_UN(tok_, kk_)                                   \
  do {                                                      \
    if (nun == cun) {                                       \
      int64_t ncap = cun ? cun * 2 : 1024;                  \
      uent_t *nu = realloc(un, (size_t)ncap * sizeof(*nu)); \
      if (!nu) {                                            \
        oom = true;                                         \
        break;                                              \
      }                                                     \
      un = nu;                                              \
      cun = ncap;                                           \
    }                                                       \
    un[nun++] = (uent_t){(tok_), (kk_)};                    \
  } while (0)
  if (!base) cut = 0;
  for (int32_t i = 0; !oom && i < v->nn;) {
    const int32_t dp = v->n_depth[i];
    if (v->n_maxlen[i] <= cut) { /* all of it is base's */
      i = v->n_end[i];
      continue;
    }
    const int32_t t = dfa_step(&d, st[dp - 1], v->n_byte[i]);
    const int32_t s2 = t >> 2;
    bot[dp] = (t & 2) != 0;
    nb[dp] = nb[dp - 1] + bot[dp];
    st[dp] = s2;
    const bool alive = s2 != 0, fin = alive || (t & 3);
    if (dp <= cut) {
      /* the tokens ending here are base's */
    } else if (fin) {
      for (int32_t j = v->n_tok0[i]; j < v->n_tok0[i + 1]; j++) iv_push(&acc, v->toks[j]);
    } else if (nb[dp] > 0) {
      for (int32_t j = v->n_tok0[i]; j < v->n_tok0[i + 1]; j++)
        for (int32_t k = 1; k < dp; k++)
          if (bot[k]) ADD_UN(v->toks[j], k);
    }
    if (!alive) {
      if (nb[dp] > 0) /* the whole subtree is uncertain at the same offsets */
        for (int32_t j = v->n_tok0[i + 1]; j < v->n_tok0[v->n_end[i]]; j++) {
          if (tok_len(v, v->toks[j]) <= cut) continue;
          for (int32_t k = 1; k <= dp; k++)
            if (bot[k]) ADD_UN(v->toks[j], k);
        }
      i = v->n_end[i];
    } else {
      i++;
    }
    oom |= d.oom || acc.oom;
  }
  /* base's uncertain tokens of at most cut bytes, at their offsets */
  for (int32_t i = 0; !oom && cut && i < base->un; i++)
    for (int32_t j = base->u_tok0[i]; j < base->u_tok0[i + 1]; j++) {
      const int32_t id = base->u_toks[j], len = tok_len(v, id);
      if (len <= cut) ADD_UN(id, len - base->u_depth[i]);
    }
#undef ADD_UN
  free(st);
  free(nb);
  free(bot);
  dfa_free(&d);
  /* base's accepted tokens of at most cut bytes: as bits (base's bits under the length mask)
   * or into the list */
  uint32_t *bits = NULL;
  if (!oom && cut && base->acc_bits) {
    const uint32_t *short_bits = NULL;
    if (cut <= LENMASK_MAX && !(short_bits = lenmask_get(v, cut))) oom = true;
    if (!oom && !(bits = malloc((size_t)v->W * sizeof(uint32_t)))) oom = true;
    for (int32_t w = 0; !oom && w < v->W; w++) {
      uint32_t x = base->acc_bits[w];
      if (short_bits) {
        x &= short_bits[w];
      } else { /* a cut beyond the kept length masks: token by token */
        for (uint32_t y = x; y; y &= y - 1) {
          const int32_t id = w * 32 + __builtin_ctz(y);
          if (tok_len(v, id) > cut) x &= ~(1u << (id & 31));
        }
      }
      bits[w] = x;
    }
  } else if (!oom && cut) {
    for (int32_t j = 0; j < base->nacc; j++)
      if (tok_len(v, base->acc_ids[j]) <= cut) iv_push(&acc, base->acc_ids[j]);
    oom = acc.oom;
  }
  c = cls_build(v, c, &acc, bits, un, nun, oom);
  free(bits);
  return c;
}

/* A hash of everything the classification of a chain depends on: the chain's positions'
 * alternative suffixes and every rule they reach, with rules numbered in order of discovery
 * and byte sets by content. */
static void chain_hash(const kiln_grammar_t *g, const int32_t *pos, int32_t L, bool endroot,
                       int32_t *canon, int32_t *queue, uint64_t out[2]) {
  XXH3_state_t h;
  XXH3_128bits_reset(&h);
  int32_t hdr[2] = {L, endroot};
  XXH3_128bits_update(&h, hdr, sizeof(hdr));
  for (int32_t r = 0; r < g->num_rules; r++) canon[r] = -1;
  int32_t qn = 0, qh = 0;
#define FEED_EL(e_)                                \
  do {                                             \
    kiln_gel_t e = (e_);                           \
    int32_t k = e.kind;                            \
    XXH3_128bits_update(&h, &k, 4);                \
    if (e.kind == KILN_GEL_BYTES) {                \
      XXH3_128bits_update(&h, g->sets[e.arg], 32); \
    } else if (e.kind == KILN_GEL_RULE) {          \
      if (canon[e.arg] < 0) {                      \
        canon[e.arg] = qn;                         \
        queue[qn++] = e.arg;                       \
      }                                            \
      XXH3_128bits_update(&h, &canon[e.arg], 4);   \
    }                                              \
  } while (0)
  for (int32_t i = 0; i < L; i++) {
    int32_t p = pos[i];
    do FEED_EL(g->el[p]);
    while (g->el[p++].kind != KILN_GEL_END);
  }
  while (qh < qn) {
    int32_t r = queue[qh++];
    int32_t na = g->rule_alt[r + 1] - g->rule_alt[r];
    XXH3_128bits_update(&h, &na, 4);
    for (int32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++) {
      int32_t p = g->alt_start[a];
      do FEED_EL(g->el[p]);
      while (g->el[p++].kind != KILN_GEL_END);
    }
  }
#undef FEED_EL
  XXH128_hash_t d = XXH3_128bits_digest(&h);
  out[0] = d.low64;
  out[1] = d.high64;
}

/* Classifications in progress (under v->mu). */
static bool pend_has(const kiln_guide_vocab_t *v, const uint64_t h[2]) {
  for (int32_t i = 0; i < v->npend; i++)
    if (v->pend[i][0] == h[0] && v->pend[i][1] == h[1]) return true;
  return false;
}
static bool pend_add(kiln_guide_vocab_t *v, const uint64_t h[2]) {
  if (v->npend == v->pendcap) {
    int32_t nc = v->pendcap ? v->pendcap * 2 : 8;
    uint64_t(*np)[2] = realloc(v->pend, (size_t)nc * sizeof(*np));
    if (!np) return false;
    v->pend = np;
    v->pendcap = nc;
  }
  v->pend[v->npend][0] = h[0];
  v->pend[v->npend][1] = h[1];
  v->npend++;
  return true;
}
/* Takes the lock. */
static void pend_done(kiln_guide_vocab_t *v, const uint64_t h[2]) {
  pthread_mutex_lock(&v->mu);
  for (int32_t i = 0; i < v->npend; i++)
    if (v->pend[i][0] == h[0] && v->pend[i][1] == h[1]) {
      v->pend[i][0] = v->pend[v->npend - 1][0];
      v->pend[i][1] = v->pend[v->npend - 1][1];
      v->npend--;
      break;
    }
  pthread_cond_broadcast(&v->cv);
  pthread_mutex_unlock(&v->mu);
}

/* The classification of a chain for constraint gd: from its own map, the vocabulary's cache,
 * or computed now. NULL when out of memory. */
static cls_t *get_cls(kiln_guide_t *gd, const int32_t *pos, int32_t L, bool endroot) {
  int32_t key[CHAIN_K + 1] = {0};
  for (int32_t i = 0; i < L; i++) key[i] = pos[i];
  for (int32_t i = L; i < CHAIN_K; i++) key[i] = -1;
  key[CHAIN_K] = L | (endroot ? 256 : 0);
  uint64_t kh = XXH3_64bits(key, sizeof(key));
  pthread_mutex_lock(&gd->mu);
  if (gd->cm_cap) {
    for (uint32_t j = (uint32_t)kh & (uint32_t)(gd->cm_cap - 1); gd->cm[j].key[0] != -1;
         j = (j + 1) & (uint32_t)(gd->cm_cap - 1))
      if (!memcmp(gd->cm[j].key, key, sizeof(key))) {
        cls_t *c = gd->cm[j].c;
        pthread_mutex_unlock(&gd->mu);
        return c;
      }
  }
  pthread_mutex_unlock(&gd->mu);
  kiln_guide_vocab_t *v = gd->v;
  const kiln_grammar_t *g = gd->g;
  int32_t *canon = malloc((size_t)g->num_rules * 2 * sizeof(int32_t) + 4);
  if (!canon) return NULL;
  uint64_t h[2];
  chain_hash(g, pos, L, endroot, canon, canon + g->num_rules, h);
  free(canon);
  /* found, or being classified by another thread (wait for it: a context is classified once),
   * or ours to classify (marked in progress until done) */
  pthread_mutex_lock(&v->mu);
  cls_t *c;
  bool own = false;
  for (;;) {
    c = cls_find(v, h);
    if (c) {
      c->refs++;
      lru_unlink(v, c);
      lru_front(v, c);
      v->stats.class_hits++;
      break;
    }
    if (!pend_has(v, h)) {
      own = pend_add(v, h); /* out of memory: classified unmarked (at worst twice) */
      break;
    }
    pthread_cond_wait(&v->cv, &v->mu);
  }
  pthread_mutex_unlock(&v->mu);
  /* A chain through a link of a bounded repetition x{m,n} (opt_k ::= x opt_{k-1} | "") is
   * classified from the same chain with the unbounded x* (S ::= x S | "") in the link's place
   * (see classify), in either of two shapes:
   *   - the top is x itself, a byte set at the start of the link's first alternative: S's x
   *     instead, k more x allowed from here (cut k);
   *   - a node below the top resumes with "opt_m" ending its alternative (the top is inside
   *     the current x): S's "S" instead, the current x and m more (cut m + 1).
   * Of several, the one with the largest cut (the cheapest walk); the base chain may itself
   * be derived from another link. */
  const cls_t *base = NULL;
  int32_t cut = 0, at = -1, sub = -1;
  for (int32_t i = 0; !c && i < L; i++) {
    const kiln_gel_t e = g->el[pos[i]];
    if (i == 0) {
      const int32_t r = g->el_rule[pos[0]];
      const int32_t sp = g->rep_pos[r];
      if (sp >= 1 && pos[0] == g->alt_start[g->rule_alt[r]] && g->el[sp - 1].kind == e.kind &&
          g->el[sp - 1].arg == e.arg && g->rep_count[r] > cut) {
        cut = g->rep_count[r];
        at = 0;
        sub = sp - 1;
      }
    } else if (e.kind == KILN_GEL_RULE && g->rep_pos[e.arg] >= 0 &&
               g->el[pos[i] + 1].kind == KILN_GEL_END && g->rep_count[e.arg] + 1 > cut) {
      cut = g->rep_count[e.arg] + 1;
      at = i;
      sub = g->rep_pos[e.arg];
    }
  }
  if (at >= 0) {
    int32_t bpos[CHAIN_K];
    memcpy(bpos, pos, (size_t)L * sizeof(int32_t));
    bpos[at] = sub;
    cls_t *b = get_cls(gd, bpos, L, endroot);
    if (!b) {
      if (own) pend_done(v, h);
      return NULL;
    }
    base = b;
    if (cut >= v->max_len) { /* no token can tell them apart: base itself */
      pthread_mutex_lock(&v->mu);
      b->refs++;
      v->stats.class_hits++;
      v->stats.derived_same++;
      pthread_mutex_unlock(&v->mu);
      c = b;
    }
  }
  if (!c) {
    cls_t *nc = classify(v, g, pos, L, endroot, base, cut);
    if (!nc) {
      if (own) pend_done(v, h);
      return NULL;
    }
    nc->key[0] = h[0];
    nc->key[1] = h[1];
    pthread_mutex_lock(&v->mu);
    c = cls_find(v, h); /* another thread may have made it meanwhile */
    if (c) {
      c->refs++;
      cls_free(nc);
    } else if (cls_insert(v, nc)) {
      c = nc;
      v->stats.classified++;
      if (base) v->stats.derived++;
    } else {
      cls_free(nc);
    }
    pthread_mutex_unlock(&v->mu);
  }
  if (own) pend_done(v, h);
  if (!c) return NULL;
  /* into the constraint's own map (it holds the reference) */
  pthread_mutex_lock(&gd->mu);
  cls_t *res = c;
  bool dup = false;
  if ((gd->cm_n + 1) * 2 > gd->cm_cap) {
    int32_t ncap = gd->cm_cap ? gd->cm_cap * 2 : 64;
    chain_ent_t *nm = malloc((size_t)ncap * sizeof(*nm));
    if (nm) {
      for (int32_t j = 0; j < ncap; j++) nm[j].key[0] = -1;
      for (int32_t i = 0; i < gd->cm_cap; i++) {
        if (gd->cm[i].key[0] == -1) continue;
        uint32_t j = (uint32_t)XXH3_64bits(gd->cm[i].key, sizeof(key)) & (uint32_t)(ncap - 1);
        while (nm[j].key[0] != -1) j = (j + 1) & (uint32_t)(ncap - 1);
        nm[j] = gd->cm[i];
      }
      free(gd->cm);
      gd->cm = nm;
      gd->cm_cap = ncap;
    }
  }
  if ((gd->cm_n + 1) * 2 <= gd->cm_cap) {
    uint32_t j = (uint32_t)kh & (uint32_t)(gd->cm_cap - 1);
    for (; gd->cm[j].key[0] != -1; j = (j + 1) & (uint32_t)(gd->cm_cap - 1))
      if (!memcmp(gd->cm[j].key, key, sizeof(key))) {
        res = gd->cm[j].c;
        dup = true;
        break;
      }
    if (!dup) {
      memcpy(gd->cm[j].key, key, sizeof(key));
      gd->cm[j].c = c;
      gd->cm_n++;
    }
  } else {
    res = NULL; /* out of memory: the reference is dropped below */
    dup = true;
  }
  pthread_mutex_unlock(&gd->mu);
  if (dup) {
    pthread_mutex_lock(&v->mu);
    c->refs--;
    pthread_mutex_unlock(&v->mu);
  }
  return res;
}

/* ============================================================================================
 * Compiled constraints
 * ==========================================================================================*/

static void guide_free(kiln_guide_t *gd) {
  if (gd->v) {
    pthread_mutex_lock(&gd->v->mu);
    for (int32_t i = 0; i < gd->cm_cap; i++)
      if (gd->cm[i].key[0] != -1) gd->cm[i].c->refs--;
    pthread_mutex_unlock(&gd->v->mu);
  }
  free(gd->cm);
  kiln_grammar_free(gd->g);
  pthread_mutex_destroy(&gd->mu);
  free(gd);
}

kiln_guide_t *kiln_guide_retain(kiln_guide_t *gd) {
  atomic_fetch_add(&gd->refs, 1);
  return gd;
}

void kiln_guide_release(kiln_guide_t *gd) {
  if (gd && atomic_fetch_sub(&gd->refs, 1) == 1) guide_free(gd);
}

const kiln_grammar_t *kiln_guide_grammar(const kiln_guide_t *g) { return g->g; }

kiln_status_t kiln_guide_compile(kiln_guide_vocab_t *v, kiln_guide_kind_t kind, const char *spec,
                                 size_t len, kiln_guide_t **out) {
  *out = NULL;
  if (spec && !len) len = strlen(spec);
  if (kind == KILN_GUIDE_JSON_OBJECT) {
    spec = NULL;
    len = 0;
  }
  XXH3_state_t hs;
  XXH3_128bits_reset(&hs);
  int32_t k = (int32_t)kind;
  XXH3_128bits_update(&hs, &k, sizeof(k));
  if (spec) XXH3_128bits_update(&hs, spec, len);
  XXH128_hash_t h = XXH3_128bits_digest(&hs);
  if (v) {
    pthread_mutex_lock(&v->mu);
    for (kiln_guide_t *g = v->g_head; g; g = g->next)
      if (g->key[0] == h.low64 && g->key[1] == h.high64) {
        atomic_fetch_add(&g->refs, 1);
        if (g->prev) { /* to the front */
          g->prev->next = g->next;
          if (g->next) g->next->prev = g->prev;
          g->prev = NULL;
          g->next = v->g_head;
          v->g_head->prev = g;
          v->g_head = g;
        }
        v->stats.compile_hits++;
        pthread_mutex_unlock(&v->mu);
        *out = g;
        return NULL;
      }
    pthread_mutex_unlock(&v->mu);
  }
  kiln_strbuf_t text = KILN_STRBUF_INIT;
  kiln_status_t st = kiln_guide_to_gbnf(kind, spec, len, &text);
  const char *start = "root";
  if (!st && v && v->strip_first) {
    /* the text's first token loses one leading space when decoded: allow it in the bytes */
    kiln_strbuf_append_str(&text, "\nkiln-first-token ::= \" \"? root\n");
    start = "kiln-first-token";
  }
  if (!st && !kiln_strbuf_ok(&text))
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide: out of memory");
  kiln_grammar_t *gr = NULL;
  if (!st) st = kiln_grammar_compile(text.data, text.len, kiln_guide_kind_name(kind), start, &gr);
  kiln_strbuf_free(&text);
  if (st) return st;
  kiln_guide_t *gd = calloc(1, sizeof(*gd));
  if (!gd) {
    kiln_grammar_free(gr);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide: out of memory");
  }
  atomic_init(&gd->refs, 1);
  atomic_init(&gd->pc_claimed, false);
  gd->g = gr;
  gd->v = v;
  gd->key[0] = h.low64;
  gd->key[1] = h.high64;
  pthread_mutex_init(&gd->mu, NULL);
  if (v) {
    pthread_mutex_lock(&v->mu);
    v->stats.compiles++;
    atomic_fetch_add(&gd->refs, 1); /* the cache's */
    gd->cached = true;
    gd->next = v->g_head;
    if (v->g_head) v->g_head->prev = gd;
    v->g_head = gd;
    kiln_guide_t *drop = NULL;
    if (++v->ng > GUIDE_CACHE) {
      kiln_guide_t *t = v->g_head;
      while (t->next) t = t->next;
      t->prev->next = NULL;
      t->cached = false;
      v->ng--;
      drop = t;
    }
    pthread_mutex_unlock(&v->mu);
    if (drop) kiln_guide_release(drop);
  }
  *out = gd;
  return NULL;
}

/* ============================================================================================
 * Matchers
 * ==========================================================================================*/

typedef struct mcache {
  uint64_t h;
  int32_t *leaves;
  int32_t n;
  bool valid;
  uint32_t *mask;
} mcache_t;

struct kiln_guide_matcher {
  kiln_guide_t *gd;
  const kiln_grammar_t *g;
  pstore_t s;
  pstate_t st, tmp, save;
  pstate_t *ds; /* per-depth states of an uncertain-trie walk */
  int32_t nds;
  mcache_t mc[MASK_CACHE];
  int32_t mc_next;
};

kiln_status_t kiln_guide_matcher_create(kiln_guide_t *gd, kiln_guide_matcher_t **out) {
  *out = NULL;
  kiln_guide_matcher_t *m = calloc(1, sizeof(*m));
  if (!m) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide matcher: out of memory");
  atomic_fetch_add(&gd->refs, 1);
  m->gd = gd;
  m->g = gd->g;
  start_state(m->g, &m->s, &m->st);
  if (m->st.oom) {
    kiln_guide_matcher_free(m);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide matcher: out of memory");
  }
  *out = m;
  return NULL;
}

void kiln_guide_matcher_reset(kiln_guide_matcher_t *m) {
  for (int i = 0; i < MASK_CACHE; i++) m->mc[i].valid = false;
  start_state(m->g, &m->s, &m->st);
}

kiln_status_t kiln_guide_matcher_clone(const kiln_guide_matcher_t *src,
                                       kiln_guide_matcher_t **out) {
  *out = NULL;
  kiln_guide_matcher_t *m = calloc(1, sizeof(*m));
  if (!m) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide matcher: out of memory");
  atomic_fetch_add(&src->gd->refs, 1);
  m->gd = src->gd;
  m->g = src->g;
  bool ok = true;
  /* the store is copied whole (nodes keep their ids) */
  if (src->s.num) {
    m->s.n = malloc((size_t)src->s.cap * sizeof(pnode_t));
    m->s.stamp = calloc((size_t)src->s.cap, sizeof(uint32_t));
    m->s.ht = malloc((size_t)src->s.hcap * sizeof(int32_t));
    ok = m->s.n && m->s.stamp && m->s.ht;
    if (ok) {
      memcpy(m->s.n, src->s.n, (size_t)src->s.num * sizeof(pnode_t));
      memcpy(m->s.ht, src->s.ht, (size_t)src->s.hcap * sizeof(int32_t));
      m->s.num = src->s.num;
      m->s.cap = src->s.cap;
      m->s.hcap = src->s.hcap;
    }
  }
  ok = ok && st_copy(&m->st, &src->st);
  if (!ok) {
    kiln_guide_matcher_free(m);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide matcher: out of memory");
  }
  *out = m;
  return NULL;
}

void kiln_guide_matcher_free(kiln_guide_matcher_t *m) {
  if (!m) return;
  ps_free(&m->s);
  st_free(&m->st);
  st_free(&m->tmp);
  st_free(&m->save);
  for (int32_t i = 0; i < m->nds; i++) st_free(&m->ds[i]);
  free(m->ds);
  for (int i = 0; i < MASK_CACHE; i++) {
    free(m->mc[i].leaves);
    free(m->mc[i].mask);
  }
  kiln_guide_release(m->gd);
  free(m);
}

bool kiln_guide_matcher_accepting(const kiln_guide_matcher_t *m) { return m->st.accept; }
bool kiln_guide_matcher_finished(const kiln_guide_matcher_t *m) {
  return m->st.accept && m->st.n == 0;
}
int32_t kiln_guide_matcher_nodes(const kiln_guide_matcher_t *m) { return m->s.num; }

/* Keeps only the nodes the current state reaches (its leaves and their parents). */
static bool compact(kiln_guide_matcher_t *m) {
  pstore_t *s = &m->s;
  int32_t *map = malloc((size_t)s->num * sizeof(int32_t));
  if (!map) return false;
  for (int32_t i = 0; i < s->num; i++) map[i] = -1;
  pstore_t ns;
  memset(&ns, 0, sizeof(ns));
  /* copy each leaf's chain, bottom first, so parents get ids before children */
  int32_t *chain = NULL;
  int32_t cn = 0, cc = 0;
  bool ok = true;
  for (int32_t i = 0; ok && i < m->st.n; i++) {
    cn = 0;
    for (int32_t c = m->st.leaf[i]; c >= 0 && map[c] < 0; c = s->n[c].parent) {
      if (cn == cc) {
        cc = cc ? cc * 2 : 64;
        int32_t *nc = realloc(chain, (size_t)cc * sizeof(int32_t));
        if (!nc) {
          ok = false;
          break;
        }
        chain = nc;
      }
      chain[cn++] = c;
    }
    while (ok && cn > 0) {
      int32_t c = chain[--cn];
      int32_t par = s->n[c].parent;
      int32_t np = par >= 0 ? map[par] : par;
      int32_t id = ps_node(&ns, s->n[c].pos, np);
      if (id < 0) ok = false;
      map[c] = id;
    }
  }
  free(chain);
  if (ok) {
    for (int32_t i = 0; i < m->st.n; i++) m->st.leaf[i] = map[m->st.leaf[i]];
    ns.wl = s->wl;
    ns.wcap = s->wcap;
    s->wl = NULL;
    ps_free(s);
    *s = ns;
    for (int i = 0; i < MASK_CACHE; i++) m->mc[i].valid = false;
  } else {
    ps_free(&ns);
  }
  free(map);
  return ok;
}

bool kiln_guide_matcher_accept_bytes(kiln_guide_matcher_t *m, const void *bytes, size_t n) {
  const uint8_t *b = bytes;
  if (!st_copy(&m->save, &m->st)) return false;
  for (size_t i = 0; i < n; i++) {
    advance(m->g, &m->s, &m->st, b[i], &m->tmp);
    pstate_t t = m->st;
    m->st = m->tmp;
    m->tmp = t;
    if (m->st.oom || (m->st.n == 0 && !(i + 1 == n && m->st.accept))) {
      pstate_t u = m->st;
      m->st = m->save;
      m->save = u;
      return false;
    }
  }
  if (m->s.num > COMPACT_AT) compact(m);
  return true;
}

bool kiln_guide_matcher_accept_token(kiln_guide_matcher_t *m, int32_t id) {
  const kiln_guide_vocab_t *v = m->gd->v;
  if (!v || id < 0 || id >= v->V || !v->ok[id]) return false;
  return kiln_guide_matcher_accept_bytes(m, v->bytes + v->off[id], v->off[id + 1] - v->off[id]);
}

/* Sets the bits of the uncertain tokens of c whose remaining bytes the stack `below` accepts. */
static bool walk_uncertain(kiln_guide_matcher_t *m, const cls_t *c, int32_t below, uint32_t *mask) {
  int32_t need = 1;
  for (int32_t i = 0; i < c->un; i++)
    if (c->u_depth[i] + 1 > need) need = c->u_depth[i] + 1;
  if (need > m->nds) {
    pstate_t *nd = realloc(m->ds, (size_t)need * sizeof(pstate_t));
    if (!nd) return false;
    memset(nd + m->nds, 0, (size_t)(need - m->nds) * sizeof(pstate_t));
    m->ds = nd;
    m->nds = need;
  }
  pstate_t *ds = m->ds;
  ps_new_stamp(&m->s);
  st_clear(&ds[0]);
  resume(m->g, &m->s, below, &ds[0]);
  if (ds[0].oom) return false;
  if (ds[0].n == 0) return true; /* nothing can follow below: every rest is refused */
  for (int32_t i = 0; i < c->un;) {
    const int32_t d = c->u_depth[i];
    advance(m->g, &m->s, &ds[d - 1], c->u_byte[i], &ds[d]);
    if (ds[d].oom) return false;
    const bool alive = ds[d].n > 0;
    if (alive || ds[d].accept)
      for (int32_t j = c->u_tok0[i]; j < c->u_tok0[i + 1]; j++)
        mask[c->u_toks[j] >> 5] |= 1u << (c->u_toks[j] & 31);
    i = alive ? i + 1 : c->u_end[i];
  }
  return true;
}

static uint64_t state_hash(const pstate_t *st) {
  return XXH3_64bits(st->leaf, (size_t)st->n * sizeof(int32_t)) ^ (st->accept ? 0x5bd1e995u : 0);
}

kiln_status_t kiln_guide_matcher_fill_mask(kiln_guide_matcher_t *m, uint32_t *mask) {
  const kiln_guide_vocab_t *v = m->gd->v;
  if (!v)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "guide: the matcher has no vocabulary");
  const size_t W = (size_t)v->W;
  /* a state seen lately: its mask again (the leaves are sorted for the comparison) */
  if (m->st.n > 1) qsort(m->st.leaf, (size_t)m->st.n, sizeof(int32_t), cmp_i32);
  uint64_t h = state_hash(&m->st);
  for (int i = 0; i < MASK_CACHE; i++) {
    mcache_t *e = &m->mc[i];
    if (e->valid && e->h == h && e->n == m->st.n &&
        (!e->n || !memcmp(e->leaves, m->st.leaf, (size_t)e->n * sizeof(int32_t)))) {
      memcpy(mask, e->mask, W * 4);
      return NULL;
    }
  }
  memset(mask, 0, W * 4);
  const int32_t nleaf = m->st.n;
  for (int32_t li = 0; li < nleaf; li++) {
    int32_t pos[CHAIN_K], L = 0, c = m->st.leaf[li];
    while (L < CHAIN_K && c >= 0) {
      pos[L++] = m->s.n[c].pos;
      c = m->s.n[c].parent;
    }
    const bool endroot = c == SENT_ROOT;
    cls_t *cl = get_cls(m->gd, pos, L, endroot);
    if (!cl)
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide: out of memory classifying tokens");
    if (cl->acc_bits) {
      for (size_t w = 0; w < W; w++) mask[w] |= cl->acc_bits[w];
    } else {
      for (int32_t j = 0; j < cl->nacc; j++)
        mask[cl->acc_ids[j] >> 5] |= 1u << (cl->acc_ids[j] & 31);
    }
    if (cl->un && !endroot && !walk_uncertain(m, cl, c, mask))
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide: out of memory");
  }
  /* remember it (the oldest entry goes) */
  mcache_t *e = &m->mc[m->mc_next];
  m->mc_next = (m->mc_next + 1) % MASK_CACHE;
  if (!e->mask) e->mask = malloc(W * 4);
  int32_t *nl = realloc(e->leaves, ((size_t)m->st.n + 1) * sizeof(int32_t));
  if (nl) e->leaves = nl;
  e->valid = e->mask && nl;
  if (e->valid) {
    memcpy(e->mask, mask, W * 4);
    if (m->st.n) memcpy(e->leaves, m->st.leaf, (size_t)m->st.n * sizeof(int32_t));
    e->n = m->st.n;
    e->h = h;
  }
  if (m->s.num > COMPACT_AT) compact(m);
  return NULL;
}

bool kiln_guide_matcher_compact(kiln_guide_matcher_t *m) { return compact(m); }

/* ============================================================================================
 * Precomputation: the contexts of a constraint's first steps, classified ahead
 * ==========================================================================================*/

static double mono_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

kiln_status_t kiln_guide_precompute(kiln_guide_t *gd, int32_t max_states, int64_t budget_us,
                                    const atomic_bool *stop, int32_t *states_out) {
  if (states_out) *states_out = 0;
  if (!gd->v) return NULL;
  const double t0 = mono_us();
  kiln_guide_matcher_t *m = NULL;
  kiln_status_t st = kiln_guide_matcher_create(gd, &m);
  if (st) return st;
  /* the states, by byte distance from the start (their leaves, sorted), and a set of their
   * hashes (a collision only skips a state: the cache stays exact) */
  int32_t *leaves = NULL, *off = NULL, nst = 0, nl = 0, lcap = 0, ocap = 0;
  uint64_t *hs = NULL;
  int32_t hcap = 1;
  while (hcap < 2 * (max_states > 0 ? max_states : 1)) hcap *= 2;
  hs = calloc((size_t)hcap, sizeof(uint64_t));
  bool oom = !hs;
  pstate_t cur = {0}, nx = {0};
#define PC_ADD(stp)                                                                            \
  do {                                                                                         \
    pstate_t *s_ = (stp);                                                                      \
    if (s_->n > 1) qsort(s_->leaf, (size_t)s_->n, sizeof(int32_t), cmp_i32);                   \
    uint64_t h_ = XXH3_64bits(s_->leaf, (size_t)s_->n * sizeof(int32_t)) | 1;                  \
    uint32_t j_ = (uint32_t)h_ & (uint32_t)(hcap - 1);                                         \
    while (hs[j_] && hs[j_] != h_) j_ = (j_ + 1) & (uint32_t)(hcap - 1);                       \
    if (hs[j_] || nst >= max_states) break;                                                    \
    if (nl + s_->n > lcap) {                                                                   \
      int32_t nc_ = (lcap + s_->n) * 2 + 64;                                                   \
      int32_t *nv_ = realloc(leaves, (size_t)nc_ * sizeof(int32_t));                           \
      if (!nv_) { oom = true; break; }                                                         \
      leaves = nv_;                                                                            \
      lcap = nc_;                                                                              \
    }                                                                                          \
    if (nst + 2 > ocap) {                                                                      \
      int32_t nc_ = ocap * 2 + 64;                                                             \
      int32_t *nv_ = realloc(off, (size_t)nc_ * sizeof(int32_t));                              \
      if (!nv_) { oom = true; break; }                                                         \
      off = nv_;                                                                               \
      ocap = nc_;                                                                              \
    }                                                                                          \
    hs[j_] = h_;                                                                               \
    if (!nst) off[0] = 0;                                                                      \
    memcpy(leaves + nl, s_->leaf, (size_t)s_->n * sizeof(int32_t));                            \
    nl += s_->n;                                                                               \
    off[++nst] = nl;                                                                           \
  } while (0)
  if (!oom && max_states > 0) PC_ADD(&m->st);
  int32_t done = 0;
  for (; !oom && done < nst; done++) {
    if ((stop && atomic_load(stop)) || (budget_us > 0 && mono_us() - t0 > (double)budget_us)) break;
    /* this state's contexts, as fill_mask meets them */
    for (int32_t li = off[done]; li < off[done + 1]; li++) {
      int32_t pos[CHAIN_K], L = 0, c = leaves[li];
      while (L < CHAIN_K && c >= 0) {
        pos[L++] = m->s.n[c].pos;
        c = m->s.n[c].parent;
      }
      if (!get_cls(gd, pos, L, c == SENT_ROOT)) {
        oom = true;
        break;
      }
    }
    /* its successors by one byte */
    st_clear(&cur);
    for (int32_t li = off[done]; li < off[done + 1]; li++) st_push(&cur, leaves[li]);
    if (cur.oom) oom = true;
    for (unsigned b = 0; !oom && b < 256 && nst < max_states; b++) {
      advance(gd->g, &m->s, &cur, b, &nx);
      if (nx.oom || m->s.oom) {
        oom = true;
        break;
      }
      if (nx.n) PC_ADD(&nx);
    }
  }
#undef PC_ADD
  st_free(&cur);
  st_free(&nx);
  free(leaves);
  free(off);
  free(hs);
  kiln_guide_matcher_free(m);
  if (states_out) *states_out = done;
  if (oom) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "guide: out of memory precomputing");
  return NULL;
}

bool kiln_guide_claim_precompute(kiln_guide_t *gd) {
  return !atomic_exchange(&gd->pc_claimed, true);
}
