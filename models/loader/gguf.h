/* gguf.h - llama.cpp's GGUF files (v2, v3) as a second source of the same models.
 *
 * kiln_gguf_open() maps the file, reads its metadata and tensor directory, translates
 * general.architecture "llama" / "qwen2" / "qwen3" (Mistral files say "llama") and the
 * <arch>.* keys into a kiln_model_config_t, and the tensor names into Hugging Face's, so the
 * same architecture code runs on both. Tensor types F32, F16, BF16 and the block types Q8_0,
 * Q4_0, Q4_K, Q5_K, Q6_K (kiln/hal_quant.h) are accepted;
 * any other (Q2_K, IQ4_XS...) is refused naming the tensor and type.
 *
 * llama.cpp's converter permutes the rows of attn_q/attn_k for the "llama" architecture so
 * that its adjacent-pair ("normal") rope applies; Kiln keeps the weights as stored and sets
 * rope.style = KILN_HAL_ROPE_INTERLEAVED for that architecture (NEOX for qwen2/qwen3), which
 * computes exactly the same attention. rope_freqs.weight (Llama 3.1) becomes
 * rope.freq_factors. qkv_bias, o_bias, mlp_bias and qk_norm are also set when layer 0 has
 * the matching tensors. eos ids are tokenizer.ggml.eos_token_id plus eot/eom when present.
 * kiln_gguf_tokenizer() reads the tokenizer stored in the metadata (gguf_vocab.c).
 */
#ifndef KILN_MODELS_GGUF_H
#define KILN_MODELS_GGUF_H

#include "base/strbuf.h"
#include "models/loader/weights.h"
#include "models/model_config.h"

/* Errors: KILN_ERR_NOT_FOUND, KILN_ERR_IO, KILN_ERR_INVALID_ARGUMENT (bad magic, version,
 * truncated header or data, an unaligned or out-of-range tensor offset, missing required
 * metadata — named), KILN_ERR_UNSUPPORTED (an architecture or tensor type Kiln does not run).
 * On success the config has passed kiln_model_config_validate(). */
kiln_status_t kiln_gguf_open(const char *path, kiln_model_config_t *out_config,
                             kiln_weights_t **out_weights);

/* The tokenizer in the file's metadata (tokenizer.ggml.*, tokenizer.chat_template*), rewritten
 * as the text of the Hugging Face tokenizer.json and tokenizer_config.json it was converted
 * from (appended to the two buffers; load them with kiln_tokenizer_load_json_config() and
 * kiln_chat_template_load_config()). Vocabularies "gpt2" (byte-level BPE, with the
 * pre-tokenizers named in gguf_vocab.c) and "llama" (SentencePiece BPE) are read. Errors:
 * KILN_ERR_NOT_FOUND when the file holds no tokenizer, KILN_ERR_UNSUPPORTED for another
 * vocabulary or pre-tokenizer (named), KILN_ERR_INVALID_ARGUMENT for malformed metadata
 * (named), KILN_ERR_IO, KILN_ERR_OUT_OF_MEMORY. */
kiln_status_t kiln_gguf_tokenizer(const char *path, kiln_strbuf_t *tokenizer_json,
                                  kiln_strbuf_t *config_json);

#endif /* KILN_MODELS_GGUF_H */
