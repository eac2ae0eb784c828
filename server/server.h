/* server.h - the OpenAI-compatible HTTP server over an engine (libmicrohttpd).
 *
 * Routes: POST /v1/completions, POST /v1/chat/completions (JSON or Server-Sent Events with
 * stream: true), GET /v1/models, GET /health, GET /version, GET /metrics (Prometheus text),
 * POST /tokenize, POST /detokenize; and the chat page's files (web_assets.h: GET / and its
 * assets, no API key needed).
 *
 * Life cycle:
 *
 *   kiln_server_start ──> listening: /health says 503 "loading", API routes 503
 *        │ kiln_server_attach(engine)
 *        v
 *     ready: requests run ──> kiln_server_shutdown: no new connections; API requests 503;
 *                             in-flight requests get shutdown_timeout to finish, then are
 *                             cancelled (their responses end with finish_reason "abort");
 *                             the daemon stops ──> kiln_server_free
 *
 * Threads: one thread per connection (libmicrohttpd's thread-per-connection mode). A request's
 * thread submits to the engine and waits for its events (the engine wakes it through the
 * request's on_queued hook), watching the socket meanwhile: a client that goes away has its
 * requests cancelled at once, so their KV blocks are freed. Every accepted request gets exactly
 * one response: its result, or an error in OpenAI's format.
 *
 * Authentication: with an API key, every /v1 route and /tokenize, /detokenize need
 * "Authorization: Bearer <key>" (compared in constant time); /health, /version and /metrics stay
 * open, as in vLLM.
 */
#ifndef KILN_SERVER_SERVER_H
#define KILN_SERVER_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "kiln/kiln.h"

typedef struct kiln_server kiln_server_t;

typedef struct kiln_server_options {
  const char *host;        /* address or host name to bind (127.0.0.1) */
  int port;                /* 0 = any free port (kiln_server_port says which) */
  const char *api_key;     /* NULL or "" = no authentication */
  size_t max_body_bytes;   /* larger request bodies get 413 */
  double request_timeout;  /* seconds; 0 = none. A request past it is cancelled: 504 */
  double shutdown_timeout; /* seconds in-flight requests get at shutdown */
  const char *model_name;  /* the served name (the "model" field) */
  const char *version;     /* for /version */
  int max_connections;     /* concurrent connections (threads); 0 = 1024 */
  size_t max_image_bytes;  /* an image's bytes at most (data URL or fetched); 0 = 20 MiB */
  bool allow_remote_images;   /* fetch http(s):// image URLs (libcurl) */
  double image_fetch_timeout; /* seconds per fetch; 0 = 10 */
  const char *tool_parser;    /* tool-call format of replies: "auto" (from the chat template; also
                                 NULL), "hermes", "llama3_json", "mistral" or "none" */
} kiln_server_options_t;

/* Binds and starts serving (/health answers 503 until kiln_server_attach). Errors name the
 * address and the system's reason (KILN_ERR_IO), or KILN_ERR_OUT_OF_MEMORY. */
kiln_status_t kiln_server_start(const kiln_server_options_t *opt, kiln_server_t **out_server);

/* The port the server listens on. */
int kiln_server_port(const kiln_server_t *s);

/* Starts answering API requests with eng (borrowed; it must outlive the server's requests:
 * call kiln_server_shutdown before destroying it). */
void kiln_server_attach(kiln_server_t *s, kiln_engine_t *eng);

/* Drains and stops, as the life cycle above says. Blocks up to about shutdown_timeout + 5 s.
 * Idempotent. */
void kiln_server_shutdown(kiln_server_t *s);

/* Shuts down if needed, then frees. NULL is a no-op. */
void kiln_server_free(kiln_server_t *s);

/* Counters since start (for tests and logs). */
typedef struct kiln_server_stats {
  uint64_t requests; /* HTTP requests answered */
  uint64_t errors_4xx, errors_5xx;
  uint64_t disconnects; /* API requests whose client went away before the end */
  int64_t in_flight;    /* API requests running now */
} kiln_server_stats_t;
void kiln_server_get_stats(kiln_server_t *s, kiln_server_stats_t *out);

#endif /* KILN_SERVER_SERVER_H */
