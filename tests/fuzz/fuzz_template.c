/* fuzz_template.c - libFuzzer target for the chat template interpreter: the input is a template;
 * when it compiles it is rendered against a fixed conversation under tight limits. Any crash,
 * sanitizer report or hang is a bug; errors are the expected outcome for most inputs. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "models/template/template.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char k_vars[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"sys\"},"
    " {\"role\": \"user\", \"content\": \"h\\u00e9llo <think>x</think> \\ud83d\\ude00\"},"
    " {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"function\":"
    " {\"name\": \"f\", \"arguments\": {\"a\": [1, 2.5, true]}}}]},"
    " {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"t\"}]}],"
    " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {}}}],"
    " \"enable_thinking\": false}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static kiln_json_doc_t *doc;
  if (!doc && kiln_json_parse(k_vars, sizeof k_vars - 1, "vars", &doc)) abort();
  const kiln_json_t *v = kiln_json_root(doc);
  kiln_template_t *t = NULL;
  kiln_status_t st = kiln_template_compile((const char *)data, size, "fuzz", &t);
  if (st) {
    kiln_status_free(st);
    return 0;
  }
  kiln_template_limits_t lim = {
      .max_output = 1 << 20, .max_memory = 64 << 20, .max_iterations = 100000, .max_depth = 32};
  kiln_template_string_var_t strs[] = {{"bos_token", "<s>"}, {"eos_token", "</s>"}};
  kiln_template_vars_t vars = {.messages = kiln_json_get(v, "messages"),
                               .tools = kiln_json_get(v, "tools"),
                               .add_generation_prompt = true,
                               .strings = strs,
                               .n_strings = 2,
                               .extra = v,
                               .limits = &lim};
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  st = kiln_template_render(t, &vars, &out);
  kiln_status_free(st);
  kiln_strbuf_free(&out);
  kiln_template_free(t);
  return 0;
}
