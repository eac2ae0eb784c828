/* log.c - leveled logging to stderr (see log.h). */
#define _POSIX_C_SOURCE 200809L
#include "log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static kiln_log_level_t log_level = KILN_LOG_WARN;
static kiln_log_format_t log_format = KILN_LOG_TEXT;
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static const char *const log_names[] = {"error", "warn", "info", "debug"};

void kiln_log_set_level(kiln_log_level_t level) { log_level = level; }
kiln_log_level_t kiln_log_get_level(void) { return log_level; }
void kiln_log_set_format(kiln_log_format_t format) { log_format = format; }

int kiln_log_level_parse(const char *name) {
  for (int i = 0; i < 4; i++)
    if (strcmp(name, log_names[i]) == 0) return i;
  return -1;
}

/* Writes s as the body of a JSON string (without quotes). */
static void log_json_escape(FILE *f, const char *s) {
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c == '\n') fputs("\\n", f);
    else if (c == '\t') fputs("\\t", f);
    else if (c < 0x20) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
}

void kiln_log(kiln_log_level_t level, const char *fmt, ...) {
  if (level > log_level) return;
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  char when[32];
  strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm);
  pthread_mutex_lock(&log_lock);
  if (log_format == KILN_LOG_JSON) {
    fprintf(stderr, "{\"ts\":\"%s.%03ldZ\",\"level\":\"%s\",\"msg\":\"", when,
            ts.tv_nsec / 1000000, log_names[level]);
    log_json_escape(stderr, msg);
    fputs("\"}\n", stderr);
  } else {
    fprintf(stderr, "%s.%03ldZ %-5s %s\n", when, ts.tv_nsec / 1000000, log_names[level], msg);
  }
  pthread_mutex_unlock(&log_lock);
}

/* Appends a number as a short decimal: integers without a fraction, others with up to 6
 * significant digits (enough for milliseconds and token counts). */
static void log_number(FILE *f, double x) {
  if (x == (double)(long long)x && x > -1e15 && x < 1e15)
    fprintf(f, "%lld", (long long)x);
  else
    fprintf(f, "%.6g", x);
}

void kiln_log_fields(kiln_log_level_t level, const char *msg, const kiln_log_field_t *fields,
                     int num_fields) {
  if (level > log_level) return;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  char when[32];
  strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm);
  pthread_mutex_lock(&log_lock);
  if (log_format == KILN_LOG_JSON) {
    fprintf(stderr, "{\"ts\":\"%s.%03ldZ\",\"level\":\"%s\",\"msg\":\"", when,
            ts.tv_nsec / 1000000, log_names[level]);
    log_json_escape(stderr, msg);
    fputc('"', stderr);
    for (int i = 0; i < num_fields; i++) {
      fputs(",\"", stderr);
      log_json_escape(stderr, fields[i].key);
      fputs("\":", stderr);
      if (fields[i].str) {
        fputc('"', stderr);
        log_json_escape(stderr, fields[i].str);
        fputc('"', stderr);
      } else {
        log_number(stderr, fields[i].num);
      }
    }
    fputs("}\n", stderr);
  } else {
    fprintf(stderr, "%s.%03ldZ %-5s %s", when, ts.tv_nsec / 1000000, log_names[level], msg);
    for (int i = 0; i < num_fields; i++) {
      fprintf(stderr, " %s=", fields[i].key);
      if (!fields[i].str) {
        log_number(stderr, fields[i].num);
      } else if (!fields[i].str[0] || strpbrk(fields[i].str, " \"=\n\t")) {
        fputc('"', stderr);
        log_json_escape(stderr, fields[i].str);
        fputc('"', stderr);
      } else {
        fputs(fields[i].str, stderr);
      }
    }
    fputc('\n', stderr);
  }
  pthread_mutex_unlock(&log_lock);
}
