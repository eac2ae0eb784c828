/* config.h - Kiln's configuration: one static table of INI keys drives parsing, validation,
 * defaults, --help-config and --set overrides.
 *
 * A kiln_config_t holds one value for every key in the table (see config.c, config_rows[]),
 * starting from the defaults, plus free-form keys of [plugin.<name>] sections. Values come
 * from, in the order the caller applies them (a later one wins):
 *
 *     kiln_config_create()          every key at its default, origin "default"
 *     kiln_config_load_file()       an INI file, origin "<file>:<line>"
 *     kiln_config_set()             a --set section.key=value override, origin "--set"
 *
 * The file format is inih's: [section] headers, `key = value` lines (':' also separates),
 * comment lines starting with ';' or '#', inline comments after " ;". Sections are model,
 * engine, cache, scheduler, backend, server, graph, log and plugin.<name>; any other section,
 * any unknown key, any bad value, a key given twice in one file, an indented continuation line
 * and a line longer than KILN_CONFIG_MAX_LINE characters are errors. Values are parsed once, when
 * set; the getters return the stored result.
 *
 * Types: string; int (int64, decimal, within [min, max]); float (double, finite, within
 * [min, max]); bool (true/false, yes/no, on/off, 1/0, any case); enum (one of a fixed list of
 * words, any case); int list (comma-separated ints, each within [min, max], spaces allowed,
 * at least one). Plugin sections take any key made of letters, digits, '_' and '-', with any
 * value; they are stored raw and validated by the plugin that reads them.
 *
 * Errors: every function that can fail returns a kiln_status_t (NULL = OK; see status.h) whose
 * message starts with where the value came from: "<file>:<line>: " for file and string input,
 * "--set <section>.<key>: " for overrides. Bad input is KILN_ERR_INVALID_ARGUMENT unless noted.
 * Every function that changes a config is transactional: on error the config is exactly as it
 * was before the call.
 *
 * Ownership: kiln_config_create() returns a config owned by the caller, freed with
 * kiln_config_free(). Strings and arrays returned by getters are borrowed from the config: they
 * stay valid until the same key is set again or the config is freed. The config copies every
 * string passed in.
 *
 * Programmer errors (a NULL config, a typed getter called with a key that is not in the table or
 * with the wrong type) abort the process with a message, in release builds too.
 *
 * Thread-safety: a config is not thread-safe for writes (load, set, free). Once loading is done,
 * any number of threads may call the getters, kiln_config_origin() and kiln_config_write()
 * concurrently. kiln_config_print_help() only reads the static table and is always safe.
 */
#ifndef KILN_CORE_CONFIG_H
#define KILN_CORE_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "status.h"

/* The longest line a config file may hold, in characters without the line break. inih reads
 * lines into a buffer of INI_MAX_LINE (200) bytes; longer lines are rejected rather than split.
 * kiln_config_set_value() applies the same limit to `key = value` so that kiln_config_write()
 * always produces a file that loads again. */
#define KILN_CONFIG_MAX_LINE 197

/* The longest section name inih keeps (its MAX_SECTION is 50 bytes, and it truncates longer
 * names silently); so plugin names are at most 41 characters. */
#define KILN_CONFIG_MAX_SECTION 48

typedef struct kiln_config kiln_config_t;

/* Creates a config with every key at its default (origin "default") and no plugin keys.
 * *out_cfg is set to NULL on entry and to the new config on success; the caller owns it.
 * Errors: KILN_ERR_OUT_OF_MEMORY; KILN_ERR_INTERNAL if a default in the table does not pass
 * its own validation (a bug in config.c). */
kiln_status_t kiln_config_create(kiln_config_t **out_cfg);

/* Frees a config and every string it holds. NULL is a no-op. */
void kiln_config_free(kiln_config_t *cfg);

/* Loads an INI file on top of the current values: keys in the file replace their current value
 * (origin "<path>:<line>"); keys not in the file are left alone.
 * Errors: KILN_ERR_NOT_FOUND if the file does not exist, KILN_ERR_IO if it cannot be opened or
 * read (the message holds strerror()), KILN_ERR_INVALID_ARGUMENT for anything wrong inside it
 * (first error only, "<path>:<line>: ..."), KILN_ERR_OUT_OF_MEMORY. Transactional. */
kiln_status_t kiln_config_load_file(kiln_config_t *cfg, const char *path);

/* Same as kiln_config_load_file() for INI text in memory. name stands for the file name in
 * origins and messages ("<name>:<line>"); NULL means "<string>". text is only read during the
 * call. Errors: as kiln_config_load_file(), without NOT_FOUND and IO. Transactional. */
kiln_status_t kiln_config_load_string(kiln_config_t *cfg, const char *text, const char *name);

/* Applies one command-line override "section.key=value" with origin "--set". The section/key
 * part is split at its last '.', so "plugin.trace.level=2" sets key "level" of
 * [plugin.trace]. Whitespace around the key and the value is ignored; the value may be empty.
 * Errors: KILN_ERR_INVALID_ARGUMENT for a missing '=', a missing section, an empty key, and
 * everything kiln_config_set_value() rejects; KILN_ERR_OUT_OF_MEMORY. Transactional. */
kiln_status_t kiln_config_set(kiln_config_t *cfg, const char *assignment);

/* Validates value for section.key and stores it with the given origin (copied; e.g.
 * "kiln.ini:12" or "--set"; NULL means "api"). Messages start with "<origin>: " or, when
 * origin is "--set", with "--set section.key: ".
 * Errors: KILN_ERR_INVALID_ARGUMENT for an unknown section or key, a value that does not parse
 * or is out of range, a value that could not be written back to an INI file (a line break, a
 * ';' after whitespace, whitespace at either end, a line over KILN_CONFIG_MAX_LINE), a bad plugin
 * section or key name; KILN_ERR_OUT_OF_MEMORY. Transactional. */
kiln_status_t kiln_config_set_value(kiln_config_t *cfg, const char *section, const char *key,
                                    const char *value, const char *origin);

/* Typed getters for keys in the table. Each aborts if section.key is not in the table or has
 * another type (a programmer bug, not bad input).
 *   get_string: STRING keys, and ENUM keys (the allowed spelling, e.g. "bfloat16" for
 *               "BFloat16"). Borrowed; never NULL.
 *   get_int:    INT keys, and ENUM keys whose allowed values are all integers
 *               (cache.block_size).
 *   get_float:  FLOAT keys.
 *   get_bool:   BOOL keys.
 *   get_int_list: INT_LIST keys; returns the number of elements (>= 1) and sets *out_values to
 *               a borrowed array of them. */
const char *kiln_config_get_string(const kiln_config_t *cfg, const char *section, const char *key);
int64_t kiln_config_get_int(const kiln_config_t *cfg, const char *section, const char *key);
double kiln_config_get_float(const kiln_config_t *cfg, const char *section, const char *key);
bool kiln_config_get_bool(const kiln_config_t *cfg, const char *section, const char *key);
size_t kiln_config_get_int_list(const kiln_config_t *cfg, const char *section, const char *key,
                                const int64_t **out_values);

/* The value of any key as it was given (for table keys: never NULL, the default's text if the
 * key was never set; for plugin keys: NULL if unset). NULL for an unknown section or key; never
 * aborts. Borrowed. This is how plugins read their [plugin.<name>] keys. */
const char *kiln_config_get_raw(const kiln_config_t *cfg, const char *section, const char *key);

/* The index-th key (from 0, in the order the keys were first set) of a [plugin.<name>] section,
 * or NULL past the last (and for table sections, whose keys are all in the table). With
 * kiln_config_get_raw() this lists what a plugin's section holds, so that the plugin can reject
 * keys it does not know. Borrowed: valid until the config is freed (keys are never removed). */
const char *kiln_config_section_key(const kiln_config_t *cfg, const char *section, size_t index);

/* Where the current value of a key came from: "default", "<file>:<line>", "--set", or the origin
 * passed to kiln_config_set_value(). NULL for an unknown or unset key. Borrowed. */
const char *kiln_config_origin(const kiln_config_t *cfg, const char *section, const char *key);

/* Prints the whole table for --help-config: for each section its keys with type, default,
 * allowed range or values, and a line of help; then a note on [plugin.<name>] sections. */
void kiln_config_print_help(FILE *f);

/* The table's row `index` (0 .. count-1, in --help-config's order): its section, key, type word
 * ("string", "int", "float", "bool", "enum", "int list"), default value and help line, all
 * static strings (any out pointer may be NULL). False once index is past the last row. Always
 * thread-safe (it reads only the static table). */
bool kiln_config_row_info(size_t index, const char **section, const char **key, const char **type,
                          const char **def, const char **help);

/* A path-valued key: a relative value set in a config file is taken relative to that file's
 * folder (so etc/kiln.ini can name ../share/...), one set by --set or the API relative to the
 * current directory. buf = "" when the key is empty. Errors: the path does not fit buf. */
kiln_status_t kiln_config_get_path(const kiln_config_t *cfg, const char *section, const char *key,
                                   char *buf, size_t size);
/* [model] path, resolved as above; when empty, the embedded default model: the first of
 * $KILN_DEFAULT_MODEL or the built-in list (the source tree's share/models/kiln-tiny, then
 * the installed one) that holds a config.json. Errors: KILN_ERR_NOT_FOUND naming where it
 * looked. */
kiln_status_t kiln_config_model_path(const kiln_config_t *cfg, char *buf, size_t size);

/* Writes the effective config as an INI file that kiln_config_load_*() read back into the same
 * values: every table key in table order (a comment names the origin of values that are not
 * defaults), then the plugin sections in the order they were first set. Write errors are left
 * for the caller to see with ferror(f). */
void kiln_config_write(const kiln_config_t *cfg, FILE *f);

#endif /* KILN_CORE_CONFIG_H */
