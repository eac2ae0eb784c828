/* hal.h - the Kiln backend plugin ABI: the one header a backend includes.
 *
 * A backend is a shared object named libkiln-backend-<name>.so that exports exactly one symbol:
 *
 *     const kiln_hal_backend_t *kiln_backend_query(uint32_t host_major, uint32_t host_minor);
 *
 * The host (libkiln) calls it with its own ABI version and gets back the plugin's function
 * table. This header depends on nothing but <stdint.h>, <stddef.h> and <stdbool.h>.
 *
 * VERSIONING
 *   KILN_HAL_ABI_MAJOR changes when anything is removed, reordered or retyped; a host and a
 *   plugin work together only with equal majors. KILN_HAL_ABI_MINOR changes when members are
 *   appended to a table or an args struct; nothing else may change within a major.
 *   Every table and args struct starts with `uint32_t struct_size`, set by whoever fills it to
 *   sizeof() of *its* version of the struct. A reader touches a member only when struct_size
 *   covers it (KILN_HAL_HAS(ptr, member)); a missing member reads as zero/NULL. So an older
 *   plugin (smaller table) works with a newer host, and an older host ignores members a newer
 *   plugin appended. The first four members of kiln_hal_backend_t (struct_size, abi_major,
 *   abi_minor, name) are frozen across all majors so a host can always say why it refused.
 *   kiln_backend_query() should return its table even when its major differs from the host's
 *   (the host then refuses it with "plugin ABI 2.0, host ABI 1.1"); NULL means the plugin
 *   declined for its own reasons. _Static_asserts at the end pin each layout on LP64.
 *   History: 1.0 the first ABI. 1.1 appended kiln_hal_host_t.config_key (a plugin can list the
 *   keys of its INI section, e.g. to reject a misspelt one). 1.2 appended the ops the vision
 *   encoders need, kiln_hal_backend_t.layernorm and .activation (optional: NULL in a 1.1
 *   plugin's table, which the host reads as "not implemented"), and KILN_HAL_ACT_QUICK_GELU.
 *   1.3 appended kiln_hal_backend_t.mask_logits, constrained decoding's token masks (optional:
 *   the host falls back to logit biases without it).
 *   1.4 appended the quantized-weight GEMM: kiln_hal_backend_t.gemm_quant, its args
 *   (kiln_hal_gemm_quant_args_t, kiln_hal_qweight_t), the formats (kiln_hal_qfmt_t, defined
 *   byte for byte in kiln/hal_quant.h) and the capability bits KILN_HAL_CAP_QUANT(fmt)
 *   (optional: a 1.3 plugin has neither, and the host widens quantized weights at load).
 *   Within 1.4, the group formats KILN_HAL_QFMT_INT4_G / INT8_G (GPTQ, AWQ) were added with
 *   the meaning of kiln_hal_qweight_t's group_size, scales, zeros and g_idx: a backend that
 *   does not set their KILN_HAL_CAP_QUANT bits never receives them.
 *   1.5 appended the collectives (tensor/pipeline parallelism, docs/parallel.md): the
 *   capability bit KILN_HAL_CAP_COLLECTIVES, kiln_hal_comm_id_t, kiln_hal_comm_t,
 *   kiln_hal_comm_args_t, kiln_hal_coll_args_t and the table members comm_get_unique_id ..
 *   recv (optional: a 1.4 plugin's table ends at gemm_quant; the host then runs one rank).
 *   Within 1.5, FP8_E4M3 was added: KILN_HAL_QFMT_FP8_E4M3, FP8 (OCP E4M3FN) weight codes
 *   with per-group F32 scales in kiln_hal_qweight_t (FP8 checkpoints, on-the-fly FP8); as for
 *   the group formats, a backend that does not set its KILN_HAL_CAP_QUANT bit never gets it.
 *   1.6 appended kiln_hal_gemm_quant_args_t.x_quant (dynamic per-token FP8 quantization of
 *   the activations, W8A8) and its capability bit KILN_HAL_CAP_FP8_XQUANT (optional: the host
 *   sets x_quant only for a device with the bit; an older plugin reads args of the 1.5 size
 *   and never sees the field).
 *   1.7 appended the FP8 KV cache: kiln_hal_kv_write_args_t and kiln_hal_attention_args_t
 *   gained kv_format, k_scale and v_scale (kiln_hal_kv_format_t; KILN_HAL_KV_FP8_E4M3: U8
 *   caches of E4M3FN codes with per-layer static scales), and the capability bit
 *   KILN_HAL_CAP_KV_FP8 (optional: a 1.6 caller's smaller args read as kv_format = 0, the float
 *   cache of 1.0; the host asks for FP8 only on a device with the bit, and an older plugin
 *   refuses the U8 caches with INVALID_ARGUMENT).
 *
 * LIFETIME (one process, any number of registries)
 *   A process may hold several plugin registries at once (each engine has one; `kiln info` and
 *   tools have theirs), but a plugin file is loaded once per process, so the host keeps one
 *   life cycle per plugin file, shared by every registry that opens it:
 *   - init() is called when the first registry opens the plugin; a registry that opens it while
 *     it is initialised shares that initialisation (init is not called again). shutdown() is
 *     called when the last registry that opened it is freed (for a backend loaded by another
 *     plugin's load_backend, not before that plugin's shutdown). init and shutdown alternate and
 *     never nest: init is never called while an earlier init is live. After shutdown a
 *     registry created later may call init again, so shutdown leaves the plugin ready to start
 *     afresh. A failed init is not followed by shutdown (the host it got is valid during that
 *     init only), and a later registry may try init again.
 *   - The kiln_hal_host_t given to init, its ctx and every string it returns belong to the
 *     host's per-process record of the plugin: valid from init until shutdown returns,
 *     whichever registry is freed first. Its values (num_threads, the [plugin.<name>] keys) are
 *     those of the registry that opened the plugin first, copied when it did (a host without
 *     config_key copies each value when it is first read, from the first registry still
 *     holding the plugin); later registries do not reconfigure an initialised plugin.
 *   - A backend loaded with host->load_backend() stays initialised, and its table valid, until
 *     the shutdown of the plugin that loaded it has returned: the host shuts a wrapper down
 *     before the backends it loaded, however many registries hold either.
 *   - init, shutdown and probe are serialised process-wide (never two at once, from any
 *     registry). probe may run while the plugin is initialised (another registry scanning).
 *
 * OWNERSHIP
 *   - Handles (device, buffer, stream, graph) are created by the plugin, owned by the caller,
 *     and released with the matching destroy/free member. A buffer, stream or graph must be
 *     released before its device is closed.
 *   - Args structs and the tensor views in them are borrowed for the duration of the call only;
 *     the plugin copies what it needs (an op enqueued on a GPU stream captures the values, not
 *     the pointers to the args).
 *   - Host memory passed to copy_h2d/copy_d2h must stay valid until the stream is synchronised.
 *   - Errors: every fallible member returns kiln_hal_error_t * (NULL = success). A returned
 *     error is owned by the caller, who releases it with err->destroy(err). A plugin never
 *     aborts or exits the process on bad input or a device error.
 *
 * THREAD-SAFETY
 *   The backend table's global members (init, shutdown, probe, device_count, device_info) are
 *   called by the host from one thread at a time within a registry; init, shutdown and probe
 *   are serialised across registries too (LIFETIME), while device_count and device_info may be
 *   called from two registries' threads at once after init. device_open/close,
 *   buffer_alloc/free and stream_create/destroy are safe to call concurrently from several
 *   threads. A stream is used by one thread at a time; ops on one stream execute in call order.
 *   Work on different streams is unordered unless synchronised through the host.
 *
 * EXECUTION MODEL
 *   Ops are enqueued on a stream and may run asynchronously (GPU backends); the CPU backend runs
 *   them before returning. An op validates its arguments (dtypes, shapes, strides) on the host
 *   and returns KILN_HAL_ERR_INVALID_ARGUMENT or KILN_HAL_ERR_UNSUPPORTED without doing
 *   anything. Errors that arise while a kernel runs are reported by the next stream_sync.
 *   Integer metadata (token ids, positions, slot mappings, block tables...) lives in device
 *   buffers so that graphs can replay with new contents at the same addresses.
 */
#ifndef KILN_HAL_H
#define KILN_HAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_HAL_ABI_MAJOR 1
#define KILN_HAL_ABI_MINOR 7

/* The one exported symbol and its type. */
#define KILN_HAL_ENTRY_SYMBOL "kiln_backend_query"

/* True when the struct at p (which starts with uint32_t struct_size) holds member m. */
#define KILN_HAL_HAS(p, m) \
  ((p)->struct_size >= offsetof(__typeof__(*(p)), m) + sizeof((p)->m))

/* ============================================================================================
 * Errors
 * ==========================================================================================*/

typedef enum kiln_hal_code {
  KILN_HAL_OK = 0,
  KILN_HAL_ERR_INVALID_ARGUMENT = 1, /* shapes, dtypes, strides or values the op cannot take */
  KILN_HAL_ERR_UNSUPPORTED = 2,      /* valid request this backend does not implement */
  KILN_HAL_ERR_OUT_OF_MEMORY = 3,    /* device or host allocation failed */
  KILN_HAL_ERR_NO_DEVICE = 4,        /* no usable device, driver missing or too old */
  KILN_HAL_ERR_DEVICE = 5,           /* the device or driver reported a failure */
  KILN_HAL_ERR_INTERNAL = 6,         /* a bug in the plugin */
} kiln_hal_code_t;

/* An error object. Created by the plugin (or the host), released by its owner through
 * destroy(), which may be a no-op for static errors (e.g. a preallocated out-of-memory). */
typedef struct kiln_hal_error {
  uint32_t struct_size;
  int32_t code;        /* kiln_hal_code_t */
  const char *message; /* NUL-terminated, human-readable, owned by the error */
  void (*destroy)(struct kiln_hal_error *err);
} kiln_hal_error_t;

/* ============================================================================================
 * Data types and tensor views
 * ==========================================================================================*/

typedef enum kiln_hal_dtype {
  KILN_HAL_F32 = 0,
  KILN_HAL_F16 = 1,  /* IEEE binary16 */
  KILN_HAL_BF16 = 2, /* bfloat16: the top 16 bits of an f32, round-to-nearest-even */
  KILN_HAL_I32 = 3,
  KILN_HAL_I64 = 4,
  KILN_HAL_U8 = 5,
  KILN_HAL_DTYPE_COUNT = 6,
} kiln_hal_dtype_t;

/* Quantized weight formats (ABI 1.4; kiln_hal_gemm_quant_args_t). The GGUF block types are
 * defined byte for byte, with their exact dequantization, in kiln/hal_quant.h. Values 16 and
 * up are the group-quantized integer formats with separate scale/zero tensors (GPTQ, AWQ
 * int4/int8, repacked by the host at load into the one layout kiln_hal_qweight_t defines for
 * them; hal_quant.h says how each checkpoint layout maps onto it). They were added within 1.4:
 * a backend takes one only when it sets its KILN_HAL_CAP_QUANT bit, which no older backend
 * does, so the host never sends one to a backend that does not know it. */
typedef enum kiln_hal_qfmt {
  KILN_HAL_QFMT_NONE = 0,
  KILN_HAL_QFMT_Q4_0 = 1,  /* 32 weights per 18-byte block: f16 d, 16 bytes of nibbles */
  KILN_HAL_QFMT_Q8_0 = 2,  /* 32 weights per 34-byte block: f16 d, 32 int8 */
  KILN_HAL_QFMT_Q4_K = 3,  /* 256 weights per 144-byte super-block, 8 sub-blocks, 6-bit sc/min */
  KILN_HAL_QFMT_Q5_K = 4,  /* 256 weights per 176-byte super-block: Q4_K + 32 bytes of high bits */
  KILN_HAL_QFMT_Q6_K = 5,  /* 256 weights per 210-byte super-block, 16 int8 sub-block scales */
  KILN_HAL_QFMT_COUNT = 6, /* the GGUF block formats are 1 .. COUNT - 1 */
  KILN_HAL_QFMT_INT4_G = 16,    /* 4-bit codes, two per byte along K; per-group f16 scales, zeros */
  KILN_HAL_QFMT_INT8_G = 17,    /* 8-bit codes, one byte each; per-group f16 scales, zeros */
  KILN_HAL_QFMT_FP8_E4M3 = 18,  /* FP8 E4M3FN codes, one byte each; per-group f32 scales (1.5) */
  KILN_HAL_QFMT_GROUP_END = 19, /* the group formats are 16 .. GROUP_END - 1 */
} kiln_hal_qfmt_t;

/* Opaque handles; each plugin defines the structs. */
typedef struct kiln_hal_device kiln_hal_device_t;
typedef struct kiln_hal_buffer kiln_hal_buffer_t;
typedef struct kiln_hal_stream kiln_hal_stream_t;
typedef struct kiln_hal_graph kiln_hal_graph_t;

#define KILN_HAL_MAX_DIMS 4

/* A tensor is a view into a buffer: the element at index (i0, i1, ...) lives at byte
 *   offset + (i0*stride[0] + i1*stride[1] + ...) * dtype_size
 * Strides are in elements and may be larger than the dense ones (row padding, a slice of a
 * fused QKV output). Unless an op says otherwise, ops require the last dimension to be
 * contiguous (stride[ndim-1] == 1) and accept any stride for the others. offset is a multiple
 * of the element size. An "absent" optional tensor has buffer == NULL. Dimensions beyond ndim
 * are ignored. The layout of this struct is fixed for the whole major version (it is embedded
 * in args structs by value). */
typedef struct kiln_hal_tensor {
  kiln_hal_buffer_t *buffer;
  uint64_t offset; /* bytes from the start of the buffer */
  int32_t dtype;   /* kiln_hal_dtype_t */
  int32_t ndim;    /* 1..KILN_HAL_MAX_DIMS */
  int64_t shape[KILN_HAL_MAX_DIMS];
  int64_t stride[KILN_HAL_MAX_DIMS];
} kiln_hal_tensor_t;

/* ============================================================================================
 * Devices
 * ==========================================================================================*/

/* Capability bits (kiln_hal_device_info_t.caps). An op that is optional is present in the
 * table only when the backend has it; a capability says which variants an op accepts. */
enum {
  KILN_HAL_CAP_F16 = 1u << 0,               /* ops accept f16 tensors */
  KILN_HAL_CAP_BF16 = 1u << 1,              /* ops accept bf16 tensors */
  KILN_HAL_CAP_GRAPHS = 1u << 2,            /* graph_begin/end/replay work on this device */
  KILN_HAL_CAP_MIXED_BATCH_GRAPHS = 1u << 3, /* batches mixing prefill and decode capture */
  KILN_HAL_CAP_HOST_MEMORY = 1u << 4,       /* buffers are host memory (buffer_host_ptr works) */
  KILN_HAL_CAP_DEVICE_SAMPLING = 1u << 5,   /* penalize/sample/topk run on the device */
  KILN_HAL_CAP_TF32 = 1u << 6,              /* gemm may use TF32 when allow_tf32 is set */
};
/* ABI 1.4: gemm_quant takes weights of format fmt (kiln_hal_qfmt_t) on this device. Bits 32..63
 * of caps are these, one per format; a backend sets them only with a non-NULL gemm_quant. */
#define KILN_HAL_CAP_QUANT(fmt) ((uint64_t)1 << (32 + (fmt)))

typedef enum kiln_hal_device_kind {
  KILN_HAL_DEVICE_CPU = 0,
  KILN_HAL_DEVICE_GPU = 1,
  KILN_HAL_DEVICE_OTHER = 2,
} kiln_hal_device_kind_t;

/* Filled by device_info(). The caller zeroes it and sets struct_size to its own sizeof; the
 * plugin writes only the members that struct_size covers. */
typedef struct kiln_hal_device_info {
  uint32_t struct_size;
  int32_t kind;          /* kiln_hal_device_kind_t */
  char name[128];        /* "NVIDIA H200", "AMD Instinct MI300X", "x86_64 (16 threads)" */
  char arch[64];         /* "sm_90", "gfx942", "x86_64 avx2 fma" */
  uint64_t total_memory; /* bytes the backend can allocate at most */
  uint64_t free_memory;  /* bytes free when queried */
  uint64_t caps;         /* KILN_HAL_CAP_* */
  int32_t warp_size;     /* 32 (NVIDIA, RDNA), 64 (CDNA); 1 for CPUs */
  int32_t compute_units; /* SMs, CUs or threads */
  uint32_t pci_bus_id;   /* (domain << 16 | bus << 8 | device), 0 when not applicable */
} kiln_hal_device_info_t;

/* ============================================================================================
 * Host services, handed to the plugin by init(). All members may be NULL on older hosts
 * (check with KILN_HAL_HAS). Callable from any thread. The struct, its ctx and the strings its
 * members return are the host's and stay valid from init until shutdown returns (see
 * LIFETIME: not tied to any one registry); a plugin may keep the pointer until then.
 * ==========================================================================================*/

enum { KILN_HAL_LOG_ERROR = 0, KILN_HAL_LOG_WARN = 1, KILN_HAL_LOG_INFO = 2, KILN_HAL_LOG_DEBUG = 3 };

struct kiln_hal_backend;

typedef struct kiln_hal_host {
  uint32_t struct_size;
  void *ctx; /* passed back to every member */
  /* Writes one line to the host's log. */
  void (*log)(void *ctx, int32_t level, const char *message);
  /* The raw value of `key` in the INI section [plugin.<plugin name>] of the configuration
   * that first opened the plugin, or NULL when unset. The string is the host's own copy: it
   * stays valid, and unchanged, until shutdown returns. */
  const char *(*config_get)(void *ctx, const char *key);
  /* Loads and initialises another backend by name ("cpu", "cuda") or path, for plugins that
   * wrap others. Returns NULL and sets *out_error on failure. The table is the host's and
   * stays valid until this plugin's shutdown has returned; the host shuts the loaded backend
   * down itself, after this plugin's shutdown (never before). Loading the same backend again
   * returns the same table. A plugin cannot load itself, nor a backend that loaded it. */
  const struct kiln_hal_backend *(*load_backend)(void *ctx, const char *name_or_path,
                                                 kiln_hal_error_t **out_error);
  /* Number of threads the user asked the backend to use ([backend] threads; 0 = choose). */
  int32_t num_threads;
  /* ---- 1.1 ---- */
  /* The index-th key (from 0, in the order the keys were first set) of the INI section
   * [plugin.<plugin name>], or NULL past the last; with config_get, a plugin can reject keys
   * it does not know. The same configuration and lifetime as config_get's strings. NULL when
   * the host cannot list the keys (an application that supplies config_get only). */
  const char *(*config_key)(void *ctx, int32_t index);
} kiln_hal_host_t;

/* ============================================================================================
 * Op arguments. Every args struct starts with struct_size = sizeof(the caller's struct).
 * Shapes use these letters:
 *   T  tokens in the flattened batch      S  sequences in the batch
 *   H  hidden size                        V  vocabulary size
 *   NH query heads   NKV key/value heads (NH % NKV == 0)   D head dim   I intermediate size
 *   NB blocks in the KV pool   BS tokens per block   MB max blocks per sequence
 * "float" dtypes are F32, F16, BF16; arithmetic is F32 (or wider) whatever the storage dtype,
 * and results are rounded to the output dtype once, at the end.
 * ==========================================================================================*/

/* c = alpha * (a @ b) + beta * c + bias, batched.
 *   a: [M, K] or [batch, M, K]     b: [K, N] or [batch, K, N]     c: [M, N] or [batch, M, N]
 * The last two dims of a and b may be row-major (stride[-1] == 1) or column-major
 * (stride[-2] == 1), so a weight stored [N, K] row-major (a PyTorch Linear) is passed as a
 * [K, N] view with strides {1, K}. c must be row-major. A batch stride of 0 broadcasts.
 * a and b have the same float dtype; c has a's dtype or F32. bias: absent, or [N] in c's
 * dtype. beta == 0 means c is not read (it may hold NaNs). K == 0 gives beta*c + bias.
 * a, b and c have the same ndim (2 or 3); broadcasting is expressed with a batch stride of 0. */
typedef struct kiln_hal_gemm_args {
  uint32_t struct_size;
  kiln_hal_tensor_t a, b, c;
  kiln_hal_tensor_t bias;
  float alpha, beta;
  bool allow_tf32; /* F32 inputs may use reduced-precision matrix units (see CAP_TF32) */
} kiln_hal_gemm_args_t;

/* A quantized weight matrix W of N rows (outputs) by K columns (inputs) (ABI 1.4).
 *
 * GGUF block formats (1 .. KILN_HAL_QFMT_COUNT - 1): row n is K / E consecutive blocks of
 * `format` (E = its weights per block, B its bytes per block, as kiln/hal_quant.h defines them)
 * starting at byte offset + n * row_stride of buffer, so weight (n, k) is element k % E of
 * block k / E of row n. K must be a positive multiple of E; row_stride >= (K / E) * B (padded
 * rows are fine); no alignment is required (Q4_0 blocks are 18 bytes). The blocks carry their
 * scales: group_size is 0 and scales, zeros and g_idx are absent.
 *
 * Group formats (KILN_HAL_QFMT_INT4_G, KILN_HAL_QFMT_INT8_G; GPTQ and AWQ checkpoints, which
 * the host repacks once at load into this [N, K]-major layout):
 *   codes   row n starts at byte offset + n * row_stride of buffer. INT8_G: the code q of weight
 *           (n, k) is the unsigned byte k of the row (row_stride >= K). INT4_G: K is even and
 *           q is byte k / 2's low nibble for even k, its high nibble for odd k, i.e.
 *           q = (row[k / 2] >> (4 * (k % 2))) & 15 (row_stride >= K / 2).
 *   scales  F16 [N, G], last dimension contiguous, any row stride: s(n, g). G >= 1.
 *   zeros   U8 [N, G] (same shape), the zero point z(n, g), any byte value (a GPTQ v1 4-bit
 *           checkpoint's stored 15 is z = 16), or absent: symmetric, every z is 8 (INT4_G) or
 *           128 (INT8_G). (GPTQ v1 checkpoints store z - 1; the host has added the 1 back, see
 *           hal_quant.h.)
 *   g_idx   I32 [K], the group g(k) of column k (act-order, GPTQ desc_act), each in [0, G);
 *           or absent: g(k) = k / group_size, and then G == ceil(K / group_size).
 *   group_size > 0 (K itself for a single group over all K, GPTQ's group_size -1).
 *   W[n, k] = (float)(q - z(n, g(k))) * s(n, g(k)), one f32 product of an integer in
 *   [-255, 255] and an f16, hence exact; kiln/hal_quant.h computes it.
 * A g_idx entry outside [0, G) is a bad argument: the host validates g_idx at load; a backend
 * that reads one (the CPU backend checks them) returns INVALID_ARGUMENT, never reads out of
 * bounds on its account.
 *
 * FP8 (KILN_HAL_QFMT_FP8_E4M3, added within 1.5; FP8 checkpoints and on-the-fly FP8, which
 * the host brings into this layout at load, see kiln/hal_quant.h):
 *   codes   row n starts at byte offset + n * row_stride of buffer; the code q of weight (n, k)
 *           is byte k of the row (row_stride >= K). q is an OCP FP8 E4M3FN number: sign bit 7,
 *           4 exponent bits e (bias 7), 3 mantissa bits m; e > 0: (-1)^s 2^(e-7) (1 + m/8);
 *           e = 0: (-1)^s 2^-6 (m/8) (subnormals); no infinities; the largest is 448 (0x7E);
 *           S.1111.111 (0x7F, 0xFF) is NaN, a bad argument: the host rejects NaN codes at load,
 *           so a backend need not look for them (what it computes from one is undefined).
 *   scales  F32 [N, G], last dimension contiguous, any row stride: s(n, g), finite. G >= 1.
 *   zeros, g_idx  absent. group_size > 0 along K and G == ceil(K / group_size): g(k) =
 *           k / group_size (a per-channel or per-tensor scale is group_size = K, G = 1).
 *   W[n, k] = e4m3_to_f32(q) * s(n, g(k)): one f32 product, rounded once (every e4m3 value is
 *           an f32 exactly); kiln/hal_quant.h computes it. x is used as stored (weight-only
 *           FP8: activations are not quantized). */
typedef struct kiln_hal_qweight {
  kiln_hal_buffer_t *buffer;
  uint64_t offset;    /* bytes from the start of the buffer to row 0's first block */
  int32_t format;     /* kiln_hal_qfmt_t */
  int32_t group_size; /* 0 for the GGUF block formats; > 0 for the group formats and FP8 */
  int64_t n, k;       /* W is [N, K] */
  int64_t row_stride; /* bytes between the starts of rows n and n + 1 */
  /* group formats only: F16 [N,G], U8 [N,G], I32 [K]; FP8: F32 [N, G] scales only */
  kiln_hal_tensor_t scales, zeros, g_idx;
} kiln_hal_qweight_t;

/* y = x @ dequant(W)^T + bias, with W quantized (ABI 1.4: gemm_quant):
 *   x: [M, K] float (F32, F16 or BF16), last dimension contiguous, any row stride
 *   w: [N, K] kiln_hal_qweight_t (w.k == K)
 *   y: [M, N] in x's dtype or F32, last dimension contiguous, any row stride; must not overlap
 *      x or w
 *   bias: absent, or [N] in y's dtype
 * For every (m, n): y[m, n] = round_y(sum_k x[m, k] * W[n, k] + bias[n]), where W[n, k] is the
 * f32 value kiln/hal_quant.h's dequantization gives weight (n, k) (exactly: the format's
 * definition), x[m, k] is used as stored (widened to f32, never re-quantized), products and
 * their sum are accumulated in F32 or wider, in any order (a block format's weight being
 * a * q - b per sub-block, a backend may also distribute b over the sum: sum x (a q) -
 * b sum x, with a q the f32 product the format defines), and round_y is one rounding to y's
 * dtype at the end. M == 0 is a no-op. A backend takes a format only when its device has
 * KILN_HAL_CAP_QUANT(format); others are KILN_HAL_ERR_UNSUPPORTED. */
typedef enum kiln_hal_xquant {
  KILN_HAL_XQUANT_NONE = 0,      /* x is used as stored (weight-only) */
  KILN_HAL_XQUANT_FP8_TOKEN = 1, /* x quantized to FP8 E4M3 per row, dynamic scale (1.6) */
} kiln_hal_xquant_t;

/* x_quant (1.6; 0 in a 1.5 caller's smaller struct): KILN_HAL_XQUANT_FP8_TOKEN, only with FP8
 * weights (any group size) and only on a device with KILN_HAL_CAP_FP8_XQUANT, replaces each
 * row of x by its dynamic per-token FP8 quantization before the product (W8A8, as vLLM and
 * llm-compressor's "dynamic token" activations), every step in f32:
 *     a_m = max_k |x[m, k]|;   s_m = a_m / 448 (one f32 division), or 1 when that is 0;
 *     q[m, k] = kiln_hal_f32_to_fp8_e4m3(x[m, k] / s_m)   (f32 division, then round to
 *               nearest even to E4M3FN, saturating at +-448: kiln/hal_quant.h);
 *     y[m, n] = round_y(s_m * sum_k e4m3_to_f32(q[m, k]) * W[n, k] + bias[n]),
 * the sum accumulated as above, in any order and association (a backend with one scale per
 * weight row may form s_m * s(n) * sum_k e4m3(q) e4m3(w), the FP8 matrix units' product);
 * x must be finite. Any other value, or FP8_TOKEN with another format, is INVALID_ARGUMENT. */
#define KILN_HAL_CAP_FP8_XQUANT ((uint64_t)1 << 9)

typedef struct kiln_hal_gemm_quant_args {
  uint32_t struct_size;
  kiln_hal_tensor_t x;
  kiln_hal_qweight_t w;
  kiln_hal_tensor_t y, bias;
  int32_t x_quant; /* kiln_hal_xquant_t (1.6) */
} kiln_hal_gemm_quant_args_t;

/* out[t, :] = table[ids[t], :].   table: [V, H] float   ids: [T] I32   out: [T, H] (table's
 * dtype). An id outside [0, V) yields a row of zeros (never an out-of-bounds read); the host
 * validates ids before they reach the device. */
typedef struct kiln_hal_embedding_args {
  uint32_t struct_size;
  kiln_hal_tensor_t table, ids, out;
} kiln_hal_embedding_args_t;

/* RMSNorm with an optional fused residual add. x, out: [T, H]; weight: [H]; residual: absent
 * or [T, H]; all the same float dtype. With a residual:
 *     s = round(x + residual);  residual = s;  out = round(round(s * rsqrt(mean(s^2) + eps)) * (w + weight_offset))
 * without one, s = x. (Rounding as Hugging Face does: the normalized value is rounded to the
 * dtype before the weight multiply.) weight_offset is 0 for Llama, 1 for Gemma-style (1 + w).
 * out may alias x (in place); it must not alias residual. */
typedef struct kiln_hal_rmsnorm_args {
  uint32_t struct_size;
  kiln_hal_tensor_t x, residual, weight, out;
  float eps;
  float weight_offset;
} kiln_hal_rmsnorm_args_t;

typedef enum kiln_hal_rope_style {
  KILN_HAL_ROPE_NEOX = 0,        /* rotate halves: pairs (i, i + R/2) — Llama, Qwen, Mistral */
  KILN_HAL_ROPE_INTERLEAVED = 1, /* rotate adjacent pairs (2i, 2i + 1) — GPT-J, GLM */
} kiln_hal_rope_style_t;

/* Rotary embedding applied in place to q and k (either may be absent).
 *   q: [T, NH, D]   k: [T, NKV, D] (same D and dtype as q)   positions: [T] I32
 *   cos_sin: [P, R] F32: row p holds cos(p * f_i) for i < R/2, then sin(p * f_i); R <= D is
 *            the rotary dim (partial rotary leaves dims >= R untouched). Every scaling variant
 *            (linear, dynamic NTK, llama3, YaRN with its attention factor) is expressed by the
 *            host through this table.
 * For pair i with (x0, x1) = NEOX ? (x[i], x[i + R/2]) : (x[2i], x[2i+1]):
 *     x0' = x0 * cos - x1 * sin;   x1' = x1 * cos + x0 * sin
 * A position outside [0, P) leaves its row unchanged (the host validates positions). */
typedef struct kiln_hal_rope_args {
  uint32_t struct_size;
  kiln_hal_tensor_t q, k, positions, cos_sin;
  int32_t style; /* kiln_hal_rope_style_t */
} kiln_hal_rope_args_t;

typedef enum kiln_hal_act {
  KILN_HAL_ACT_SILU = 0,       /* x * sigmoid(x) — Llama, Qwen, Mistral */
  KILN_HAL_ACT_GELU_TANH = 1,  /* 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))) — Gemma */
  KILN_HAL_ACT_GELU = 2,       /* 0.5x(1 + erf(x / sqrt(2))) */
  KILN_HAL_ACT_QUICK_GELU = 3, /* x * sigmoid(1.702x) — Qwen2-VL's vision MLP (ABI 1.2) */
} kiln_hal_act_t;

/* Gated activation: out[t, i] = act(x[t, i]) * x[t, I + i].   x: [T, 2I]   out: [T, I],
 * same float dtype. (The gate and up projections are one fused GEMM output.) act is any
 * kiln_hal_act_t; a plugin built against ABI 1.1 refuses QUICK_GELU (INVALID_ARGUMENT). */
typedef struct kiln_hal_silu_mul_args {
  uint32_t struct_size;
  kiln_hal_tensor_t x, out;
  int32_t act; /* kiln_hal_act_t */
} kiln_hal_silu_mul_args_t;

/* ---- 1.2 ---- */

/* LayerNorm with an optional fused residual add and an optional bias. x, out: [T, H]; weight:
 * [H]; bias: absent or [H]; residual: absent or [T, H]; all one float dtype. With a residual:
 *     s = round(x + residual);  residual = s;     else s = x.
 *     mean = sum(s) / H;  var = sum((s - mean)^2) / H   (biased, computed in f32 or wider)
 *     out = round((s - mean) * rsqrt(var + eps) * weight + bias)   (one rounding, as PyTorch's
 *                                                                   layer_norm)
 * An absent bias adds 0. out may alias x (in place); it must not alias residual. eps is finite
 * and >= 0. */
typedef struct kiln_hal_layernorm_args {
  uint32_t struct_size;
  kiln_hal_tensor_t x, residual, weight, bias, out;
  float eps;
} kiln_hal_layernorm_args_t;

/* Elementwise activation: out[t, i] = act(x[t, i]) for a kiln_hal_act_t act (SILU, GELU_TANH,
 * GELU, QUICK_GELU), rounded once. x, out: [T, N], same float dtype; out may alias x. */
typedef struct kiln_hal_activation_args {
  uint32_t struct_size;
  kiln_hal_tensor_t x, out;
  int32_t act; /* kiln_hal_act_t */
} kiln_hal_activation_args_t;

/* Elementwise copy with dtype conversion between any two float dtypes (or equal integer
 * dtypes): dst[i...] = src[i...] for same-shaped views of up to 4 dims, any strides. */
typedef struct kiln_hal_copy_args {
  uint32_t struct_size;
  kiln_hal_tensor_t src, dst;
} kiln_hal_copy_args_t;

/* out = a + b, elementwise, same shape [T, H], same float dtype; out may alias a or b. */
typedef struct kiln_hal_add_args {
  uint32_t struct_size;
  kiln_hal_tensor_t a, b, out;
} kiln_hal_add_args_t;

/* The paged KV cache. Each layer has a K cache and a V cache of shape [NB, NKV, BS, D]
 * (block-major, then head, then position in block), dense, in the model's float dtype
 * (kv_format = KILN_HAL_KV_FLOAT) or, from ABI 1.7, as FP8 codes (KILN_HAL_KV_FP8_E4M3, below).
 * Token slot s = block_id * BS + position_in_block.
 *
 * The FP8 KV cache (ABI 1.7; kv_write and attention take the same kv_format and scales for one
 * layer's caches; only on a device with KILN_HAL_CAP_KV_FP8, else KILN_HAL_ERR_UNSUPPORTED):
 *   k_cache, v_cache  U8 [NB, NKV, BS, D], dense: byte c is an OCP FP8 E4M3FN code, decoded as
 *                     kiln_hal_fp8_e4m3_to_f32 (kiln/hal_quant.h; hal.h's FP8 weights define it).
 *   k_scale, v_scale  the static per-tensor scales of this layer's K and V caches (one float
 *                     each, for every head, block and position: per-layer, per-k/v), finite and
 *                     > 0 (else INVALID_ARGUMENT). They come from the host: a checkpoint's
 *                     calibrated k_scale / v_scale, or 1.0 (docs/engine.md).
 *   kv_write          code = kiln_hal_f32_to_fp8_e4m3(f32(k[t, h, d]) / k_scale): one f32
 *                     division of the value widened to f32, then round to nearest even to
 *                     E4M3FN, saturating at +-448 (|x| >= 448 and infinities give +-448); NaN
 *                     gives the NaN code 0x7F. Likewise v with v_scale. k and v are any one
 *                     float dtype (the model's); the bytes written are the same on every backend.
 *   attention         key j's value is K_j[d] = k_scale * e4m3(code) and V_j[d] = v_scale *
 *                     e4m3(code) (real numbers); the op is the float op below on these values,
 *                     with q and out of one float dtype. A backend may fold the scales (score =
 *                     (scale * k_scale) * dot(q, e4m3(k codes)), out = v_scale * sum_j p_j
 *                     e4m3(v codes)) and may hold e4m3 values in q's dtype (exact for f16, bf16
 *                     and f32); the result then differs from the float op on K, V by rounding
 *                     only. A NaN code leaves the rows that see it unspecified.
 * The FP8 cache's own error (against the unquantized k, v) is that of the cast: a relative
 * 2^-4 at most for |x| / scale in [2^-6, 448], an absolute 2^-10 * scale below (subnormals),
 * and saturation above 448 * scale; see docs/engine.md.
 *
 * kv_write scatters new keys/values into the cache:
 *   k, v: [T, NKV, D]   k_cache, v_cache: [NB, NKV, BS, D]   slot_mapping: [T] I32
 * Row t goes to slot slot_mapping[t]; a negative slot means "skip" (padding). Slots outside
 * the pool are skipped too (never an out-of-bounds write). k/v dtype must equal the cache's.
 * Two rows naming the same slot in one call leave either row's values there (the host never
 * does this). */
typedef enum kiln_hal_kv_format {
  KILN_HAL_KV_FLOAT = 0,    /* caches in the float dtype of k / q (1.0's cache); scales ignored */
  KILN_HAL_KV_FP8_E4M3 = 1, /* U8 caches of E4M3FN codes, k_scale / v_scale (1.7) */
} kiln_hal_kv_format_t;

/* The device takes kv_format = KILN_HAL_KV_FP8_E4M3 in kv_write and attention (1.7). */
#define KILN_HAL_CAP_KV_FP8 ((uint64_t)1 << 8)

typedef struct kiln_hal_kv_write_args {
  uint32_t struct_size;
  kiln_hal_tensor_t k, v, k_cache, v_cache, slot_mapping;
  /* ---- 1.7 ---- */
  int32_t kv_format; /* kiln_hal_kv_format_t; 0 in a 1.6 caller's smaller struct */
  float k_scale, v_scale; /* FP8 only: finite, > 0 */
} kiln_hal_kv_write_args_t;

/* Paged attention for a flattened batch that mixes prefill chunks and decodes.
 *   q:            [T, NH, D]              out: [T, NH, D] (q's dtype)
 *   k_cache, v_cache: [NB, NKV, BS, D]    (already holding this step's keys: kv_write first)
 *   block_table:  [S, MB] I32             block ids of each sequence, in order
 *   seq_lens:     [S] I32                 keys visible to sequence s (cached + new tokens)
 *   query_start_loc: [S + 1] I32          sequence s owns query rows [qsl[s], qsl[s+1])
 * Sequence s has q_len = qsl[s+1] - qsl[s] <= seq_lens[s] queries, the last q_len tokens of
 * the sequence: query row qsl[s] + i sits at position p = seq_lens[s] - q_len + i. It
 * attends to keys j in [0, seq_lens[s]) with
 *     j <= p                       when causal
 *     j > p - sliding_window       when sliding_window > 0
 * Query head h reads KV head h / (NH / NKV) (GQA; MQA when NKV == 1).
 *     score = scale * dot(q, k_j);  if softcap > 0: score = softcap * tanh(score / softcap)
 *     out = sum_j softmax(score)_j * v_j
 * q, out, k_cache and v_cache have one float dtype (kv_format = KILN_HAL_KV_FLOAT), or q and
 * out one float dtype and the caches U8 FP8 codes (KILN_HAL_KV_FP8_E4M3, with k_scale and
 * v_scale as kv_write's, above). query_start_loc[0] == 0 and it is
 * non-decreasing. A query row with no visible key gets zeros. Rows at or beyond qsl[S] are not
 * written.
 * Metadata that breaks these rules (a block id outside [0, NB), q_len > seq_lens[s], a
 * decreasing query_start_loc) never makes a backend read or write out of bounds; it may be
 * reported as INVALID_ARGUMENT by the call or the next stream_sync, or leave the affected rows
 * unspecified. max_query_len and max_seq_len are upper bounds over the batch used to size the
 * launch; under graph capture pass the largest values the graph will ever see. num_seqs == S. */
typedef struct kiln_hal_attention_args {
  uint32_t struct_size;
  kiln_hal_tensor_t q, k_cache, v_cache, out;
  kiln_hal_tensor_t block_table, seq_lens, query_start_loc;
  int32_t num_seqs;
  int32_t max_query_len;
  int32_t max_seq_len;
  float scale;
  bool causal;
  int32_t sliding_window; /* 0 = unlimited */
  float softcap;          /* 0 = off */
  /* ---- 1.7 ---- */
  int32_t kv_format; /* kiln_hal_kv_format_t; 0 in a 1.6 caller's smaller struct */
  float k_scale, v_scale; /* FP8 only: finite, > 0 (kv_write's for these caches) */
} kiln_hal_attention_args_t;

/* ----- sampling support. logits are [S, V] F32 rows (a row stride is allowed). Logits may be
 * -inf; a row holding NaN yields some index in [0, V), never an out-of-range id. ---------- */

/* out_ids[s] = argmax_v logits[s, v] (the lowest index among equal maxima).
 * out_logprob: absent, or [S] F32 = log_softmax(logits[s])[out_ids[s]]. */
typedef struct kiln_hal_argmax_args {
  uint32_t struct_size;
  kiln_hal_tensor_t logits, out_ids, out_logprob;
} kiln_hal_argmax_args_t;

/* The k largest logits of each row, sorted descending (ties: lower index first).
 *   out_values: [S, k] F32   out_ids: [S, k] I32;  k = out_values.shape[1] <= V.
 * out_lse: absent, or [S] F32 = logsumexp(logits[s]) (so logprobs = values - lse). */
typedef struct kiln_hal_topk_args {
  uint32_t struct_size;
  kiln_hal_tensor_t logits, out_values, out_ids, out_lse;
} kiln_hal_topk_args_t;

/* Penalties and biases applied to logits in place, per row s (vLLM / OpenAI semantics), in
 * this order: repetition, then frequency/presence, then bias:
 *   repetition (r = repetition[s], 1 = off): for each distinct token in prompt or output,
 *       logit = logit > 0 ? logit / r : logit * r
 *   frequency/presence (output tokens only): logit -= frequency[s] * count + presence[s] * (count > 0)
 *   bias: logit[bias_ids[i]] += bias_values[i] for i in [bias_offsets[s], bias_offsets[s+1])
 * Token lists are flattened with offsets: tokens of row s are ids[offsets[s] .. offsets[s+1]).
 *   prompt_ids, output_ids, bias_ids: [*] I32; *_offsets: [S + 1] I32; bias_values: [*] F32
 *   repetition, frequency, presence: [S] F32.
 * The groups: repetition = {repetition} over whichever of the prompt and output lists are
 * present; frequency/presence = {frequency, presence, output_ids/offsets} (frequency and
 * presence come together, with the output list); bias = {bias_ids, bias_values, bias_offsets}
 * (all three or none). A group is absent when its per-row tensor (repetition, frequency,
 * bias_values) is absent; a token list is a pair (ids and offsets, both or neither). Ids outside [0, V) are ignored; a bias id listed twice in a row
 * adds both values. */
typedef struct kiln_hal_penalize_args {
  uint32_t struct_size;
  kiln_hal_tensor_t logits;
  kiln_hal_tensor_t prompt_ids, prompt_offsets, output_ids, output_offsets;
  kiln_hal_tensor_t repetition, frequency, presence;
  kiln_hal_tensor_t bias_ids, bias_values, bias_offsets;
} kiln_hal_penalize_args_t;

/* Samples one token per row. Per row s, with temperature t = temperature[s]:
 *   t <= 0: greedy, exactly as argmax.
 *   else p = softmax(logits[s] / t), and token v is kept iff all of:
 *       rank(v) < top_k[s]            when top_k[s] > 0   (rank: by p descending, ties by index)
 *       mass_before(v) < top_p[s]     when top_p[s] < 1   (mass_before: sum of p over tokens
 *                                                          ranked before v)
 *       p[v] >= min_p[s] * max(p)     when min_p[s] > 0
 *   (the most probable token is always kept). With W = sum of p over kept tokens, the result
 *   is the kept token v with the lowest index such that sum of p[u] over kept u <= v exceeds
 *   uniform[s] * W; uniform[s] in [0, 1) comes from the host's per-request seeded generator,
 *   so a request's samples do not depend on what else is in the batch.
 *   temperature, top_p, min_p, uniform: [S] F32   top_k: [S] I32   out_ids: [S] I32
 *   temperature and uniform are required; an absent top_k, top_p or min_p means "off".
 *   out_logprob: absent, or [S] F32 = log_softmax(logits[s])[out_ids[s]] (the raw logits). */
typedef struct kiln_hal_sample_args {
  uint32_t struct_size;
  kiln_hal_tensor_t logits;
  kiln_hal_tensor_t temperature, top_k, top_p, min_p, uniform;
  kiln_hal_tensor_t out_ids, out_logprob;
} kiln_hal_sample_args_t;

/* Constrained decoding (ABI 1.3): bans the tokens a row's mask does not allow, in place. For
 * row s, r = rows[s] (rows absent: r = s); when r is outside [0, M) the row is left as is, else
 * logits[s, v] = -inf for every v whose bit (v % 32) of mask[r, v / 32] is clear (bits at or
 * beyond V are ignored). NaN logits of allowed tokens stay NaN.
 *   logits: [S, V] F32   mask: [M, W] I32 with W >= ceil(V / 32) (bit patterns)   rows: [S] I32 */
typedef struct kiln_hal_mask_args {
  uint32_t struct_size;
  kiln_hal_tensor_t logits, mask, rows;
} kiln_hal_mask_args_t;

/* ============================================================================================
 * Collectives (ABI 1.5; docs/parallel.md). Everything of 1.5 is in this block, the table
 * members below and the pins at the end.
 *
 * A communicator joins world_size ranks (threads or processes, one device each) that created
 * it from the same kiln_hal_comm_id_t (made once by comm_get_unique_id on any rank and handed
 * to the others out of band: fork, a file, a socket). comm_create blocks until every rank has
 * joined or timeout_ms has passed (then KILN_HAL_ERR_DEVICE, naming the ranks that never
 * arrived). The collectives are enqueued on a stream like any op and ordered with the
 * stream's other work; every rank must issue the same collectives on a communicator in the
 * same order (send/recv: matching pairs, ordered so that no cycle of ranks all send first).
 * A communicator is used by one stream (one thread) at a time.
 *   all_reduce  dst = sum over ranks of src. src and dst: same dtype (F32, F16, BF16) and
 *               shape; dst == src (same buffer and offset) is in place.
 *   all_gather  dst[r*n .. (r+1)*n) = src of rank r along dimension 0, src [n, ...] and dst
 *               [world_size*n, ...] (same other dims, same dtype: any). src may be rank r's
 *               own slice of dst (in place).
 *   broadcast   dst on every rank = dst of rank `peer` (the root), in place; src is ignored.
 *   send        src to rank `peer`; returns when the peer's matching recv has the data.
 *   recv        dst from rank `peer`.
 * Tensors are dense (row-major without padding). Sizes, dtypes and roots must agree across
 * ranks: the cpu backend checks and fails every participating rank with INVALID_ARGUMENT
 * naming both sizes; NCCL/RCCL do not check (a mismatch there is undefined: the host must
 * never issue one). A peer that does not arrive within timeout_ms fails the waiting ranks with
 * KILN_HAL_ERR_DEVICE naming the rank(s); the communicator is then unusable and must be
 * destroyed. (The cuda/rocm backends cannot do this yet: NCCL has no per-call timeout, so a
 * missing peer blocks the stream; docs/parallel.md.)
 * Summation order and precision are the backend's, stated in docs/parallel.md: the cpu
 * backend sums in F32 in rank order 0..W-1 and rounds F16/BF16 once, bit-identical on every
 * rank; NCCL promises neither an order nor an F32 accumulator.
 * ==========================================================================================*/

/* The device supports communicators and the collectives (the table members below are set). */
#define KILN_HAL_CAP_COLLECTIVES ((uint64_t)1 << 7)

#define KILN_HAL_COMM_ID_BYTES 128
/* Opaque bytes naming one communicator's rendezvous (NCCL: its ncclUniqueId; cpu: the name
 * of a shared-memory segment). Copyable between processes. */
typedef struct kiln_hal_comm_id {
  uint8_t bytes[KILN_HAL_COMM_ID_BYTES];
} kiln_hal_comm_id_t;

typedef struct kiln_hal_comm kiln_hal_comm_t;

/* Timeout used when kiln_hal_comm_args_t.timeout_ms is 0. */
#define KILN_HAL_COMM_DEFAULT_TIMEOUT_MS 300000

typedef struct kiln_hal_comm_args {
  uint32_t struct_size;
  int32_t world_size; /* 1..KILN_HAL_COMM_MAX_RANKS */
  int32_t rank;       /* 0..world_size-1, distinct per participant */
  int32_t timeout_ms; /* how long any wait for a peer may take; 0 = the default; < 0 invalid */
  kiln_hal_comm_id_t id;
} kiln_hal_comm_args_t;

#define KILN_HAL_COMM_MAX_RANKS 64

/* Arguments of every collective (which members each reads: see above). */
typedef struct kiln_hal_coll_args {
  uint32_t struct_size;
  int32_t peer; /* broadcast: the root; send: the destination; recv: the source */
  kiln_hal_comm_t *comm;
  kiln_hal_tensor_t src, dst;
} kiln_hal_coll_args_t;

/* ============================================================================================
 * The backend table
 * ==========================================================================================*/

enum {
  KILN_HAL_BUFFER_DEFAULT = 0,
  KILN_HAL_BUFFER_HOST_PINNED = 1u << 0, /* page-locked host memory, device-accessible (staging) */
};

typedef struct kiln_hal_backend {
  /* ---- frozen prefix: identical in every ABI major ---- */
  uint32_t struct_size;
  uint16_t abi_major; /* KILN_HAL_ABI_MAJOR the plugin was built against */
  uint16_t abi_minor;
  const char *name; /* "cpu", "cuda", "rocm": matches libkiln-backend-<name>.so */

  /* ---- 1.0 ---- */
  /* Free-form build description for `kiln info`: compiler, toolkit, target archs. */
  const char *build_info;

  /* Called before any other member but probe: once per process for as long as the plugin
   * stays initialised, however many registries open it (see LIFETIME). host stays valid until
   * shutdown returns. Required. */
  kiln_hal_error_t *(*init)(const kiln_hal_host_t *host);
  /* Called once per successful init, when the last registry that opened the plugin is freed,
   * after every handle was released and before any backend this plugin loaded with
   * host->load_backend() is shut down. Plugins are never dlclose'd. Required. */
  void (*shutdown)(void);
  /* How well this plugin can serve here: 0 = not at all (the error, if any, says why: "no
   * CUDA driver: libcuda.so.1: cannot open shared object file"), 1..99 = CPU-class, 100+ =
   * an accelerator. Called before init (and again by each registry that scans the plugin,
   * possibly while it is initialised); must be cheap and side-effect free. Required. */
  kiln_hal_error_t *(*probe)(int32_t *out_score);

  kiln_hal_error_t *(*device_count)(int32_t *out_count);
  kiln_hal_error_t *(*device_info)(int32_t index, kiln_hal_device_info_t *out_info);
  kiln_hal_error_t *(*device_open)(int32_t index, kiln_hal_device_t **out_device);
  void (*device_close)(kiln_hal_device_t *device);
  /* Current free and total bytes of an open device. */
  kiln_hal_error_t *(*device_memory)(kiln_hal_device_t *device, uint64_t *out_free,
                                     uint64_t *out_total);

  /* Buffers: size bytes, aligned to at least 256 bytes, contents undefined. size 0 is valid
   * (returns a buffer no op may read). flags: KILN_HAL_BUFFER_*. */
  kiln_hal_error_t *(*buffer_alloc)(kiln_hal_device_t *device, uint64_t size, uint32_t flags,
                                    kiln_hal_buffer_t **out_buffer);
  void (*buffer_free)(kiln_hal_buffer_t *buffer);
  /* Host address of a host-visible buffer (CAP_HOST_MEMORY or HOST_PINNED), else NULL.
   * Optional: NULL member = never host-visible. */
  void *(*buffer_host_ptr)(kiln_hal_buffer_t *buffer);

  kiln_hal_error_t *(*stream_create)(kiln_hal_device_t *device, kiln_hal_stream_t **out_stream);
  void (*stream_destroy)(kiln_hal_stream_t *stream);
  /* Waits until everything enqueued has run; returns the first asynchronous error. */
  kiln_hal_error_t *(*stream_sync)(kiln_hal_stream_t *stream);

  /* Copies, ordered on the stream. Ranges are checked against the buffer sizes. */
  kiln_hal_error_t *(*copy_h2d)(kiln_hal_stream_t *stream, kiln_hal_buffer_t *dst,
                                uint64_t dst_offset, const void *src, uint64_t size);
  kiln_hal_error_t *(*copy_d2h)(kiln_hal_stream_t *stream, void *dst, kiln_hal_buffer_t *src,
                                uint64_t src_offset, uint64_t size);
  kiln_hal_error_t *(*copy_d2d)(kiln_hal_stream_t *stream, kiln_hal_buffer_t *dst,
                                uint64_t dst_offset, kiln_hal_buffer_t *src, uint64_t src_offset,
                                uint64_t size);
  /* Sets size bytes at offset to value. */
  kiln_hal_error_t *(*fill)(kiln_hal_stream_t *stream, kiln_hal_buffer_t *dst, uint64_t offset,
                            uint64_t size, uint8_t value);

  /* Ops (see the args structs above). All required in 1.0. */
  kiln_hal_error_t *(*gemm)(kiln_hal_stream_t *stream, const kiln_hal_gemm_args_t *args);
  kiln_hal_error_t *(*embedding)(kiln_hal_stream_t *stream, const kiln_hal_embedding_args_t *args);
  kiln_hal_error_t *(*rmsnorm)(kiln_hal_stream_t *stream, const kiln_hal_rmsnorm_args_t *args);
  kiln_hal_error_t *(*rope)(kiln_hal_stream_t *stream, const kiln_hal_rope_args_t *args);
  kiln_hal_error_t *(*silu_mul)(kiln_hal_stream_t *stream, const kiln_hal_silu_mul_args_t *args);
  kiln_hal_error_t *(*add)(kiln_hal_stream_t *stream, const kiln_hal_add_args_t *args);
  kiln_hal_error_t *(*copy)(kiln_hal_stream_t *stream, const kiln_hal_copy_args_t *args);
  kiln_hal_error_t *(*kv_write)(kiln_hal_stream_t *stream, const kiln_hal_kv_write_args_t *args);
  kiln_hal_error_t *(*attention)(kiln_hal_stream_t *stream, const kiln_hal_attention_args_t *args);
  kiln_hal_error_t *(*argmax)(kiln_hal_stream_t *stream, const kiln_hal_argmax_args_t *args);
  kiln_hal_error_t *(*topk)(kiln_hal_stream_t *stream, const kiln_hal_topk_args_t *args);
  kiln_hal_error_t *(*penalize)(kiln_hal_stream_t *stream, const kiln_hal_penalize_args_t *args);
  kiln_hal_error_t *(*sample)(kiln_hal_stream_t *stream, const kiln_hal_sample_args_t *args);

  /* Graphs (optional as a group: NULL members, or no CAP_GRAPHS on a device, mean the host
   * runs eagerly). Between graph_begin and graph_end the ops enqueued on the stream are
   * recorded instead of run; no copy_h2d/copy_d2h/stream_sync/alloc may happen meanwhile
   * (KILN_HAL_ERR_INVALID_ARGUMENT); such a refusal ends the capture: graph_end then fails
   * and returns no graph, and the stream runs eagerly again. Replay runs the recorded ops with
   * the buffers' current contents; every buffer a graph touches must outlive it at the same
   * address. */
  kiln_hal_error_t *(*graph_begin)(kiln_hal_stream_t *stream);
  kiln_hal_error_t *(*graph_end)(kiln_hal_stream_t *stream, kiln_hal_graph_t **out_graph);
  kiln_hal_error_t *(*graph_replay)(kiln_hal_graph_t *graph, kiln_hal_stream_t *stream);
  void (*graph_destroy)(kiln_hal_graph_t *graph);

  /* ---- 1.2 ---- */
  /* The ops of the vision encoders (see their args structs). Optional: NULL (and so in a 1.1
   * plugin, whose table ends at graph_destroy) means the backend lacks the op; a model that
   * needs it refuses to load there. Ops like the others: validated on the host, enqueued on
   * the stream, recordable in graphs. */
  kiln_hal_error_t *(*layernorm)(kiln_hal_stream_t *stream, const kiln_hal_layernorm_args_t *args);
  kiln_hal_error_t *(*activation)(kiln_hal_stream_t *stream,
                                  const kiln_hal_activation_args_t *args);

  /* ---- 1.3 ---- */
  /* Token masks (kiln_hal_mask_args_t). Optional: NULL (a 1.2 plugin's table ends at
   * activation) makes the host express masks as logit biases through penalize. */
  kiln_hal_error_t *(*mask_logits)(kiln_hal_stream_t *stream, const kiln_hal_mask_args_t *args);

  /* ---- 1.4 ---- */
  /* The quantized-weight GEMM (kiln_hal_gemm_quant_args_t). Optional: NULL (a 1.3 plugin's
   * table ends at mask_logits) or a device without KILN_HAL_CAP_QUANT(format) makes the host
   * dequantize such weights to the serving dtype at load and use gemm. */
  kiln_hal_error_t *(*gemm_quant)(kiln_hal_stream_t *stream,
                                  const kiln_hal_gemm_quant_args_t *args);

  /* ---- 1.5: collectives (see the block above kiln_hal_backend_t) ---- */
  /* Optional as a group: all NULL (a 1.4 plugin's table ends at gemm_quant) or a device
   * without KILN_HAL_CAP_COLLECTIVES means one rank only. */
  kiln_hal_error_t *(*comm_get_unique_id)(kiln_hal_comm_id_t *out_id);
  kiln_hal_error_t *(*comm_create)(kiln_hal_device_t *device, const kiln_hal_comm_args_t *args,
                                   kiln_hal_comm_t **out_comm);
  /* Releases the rank's share; never blocks on peers. Before the device is closed. */
  void (*comm_destroy)(kiln_hal_comm_t *comm);
  kiln_hal_error_t *(*all_reduce)(kiln_hal_stream_t *stream, const kiln_hal_coll_args_t *args);
  kiln_hal_error_t *(*all_gather)(kiln_hal_stream_t *stream, const kiln_hal_coll_args_t *args);
  kiln_hal_error_t *(*broadcast)(kiln_hal_stream_t *stream, const kiln_hal_coll_args_t *args);
  kiln_hal_error_t *(*send)(kiln_hal_stream_t *stream, const kiln_hal_coll_args_t *args);
  kiln_hal_error_t *(*recv)(kiln_hal_stream_t *stream, const kiln_hal_coll_args_t *args);
} kiln_hal_backend_t;

typedef const kiln_hal_backend_t *(*kiln_hal_query_fn)(uint32_t host_major, uint32_t host_minor);

/* Size in bytes of one element; 0 for an invalid dtype. */
static inline size_t kiln_hal_dtype_size(int32_t dtype) {
  switch (dtype) {
    case KILN_HAL_F32: return 4;
    case KILN_HAL_F16: return 2;
    case KILN_HAL_BF16: return 2;
    case KILN_HAL_I32: return 4;
    case KILN_HAL_I64: return 8;
    case KILN_HAL_U8: return 1;
    default: return 0;
  }
}

static inline const char *kiln_hal_dtype_name(int32_t dtype) {
  switch (dtype) {
    case KILN_HAL_F32: return "f32";
    case KILN_HAL_F16: return "f16";
    case KILN_HAL_BF16: return "bf16";
    case KILN_HAL_I32: return "i32";
    case KILN_HAL_I64: return "i64";
    case KILN_HAL_U8: return "u8";
    default: return "invalid";
  }
}

/* ---- layout pins (LP64): inserting or retyping a member breaks the build; append only. ---- */
#ifdef __cplusplus
#define KILN_HAL_STATIC_ASSERT static_assert
#else
#define KILN_HAL_STATIC_ASSERT _Static_assert
#endif
#if defined(__LP64__) || defined(_LP64)
KILN_HAL_STATIC_ASSERT(sizeof(kiln_hal_tensor_t) == 88, "kiln_hal_tensor_t layout is frozen in ABI 1");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_error_t, destroy) == 16, "kiln_hal_error_t layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_device_info_t, pci_bus_id) == 232, "device_info layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_host_t, num_threads) == 40, "kiln_hal_host_t layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_host_t, config_key) == 48, "kiln_hal_host_t 1.1 changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_gemm_args_t, allow_tf32) == 368, "gemm args layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_embedding_args_t, out) == 184, "embedding args layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_rmsnorm_args_t, weight_offset) == 364, "rmsnorm args layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_rope_args_t, style) == 360, "rope args layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_silu_mul_args_t, act) == 184, "silu_mul args layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_copy_args_t, dst) == 96, "copy args layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_add_args_t, out) == 184, "add args layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_kv_write_args_t, slot_mapping) == 360, "kv_write args layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_attention_args_t, softcap) == 648, "attention args layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_argmax_args_t, out_logprob) == 184, "argmax args layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_topk_args_t, out_lse) == 272, "topk args layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_penalize_args_t, bias_offsets) == 888, "penalize args layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_sample_args_t, out_logprob) == 624, "sample args layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_backend_t, graph_destroy) == 296, "backend table layout changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_layernorm_args_t, eps) == 448,
                       "layernorm args 1.2 changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_activation_args_t, act) == 184,
                       "activation args 1.2 changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_backend_t, layernorm) == 304, "backend table 1.2 changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_backend_t, activation) == 312,
                       "backend table 1.2 changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_mask_args_t, rows) == 184, "mask args 1.3 changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_backend_t, mask_logits) == 320, "backend table 1.3 changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_qweight_t, scales) == 48, "qweight 1.4 changed");
KILN_HAL_STATIC_ASSERT(sizeof(kiln_hal_qweight_t) == 312, "qweight 1.4 changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_gemm_quant_args_t, w) == 96, "gemm_quant args 1.4 changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_gemm_quant_args_t, bias) == 496,
                       "gemm_quant args 1.4 changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_backend_t, gemm_quant) == 328, "backend table 1.4 changed");
/* 1.5: collectives */
KILN_HAL_STATIC_ASSERT(sizeof(kiln_hal_comm_id_t) == 128, "comm id 1.5 changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_comm_args_t, id) == 16, "comm args 1.5 changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_coll_args_t, dst) == 104, "coll args 1.5 changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_backend_t, comm_get_unique_id) == 336,
                       "backend table 1.5 changed");
KILN_HAL_STATIC_ASSERT(sizeof(kiln_hal_backend_t) == 400, "backend table 1.5 changed");
/* 1.6: W8A8 FP8 */
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_gemm_quant_args_t, x_quant) == 584,
                       "gemm_quant args 1.6 changed");
/* 1.7: the FP8 KV cache */
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_kv_write_args_t, kv_format) == 448,
                       "kv_write args 1.7 changed");
KILN_HAL_STATIC_ASSERT(sizeof(kiln_hal_kv_write_args_t) == 464, "kv_write args 1.7 changed");
KILN_HAL_STATIC_ASSERT(offsetof(kiln_hal_attention_args_t, kv_format) == 652,
                       "attention args 1.7 changed");
KILN_HAL_STATIC_ASSERT(sizeof(kiln_hal_attention_args_t) == 664, "attention args 1.7 changed");
#endif

#ifdef __cplusplus
}
#endif

#endif /* KILN_HAL_H */
