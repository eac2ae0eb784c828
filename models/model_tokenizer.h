/* model_tokenizer.h - the tokenizer and chat templates of a model, wherever they are.
 *
 * A model directory (or a .gguf file's folder) with a tokenizer.json uses it, with
 * tokenizer_config.json and the chat template files beside it, exactly as transformers does.
 * A .gguf file with no tokenizer.json beside it uses the tokenizer in its own metadata
 * (kiln_gguf_tokenizer()), so that a GGUF file alone is a complete model.
 */
#ifndef KILN_MODELS_MODEL_TOKENIZER_H
#define KILN_MODELS_MODEL_TOKENIZER_H

#include "base/status.h"
#include "models/template/template.h"
#include "models/tokenizer/tokenizer.h"

typedef enum kiln_tokenizer_source {
  KILN_TOKENIZER_NONE = 0, /* neither a tokenizer.json nor GGUF metadata */
  KILN_TOKENIZER_JSON = 1, /* tokenizer.json beside the model */
  KILN_TOKENIZER_GGUF = 2, /* the .gguf file's tokenizer.ggml.* metadata */
} kiln_tokenizer_source_t;

/* Opens model_path's tokenizer. *out_tok is NULL with no error when the model has none (a
 * directory without tokenizer.json, a .gguf without tokenizer metadata). *out_chat receives
 * the chat templates when out_chat is not NULL: NULL when there are none or they are broken;
 * then *out_chat_error (when not NULL) receives why (an owned status; NULL for "none at all").
 * *out_source (may be NULL) says where the tokenizer came from. Errors: the tokenizer exists
 * but cannot be loaded (named), out of memory. */
kiln_status_t kiln_model_open_tokenizer(const char *model_path, kiln_tokenizer_t **out_tok,
                                        kiln_chat_template_t **out_chat,
                                        kiln_status_t *out_chat_error,
                                        kiln_tokenizer_source_t *out_source);

#endif /* KILN_MODELS_MODEL_TOKENIZER_H */
