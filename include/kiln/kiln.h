/* kiln.h - libkiln's public API: an engine that serves many generation requests at once on one
 * device.
 *
 *     kiln_engine_t *eng;
 *     kiln_status_t st = kiln_engine_create("etc/kiln.ini", NULL, 0, &eng);
 *     kiln_sampling_params_t sp;
 *     kiln_sampling_params_init(&sp);
 *     sp.max_tokens = 32;
 *     kiln_request_desc_t d = {.struct_size = sizeof(d), .prompt = "Once upon a time",
 *                              .params = &sp};
 *     kiln_request_t *req;
 *     st = kiln_engine_submit(eng, &d, &req);
 *     kiln_output_t *out;
 *     while (!(st = kiln_request_poll(req, -1, &out))) {   // -1: wait as long as it takes
 *       fwrite(out->text, 1, out->text_len, stdout);
 *       bool last = out->request_finished;
 *       kiln_output_free(out);
 *       if (last) break;
 *     }
 *     kiln_request_release(req);
 *     kiln_engine_destroy(eng);
 *
 * Threads. One engine thread drives the device: it admits submitted requests, runs one model
 * step at a time over every running sequence (continuous batching), samples, and delivers
 * outputs. kiln_engine_submit, kiln_request_poll, kiln_request_cancel, kiln_request_release
 * and kiln_engine_get_metrics may be called from any thread, concurrently.
 *
 * Outputs. Each request delivers a stream of kiln_output_t events, one per sequence per
 * token it produced (n > 1 gives n sequences, told apart by `index`), in order: one per engine
 * step, or several in one step when speculative decoding accepted several tokens; the last event of a request has request_finished set.
 * A beam search (kiln_sampling_params_t.beam_width) instead delivers nothing while it runs,
 * then one event per returned hypothesis, best first, each with all its tokens. Every accepted request gets
 * exactly one such last event, whatever happens (stop, length, cancel, an error, engine
 * shutdown). Events go either to the request's callback (called on the engine thread; the
 * event is borrowed for the call; the callback must not block and must not call
 * kiln_engine_destroy) or, without a callback, into the request's queue for
 * kiln_request_poll.
 *
 * Errors are kiln_status_t values: NULL on success, otherwise an owned object with a code and
 * a message naming what was wrong (free it with kiln_status_free).
 *
 * Lifetimes. A kiln_request_t handle belongs to the caller until kiln_request_release (the
 * engine keeps its own reference while the request runs). Release every handle before
 * kiln_engine_destroy; destroy cancels the requests still running (each gets its final event
 * with KILN_FINISH_ABORT) and joins the engine thread.
 */
#ifndef KILN_KILN_H
#define KILN_KILN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status (also declared by libkiln's internal base/status.h) ------------------------- */

typedef struct kiln_status *kiln_status_t;
/* 0 = OK; then INVALID_ARGUMENT 1, NOT_FOUND 2, OUT_OF_MEMORY 3, UNSUPPORTED 4, IO 5,
 * INCOMPATIBLE 6, DEVICE 7, INTERNAL 8, and KILN_ERR_UNAVAILABLE 9 (try again later: a full
 * queue, a shutting-down engine). */
#define KILN_ERR_UNAVAILABLE_CODE 9
const char *kiln_status_message(const kiln_status_t st);
void kiln_status_free(kiln_status_t st);

/* ---- sampling ---------------------------------------------------------------------------- */

/* Constrained decoding ("structured output"): what every sequence's output must match. The
 * output is generated so that it matches from its first token; end-of-sequence is allowed only
 * where the constraint accepts. */
typedef enum kiln_guide_kind {
  KILN_GUIDE_NONE = 0,
  KILN_GUIDE_JSON_OBJECT = 1, /* any JSON object; guide_spec NULL */
  KILN_GUIDE_JSON_SCHEMA = 2, /* guide_spec: a JSON Schema, as JSON text */
  KILN_GUIDE_REGEX = 3,       /* guide_spec: a regular expression the whole output matches */
  KILN_GUIDE_CHOICE = 4,      /* guide_spec: a JSON array of strings; the output is one of them */
  KILN_GUIDE_GRAMMAR = 5,     /* guide_spec: a GBNF grammar (llama.cpp syntax), from "root" */
} kiln_guide_kind_t;

/* Per-request generation settings, with vLLM / OpenAI semantics. Initialise with
 * kiln_sampling_params_init, then set what differs. Pointers are copied at submission. */
typedef struct kiln_sampling_params {
  uint32_t struct_size;
  int32_t n;              /* sequences sampled from the prompt (>= 1); they share its KV blocks */
  int32_t max_tokens;     /* new tokens per sequence; -1 = up to the model's context */
  int32_t min_tokens;     /* stop tokens and stop strings are ignored before this many */
  float temperature;      /* 0 = greedy (argmax) */
  float top_p;            /* (0, 1]; 1 = off */
  int32_t top_k;          /* 0 = off */
  float min_p;            /* [0, 1]; 0 = off */
  float repetition_penalty; /* > 0; 1 = off (prompt and output tokens) */
  float presence_penalty;   /* [-2, 2]; output tokens */
  float frequency_penalty;  /* [-2, 2]; output tokens */
  bool has_seed;
  uint64_t seed; /* with has_seed: the same random draws whatever else is in the batch; the same
                  * tokens too where the logits are the same, which a backend whose kernels sum
                  * in another order at another batch size may change in the last bits (a
                  * near-tie between two tokens can then go the other way) */
  bool ignore_eos;         /* keep going past the model's end-of-sequence tokens */
  bool skip_special_tokens; /* in the text (default true) */
  bool detokenize;          /* produce text (default true; needs a tokenizer) */
  const int32_t *stop_token_ids; /* finish with "stop" on any of these */
  int32_t num_stop_token_ids;
  const char *const *stop; /* finish with "stop" when the text contains one of these */
  int32_t num_stop;
  bool include_stop_str_in_output;
  const int32_t *logit_bias_ids; /* added to the logits before sampling */
  const float *logit_bias_values;
  int32_t num_logit_bias;
  int32_t logprobs;        /* -1 = none; 0 = the sampled token's; k > 0 = and the top k */
  int32_t prompt_logprobs; /* -1 = none; 0 = each prompt token's; k > 0 = and the top k */
  int32_t priority;        /* with [scheduler] policy = priority: lower runs first */
  kiln_guide_kind_t guide; /* KILN_GUIDE_NONE = unconstrained */
  const char *guide_spec;  /* see kiln_guide_kind_t; copied at submission */
  size_t guide_spec_len;   /* 0 = NUL-terminated */
  /* Speculative decoding ([speculative] in the config, docs/engine.md): -1 = the engine's
   * setting (the default); 0 = off for this request; k in [1, 32] = at most k proposals a step
   * (and at most the engine's [speculative] num_speculative_tokens; none when its method is
   * off). Only greedy (temperature 0), unconstrained requests speculate; the tokens are the
   * same either way. (A caller built against a kiln.h without this field passes a shorter
   * struct_size and gets -1.) */
  int32_t num_speculative_tokens;
  /* Beam search (docs/engine.md "Beam search"; transformers' generate(num_beams=beam_width,
   * num_return_sequences=n, length_penalty, early_stopping)): 0 = off (the default); W >= 1
   * searches with W beams and returns the n <= W best finished hypotheses, best first, each
   * as one event (index 0 = best) carrying all its tokens and its scores (kiln_output_t's
   * cumulative_logprob, beam_score). Beam search is deterministic: temperature, top_p, top_k,
   * min_p and seed are ignored; penalties, logit_bias, logprobs, prompt_logprobs, min_tokens,
   * stop strings and guides are refused; it never speculates. W = 1 is greedy search.
   * (Read only when struct_size covers them; an older caller gets beam search off.) */
  int32_t beam_width;
  float length_penalty;   /* score = cumulative logprob / generated_len ^ length_penalty (1) */
  int32_t early_stopping; /* a kiln_early_stopping_t */
} kiln_sampling_params_t;

typedef enum kiln_early_stopping {
  KILN_EARLY_STOPPING_FALSE = 0, /* stop when no running beam can beat the worst kept one */
  KILN_EARLY_STOPPING_TRUE = 1,  /* stop as soon as beam_width hypotheses are finished */
  KILN_EARLY_STOPPING_NEVER = 2, /* like FALSE, bounding by max_tokens when length_penalty > 0 */
} kiln_early_stopping_t;

void kiln_sampling_params_init(kiln_sampling_params_t *p);

/* ---- requests ---------------------------------------------------------------------------- */

typedef struct kiln_engine kiln_engine_t;
typedef struct kiln_request kiln_request_t;

typedef enum kiln_finish_reason {
  KILN_FINISH_NONE = 0,   /* still running */
  KILN_FINISH_STOP = 1,   /* an end-of-sequence token, a stop token or a stop string */
  KILN_FINISH_LENGTH = 2, /* max_tokens, or the model's context */
  KILN_FINISH_ABORT = 3,  /* cancelled, or the engine shut down */
  KILN_FINISH_ERROR = 4,  /* the request failed; see error */
} kiln_finish_reason_t;

/* "stop", "length", "abort", "error", or NULL for KILN_FINISH_NONE. */
const char *kiln_finish_reason_name(kiln_finish_reason_t r);

typedef struct kiln_usage {
  int32_t prompt_tokens;
  int32_t completion_tokens; /* over all n sequences */
  int32_t cached_tokens;     /* prompt tokens served from the prefix cache */
} kiln_usage_t;

/* One event: what one sequence of a request produced in one engine step. Arrays are owned by
 * the event. */
typedef struct kiln_output {
  kiln_request_t *request;
  uint64_t request_seq;     /* the engine's number for the request (submission order) */
  void *user;               /* kiln_request_desc_t.user */
  int32_t index;            /* which sequence, 0 .. n-1 */
  const int32_t *token_ids; /* new tokens */
  int32_t num_tokens;
  const char *text;         /* new text, NUL-terminated (may hold back a partial stop string) */
  size_t text_len;
  const float *logprobs;    /* [num_tokens] with logprobs >= 0, else NULL */
  const int32_t *top_ids;   /* [num_tokens, top_n] with logprobs > 0 */
  const float *top_logprobs;
  int32_t top_n;
  /* Prompt logprobs (first event of sequence 0 only, when asked): for prompt positions
   * 1 .. P-1, the logprob of the prompt token and [P-1, prompt_top_n] alternatives. */
  const float *prompt_logprobs;
  const int32_t *prompt_top_ids;
  const float *prompt_top_logprobs;
  int32_t num_prompt_logprobs;
  int32_t prompt_top_n;
  kiln_finish_reason_t finish_reason; /* of this sequence; NONE while it runs */
  const char *stop_str;  /* the stop string matched, or NULL */
  int32_t stop_token;    /* the stop or eos token that ended it, or -1 */
  bool request_finished; /* the request's last event: every sequence has finished */
  kiln_usage_t usage;    /* the request's, so far */
  const char *error;     /* with KILN_FINISH_ERROR: why */
  /* Timings in seconds since the request arrived (0 = not yet): */
  double queue_time;  /* until first scheduled */
  double first_token_time;
  double time;        /* when this event was made */
  /* Beam search (beam_width > 0): this hypothesis's cumulative logprob and its length-
   * penalised score (cumulative_logprob / num_tokens ^ length_penalty); 0 otherwise. */
  double cumulative_logprob;
  double beam_score;
} kiln_output_t;

typedef void (*kiln_output_fn)(void *user, const kiln_output_t *out);
/* Poll mode's wake-up: called on the engine thread after an event was queued for
 * kiln_request_poll, with the request's lock held, so that it never runs after the poll that
 * took the final event has returned. It must be quick and must not call into libkiln. It lets
 * one thread wait for several requests (signal a condition variable, write to a pipe...). */
typedef void (*kiln_notify_fn)(void *user);

/* One image of a request (vision-language models: kiln_engine_max_images() > 0). Either its
 * encoded bytes (data/size: PNG, JPEG or WebP, decoded and preprocessed at submission with the
 * model's image processor settings, preprocessor_config.json), or, for tools and tests that
 * have them, the image processor's output itself (pixel_values: grid_t * grid_h * grid_w rows
 * of 3 * temporal_patch_size * patch_size^2 floats, exactly Qwen2VLImageProcessor's
 * pixel_values and image_grid_thw). Both are copied at submission. */
typedef struct kiln_image_input {
  const void *data; /* encoded bytes, or NULL with pixel_values */
  size_t size;
  const float *pixel_values;
  int32_t grid_t, grid_h, grid_w;
} kiln_image_input_t;

typedef struct kiln_request_desc {
  uint32_t struct_size;
  const char *prompt;          /* text (tokenized with the model's tokenizer, adding BOS as
                                  the tokenizer does), or NULL */
  const int32_t *prompt_ids;   /* token ids, when prompt is NULL */
  int32_t num_prompt_ids;
  const kiln_sampling_params_t *params; /* NULL = defaults */
  kiln_output_fn on_output;    /* NULL = queue events for kiln_request_poll */
  void *user;
  kiln_notify_fn on_queued;    /* poll mode only: NULL, or called as each event is queued */
  /* Images, in prompt order (read when struct_size covers them). The prompt (text or ids)
   * holds exactly one image placeholder token (the config's image_token_id, <|image_pad|>,
   * as the chat template writes it) per image; each is expanded to the image's tokens. */
  const kiln_image_input_t *images;
  int32_t num_images;
} kiln_request_desc_t;

/* Validates and queues a request. Errors (nothing is queued): KILN_ERR_INVALID_ARGUMENT for a
 * bad parameter (named), an empty prompt, token ids outside the vocabulary, or a request
 * that can never fit (prompt + max_tokens beyond the context, or n sequences beyond the KV
 * pool; the message gives the numbers; image tokens count); for images: a model without a
 * vision tower, more than [model] max_images_per_prompt, placeholders that do not match the
 * images in number; an image that does not decode or preprocess, or is too large for
 * [model] encoder_cache_mb: messages about one image start "image I: " (I from 0), with
 * KILN_ERR_UNSUPPORTED for an image format Kiln does not read; code 9 (unavailable) when the engine
 * is shutting down or the waiting queue is full ([server] max_queued_requests). */
kiln_status_t kiln_engine_submit(kiln_engine_t *eng, const kiln_request_desc_t *desc,
                                 kiln_request_t **out_request);

/* Holds (true) or releases (false) the engine's intake of newly submitted requests; holds
 * count, so pair them. While held, submitted requests are validated and queued but not
 * scheduled; the requests already running go on. A batch submitted between a hold and its
 * release is therefore admitted into one scheduler step, as if it had arrived at once: an
 * offline batch then gets the same batches, and so the same numbers and samples, whatever the
 * timing of the submitting thread (kiln generate --input and Python's LLM.generate do this).
 * Shutdown takes held requests too. A release without a hold does nothing. */
void kiln_engine_hold_intake(kiln_engine_t *eng, bool hold);

/* Takes the next event of a request without a callback: waits up to timeout_ms
 * (-1 = forever, 0 = do not wait). *out is NULL on timeout. The event is owned by the caller
 * (kiln_output_free). After the event with request_finished, *out stays NULL. */
kiln_status_t kiln_request_poll(kiln_request_t *req, int64_t timeout_ms, kiln_output_t **out);
void kiln_output_free(kiln_output_t *out);

/* Asks the engine to stop the request; its blocks are freed at the next step and it ends
 * with KILN_FINISH_ABORT (unless it finished first). Idempotent. */
void kiln_request_cancel(kiln_request_t *req);
/* Gives up the caller's handle. A running request keeps running (cancel it first if its
 * outputs are no longer wanted). */
void kiln_request_release(kiln_request_t *req);

/* ---- the engine -------------------------------------------------------------------------- */

/* Creates an engine from an INI file (NULL = built-in defaults) plus "section.key=value"
 * overrides: opens the backend, loads the model and tokenizer, sizes the KV pool and starts
 * the engine thread. Errors name the key, file or device that failed. */
kiln_status_t kiln_engine_create(const char *config_path, const char *const *overrides,
                                 int32_t num_overrides, kiln_engine_t **out_engine);
/* Cancels what is running, delivers every final event, joins the engine thread, frees. */
void kiln_engine_destroy(kiln_engine_t *eng);

/* The configuration keys kiln_engine_create reads from its INI file and overrides (the table
 * `kiln --help-config` prints, in its order), for bindings that map their own option names
 * onto "section.key=value" overrides: for index 0, 1, ... the key's section ("model",
 * "engine", ...), its name, its type ("string", "int", "float", "bool", "enum" or
 * "int list") and its help line, as static strings (any out pointer may be NULL). Returns
 * false, setting nothing, for an index below 0 or past the last key. Thread-safe. */
bool kiln_engine_config_key(int32_t index, const char **section, const char **key,
                            const char **type, const char **help);

typedef struct kiln_engine_info {
  const char *model_path;  /* as configured */
  const char *model_name;  /* architecture, e.g. "LlamaForCausalLM" */
  const char *backend;     /* "cpu", "cuda", ... */
  const char *device;      /* the device's name */
  int32_t vocab_size;
  int64_t max_model_len;
  int32_t block_size;
  int32_t num_blocks;
  int32_t max_num_seqs;
  int32_t max_num_batched_tokens;
  bool has_tokenizer;
  /* The KV cache's storage ([cache] dtype): "bf16", "f16", "f32" (the model's dtype) or
   * "fp8_e4m3"; num_blocks * block_size tokens fit in it. */
  const char *kv_cache_dtype;
  /* The weights' quantization as loaded: "none", else e.g. "fp8 e4m3, per-channel weight
   * scales (made at load), weight-only; 196 Linears kept in fp8_e4m3", "gptq 4-bit, group 128,
   * ...", "gguf: Q4_K x 97, Q6_K x 16" (models/model.h kiln_model_quantization). */
  const char *quantization;
} kiln_engine_info_t;

/* Borrowed strings, valid until kiln_engine_destroy. Copies the info into out, whose size is
 * size bytes (sizeof(kiln_engine_info_t) of the header the caller was built with): members
 * appended later are not written past it, as for the metrics. The macro passes the size; a
 * program built before it existed calls the function of that name, which fills the members
 * up to has_tokenizer (the layout it was built with). */
void kiln_engine_get_info_sized(const kiln_engine_t *eng, kiln_engine_info_t *out, size_t size);
void(kiln_engine_get_info)(const kiln_engine_t *eng, kiln_engine_info_t *out);
#define kiln_engine_get_info(eng, out) kiln_engine_get_info_sized((eng), (out), sizeof(*(out)))

/* The most images a request may carry: [model] max_images_per_prompt for a model with a
 * vision tower, 0 for a text-only model. */
int32_t kiln_engine_max_images(const kiln_engine_t *eng);

/* Tokenizes text with the model's tokenizer exactly as a text prompt is (add_special: the
 * tokenizer's BOS/template tokens). *out_ids is malloc'ed (free()). Errors:
 * KILN_ERR_INVALID_ARGUMENT when the model has no tokenizer, OUT_OF_MEMORY. Thread-safe. */
kiln_status_t kiln_engine_tokenize(const kiln_engine_t *eng, const char *text, size_t len,
                                   bool add_special, int32_t **out_ids, int32_t *out_n);
/* Decodes ids to text (malloc'ed, NUL-terminated; free()). Errors: no tokenizer, an id
 * outside the tokenizer's vocabulary, OUT_OF_MEMORY. Thread-safe. */
kiln_status_t kiln_engine_detokenize(const kiln_engine_t *eng, const int32_t *ids, size_t n,
                                     bool skip_special, char **out_text);

/* A chat conversation to render with the model's chat template (kiln_engine_apply_chat_template).
 * JSON texts need not be NUL-terminated; a NULL or empty tools/extra text means "none". */
typedef struct kiln_chat_args {
  const char *messages_json; /* [{"role": "...", "content": "..."}, ...] (required) */
  size_t messages_len;
  const char *tools_json;    /* a JSON array of tool definitions, or NULL */
  size_t tools_len;
  const char *extra_json;    /* a JSON object of extra template variables
                                ({"enable_thinking": false}), or NULL */
  size_t extra_len;
  bool add_generation_prompt; /* end with the assistant's turn header (usually true) */
} kiln_chat_args_t;

/* Renders messages into a prompt exactly as transformers' apply_chat_template(messages,
 * tools=..., add_generation_prompt=..., **extra) does with the model's template. The prompt
 * already holds the special tokens the template writes (BOS...): tokenize it with
 * add_special = false. *out_prompt is malloc'ed (free()); out_len may be NULL. Errors:
 * KILN_ERR_NOT_FOUND when the model has no chat template; KILN_ERR_INVALID_ARGUMENT for
 * malformed JSON or a template error (its raise_exception message, e.g. "Conversation roles
 * must alternate"). Thread-safe. */
kiln_status_t kiln_engine_apply_chat_template(const kiln_engine_t *eng, const kiln_chat_args_t *args,
                                              char **out_prompt, size_t *out_len);

/* The chat template that kiln_engine_apply_chat_template renders with for a conversation with
 * tools (tools true: the "tool_use" template when the model has one) or without: its source text
 * (borrowed, NUL-terminated, valid as long as the engine) and whether it names the `tools`
 * variable at all (a template that never does cannot show tools to the model). Returns false,
 * with *out_src NULL, when the model has no usable chat template. out_len and
 * out_renders_tools may be NULL. Thread-safe. */
bool kiln_engine_chat_template_source(const kiln_engine_t *eng, bool tools, const char **out_src,
                                      size_t *out_len, bool *out_renders_tools);

/* ---- metrics ----------------------------------------------------------------------------- */

#define KILN_HIST_MAX_BUCKETS 24

/* A histogram: counts[i] = observations <= bounds[i] and > bounds[i-1]; counts[num_bounds]
 * holds the ones above the last bound (Prometheus's +Inf bucket, not cumulative here). */
typedef struct kiln_histogram {
  int32_t num_bounds;
  double bounds[KILN_HIST_MAX_BUCKETS];
  uint64_t counts[KILN_HIST_MAX_BUCKETS + 1];
  uint64_t count;
  double sum;
} kiln_histogram_t;

typedef struct kiln_metrics {
  /* gauges */
  int64_t requests_running; /* requests with a sequence in the running set */
  int64_t requests_waiting; /* queued, or preempted and waiting to resume */
  int64_t kv_blocks_total;
  int64_t kv_blocks_used;   /* referenced by a sequence */
  double kv_usage;          /* used / total */
  double kv_waste;          /* allocated-but-unused token slots / allocated slots, now */
  /* counters, since start */
  uint64_t requests_submitted;
  uint64_t requests_rejected; /* refused at submission */
  uint64_t requests_finished[5]; /* by kiln_finish_reason_t (STOP, LENGTH, ABORT, ERROR) */
  uint64_t prompt_tokens;      /* prompt tokens of finished-or-running requests */
  uint64_t generation_tokens;
  uint64_t prefix_cache_queries; /* prompt tokens looked up in the prefix cache */
  uint64_t prefix_cache_hits;    /* of which served from it */
  uint64_t preemptions;
  uint64_t steps;                /* engine steps (model forwards) */
  /* histograms (seconds, or tokens) */
  kiln_histogram_t time_to_first_token;
  kiln_histogram_t inter_token_latency;
  kiln_histogram_t e2e_latency;
  kiln_histogram_t queue_time;
  kiln_histogram_t tokens_per_step;
  /* speculative decoding, since start: verifications (a sequence's step with proposals),
   * tokens proposed, and of those accepted; acceptance rate = accepted / draft tokens, mean
   * accepted length = 1 + accepted / drafts (tokens per verification, the bonus included) */
  uint64_t spec_drafts;
  uint64_t spec_draft_tokens;
  uint64_t spec_accepted_tokens;
  /* [speculative] method = draft: seconds spent running the draft model (its catch-up and
   * proposal forwards and their argmax), since start */
  double spec_draft_seconds;
  /* start-up warm-up ([engine] warmup): the dummy requests run before the engine took any
   * (none of them counted above), and the seconds they took */
  uint64_t warmup_requests;
  double warmup_seconds;
  /* the KV cache's configuration (0 / NULL in a program built before they existed): tokens
   * per block, its storage ([cache] dtype: "bf16", "f16", "f32" or "fp8_e4m3", a static
   * string) and the bytes one token takes in it over all layers (K and V); the pool holds
   * kv_blocks_total * kv_block_size tokens */
  int64_t kv_block_size;
  const char *kv_cache_dtype;
  int64_t kv_bytes_per_token;
  /* constrained decoding ([engine] guide_precompute_ms), since start: compiled constraints
   * whose first contexts were classified ahead (each once: a cached compile is the same
   * constraint), and the matcher states those runs covered */
  uint64_t guide_precompute_jobs;
  uint64_t guide_precompute_states;
  /* how the forwards ran, since start (the warm-up's included): the model's through a decode
   * graph of one token per sequence, through a multi-token decode graph (speculation's
   * verification), or eagerly (prefill chunks, mixed and large batches); the draft model's
   * (method = draft) through either kind of graph or eagerly. All 0 for a given runner. */
  uint64_t graph_replays;
  uint64_t graph_multi_replays;
  uint64_t eager_forwards;
  uint64_t draft_graph_replays;
  uint64_t draft_eager_forwards;
} kiln_metrics_t;

/* Copies the metrics into out, whose size is size bytes (sizeof(kiln_metrics_t) of the header
 * the caller was built with): members appended later are not written past it. The macro
 * below passes the size; a program built before the macro existed calls the function of that
 * name, which fills the members up to (not including) spec_drafts. */
void kiln_engine_get_metrics_sized(kiln_engine_t *eng, kiln_metrics_t *out, size_t size);
void(kiln_engine_get_metrics)(kiln_engine_t *eng, kiln_metrics_t *out);
#define kiln_engine_get_metrics(eng, out) \
  kiln_engine_get_metrics_sized((eng), (out), sizeof(*(out)))

/* The metrics in Prometheus's text exposition format, names prefixed "kiln:". Returns a
 * malloc'ed string (free()), or NULL when out of memory. */
char *kiln_metrics_prometheus(const kiln_metrics_t *m, const char *model_name);

#ifdef __cplusplus
}
#endif

#endif /* KILN_KILN_H */
