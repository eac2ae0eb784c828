/* cli_images.h - image input for kiln generate and kiln score: --image files with a --prompt, or
 * an OpenAI-style --messages file with image_url parts, rendered with the model's chat template
 * into prompt ids (one image placeholder per image) and the images' bytes for the engine. */
#ifndef KILN_TOOLS_CLI_IMAGES_H
#define KILN_TOOLS_CLI_IMAGES_H

#include <stdint.h>

#include "base/json.h"
#include "base/status.h"
#include "kiln/kiln.h"

typedef struct kiln_cli_images {
  kiln_image_input_t *images; /* [num], data owned below */
  int32_t num;
  char *
      *names; /* [num] what each image is called in messages (its path, "messages[1].content[0]") */
  unsigned char **bytes; /* [num] owned */
} kiln_cli_images_t;

/* Reads image files (kiln generate --image PATH...) into *out. Errors name the path. */
kiln_status_t kiln_cli_images_read(const char *const *paths, int32_t n, kiln_cli_images_t *out);

/* Renders the chat to prompt ids (*out_ids malloc'ed; the template's special tokens, so no BOS
 * is added): messages_file (OpenAI-style messages: a JSON array, or an object with
 * "messages"; image_url parts hold data: URLs, file:// URLs or file paths, which are read
 * into *images), or else one user message of the images already in *images then the text
 * prompt. Errors name the file and the message and part. */
kiln_status_t kiln_cli_chat_ids(kiln_engine_t *eng, const char *messages_file, const char *prompt,
                                kiln_cli_images_t *images, int32_t **out_ids, int32_t *out_n);

/* The same for a parsed messages array (a JSONL request's "messages"); where names it in
 * errors ("line 3: messages"). */
kiln_status_t kiln_cli_chat_ids_json(kiln_engine_t *eng, const kiln_json_t *messages,
                                     const char *where, kiln_cli_images_t *images,
                                     int32_t **out_ids, int32_t *out_n);

/* Adds one image from a URL-ish string: a data:image/...;base64 URL, a file:// URL or a path
 * (http(s) is refused: kiln generate does not fetch). where names it in errors. */
kiln_status_t kiln_cli_image_add_url(const char *url, size_t len, const char *where,
                                     kiln_cli_images_t *images);

/* An engine refusal naming "image I: ..." rewritten to name the image ("photo.png: ..."). */
kiln_status_t kiln_cli_images_error(const kiln_cli_images_t *images, kiln_status_t st);

void kiln_cli_images_free(kiln_cli_images_t *im);

#endif /* KILN_TOOLS_CLI_IMAGES_H */
