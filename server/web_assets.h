/* web_assets.h - the chat page's files (server/web/), embedded in the binary at build time by
 * cmake/KilnEmbed.cmake into web_assets.c in the build tree. server.c serves them at their URL
 * paths ("/" is index.html) on GET and HEAD, with no API key (the page asks for one when the
 * API needs it). */
#ifndef KILN_SERVER_WEB_ASSETS_H
#define KILN_SERVER_WEB_ASSETS_H

#include <stddef.h>

typedef struct kiln_web_asset {
  const char *path;         /* the URL path: "/", "/chat.js", ... */
  const char *content_type; /* "text/html; charset=utf-8", ... */
  const unsigned char *data;
  size_t size;
} kiln_web_asset_t;

extern const kiln_web_asset_t kiln_web_assets[];
extern const size_t kiln_web_num_assets;

#endif /* KILN_SERVER_WEB_ASSETS_H */
