/* log.h - leveled logging to stderr, as text or one JSON object per line.
 *
 * Thread-safe: each call writes one whole line with a single fprintf under a lock.
 * The level and format are process-wide and set once at start-up from [log].
 */
#ifndef KILN_CORE_LOG_H
#define KILN_CORE_LOG_H

typedef enum kiln_log_level {
  KILN_LOG_ERROR = 0,
  KILN_LOG_WARN = 1,
  KILN_LOG_INFO = 2,
  KILN_LOG_DEBUG = 3,
} kiln_log_level_t;

typedef enum kiln_log_format {
  KILN_LOG_TEXT = 0,
  KILN_LOG_JSON = 1,
} kiln_log_format_t;

void kiln_log_set_level(kiln_log_level_t level);
kiln_log_level_t kiln_log_get_level(void);
void kiln_log_set_format(kiln_log_format_t format);
/* Parses "error|warn|info|debug"; returns -1 for anything else. */
int kiln_log_level_parse(const char *name);

/* Writes one line if level <= the current level. */
void kiln_log(kiln_log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* One field of a structured line: a string (quoted in JSON) or a number (written as is). */
typedef struct kiln_log_field {
  const char *key;
  const char *str; /* used when not NULL */
  double num;
} kiln_log_field_t;

/* Writes one structured line if level <= the current level: in text, "msg key=value ..."
 * (values with spaces or quotes are quoted); in JSON, {"ts", "level", "msg", key: value...}. */
void kiln_log_fields(kiln_log_level_t level, const char *msg, const kiln_log_field_t *fields,
                     int num_fields);

#define KILN_LOG_E(...) kiln_log(KILN_LOG_ERROR, __VA_ARGS__)
#define KILN_LOG_W(...) kiln_log(KILN_LOG_WARN, __VA_ARGS__)
#define KILN_LOG_I(...) kiln_log(KILN_LOG_INFO, __VA_ARGS__)
#define KILN_LOG_D(...) kiln_log(KILN_LOG_DEBUG, __VA_ARGS__)

#endif /* KILN_CORE_LOG_H */
