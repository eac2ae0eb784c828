#!/usr/bin/env python3
"""fake_hub_server.py - a local stand-in for the Hugging Face Hub's HTTP endpoints, as
huggingface_hub uses them, for testing `kiln download` and Hub ids (Python 3 standard library
only; it listens on 127.0.0.1 only).

Endpoints (the Hub's):
  GET  /api/models/ORG/NAME/revision/REV  {"id", "sha": COMMIT, "siblings": [{"rfilename"}]}
  HEAD|GET /ORG/NAME/resolve/REV/FILE     REV: a branch, tag or commit (URL-encoded). A plain
       file answers 200 with ETag = its git blob SHA-1 and the body; an LFS file (*.safetensors,
       *.gguf) answers 302 to the CDN with X-Linked-Etag = its SHA-256, X-Linked-Size, and an
       ETag of its own (the pointer's). Both send X-Repo-Commit.
  POST /api/models/ORG/NAME/paths-info/REV  {"paths": [...]} -> [{"path", "oid", "size",
       "lfs": {"oid", "size"}, "lastCommit": {"id"}}] (the JavaScript client's file lookup)
  GET  /cdn/SHA256 on a second port (a CDN is another origin: no token may reach it).
Plain files and the CDN answer one range ("Range: bytes=A-" or "bytes=A-B") with 206 and
Content-Range, a range past the end with 416.
Errors carry X-Error-Code as the Hub's do: RepoNotFound (404), RevisionNotFound (404),
EntryNotFound (404), GatedRepo (401 without a token, 403 with a wrong one).

Repositories: --repo ORG/NAME=DIR serves the files of DIR at revision main; --tag
ORG/NAME@REV adds a revision with the same files and its own commit; --gated ORG/NAME needs
"Authorization: Bearer <--token>"; --rename OLD=NEW answers every request for OLD with a
relative 307 to NEW (a renamed repository). Faults, --fault KIND:ORG/NAME/FILE:
  cut      the first GET of the file without a Range stops after half of the bytes (the
           connection closes with the Content-Length unmet); later GETs are whole
  corrupt  the bytes served differ from the SHA-256 in the etag (one byte flipped)
  huge     HEAD says X-Linked-Size is 2^50 bytes

--log FILE appends one JSON line per request: {"server": "hub"|"cdn", "method", "path",
"range", "auth"}. --manifest FILE writes {"ORG/NAME": {"revisions": {REV: COMMIT}, "files":
{NAME: {"size", "sha256", "git_sha1", "lfs"}}}} once the server is up. The hub port is written
to --port-file (the CDN's to --port-file + ".cdn") once both accept connections.
"""
import argparse
import hashlib
import json
import os
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


class Repo:
    def __init__(self, name, folder):
        self.name = name
        self.files = {}  # name -> bytes
        for root, _, names in os.walk(folder):
            for n in sorted(names):
                path = os.path.join(root, n)
                rel = os.path.relpath(path, folder).replace(os.sep, "/")
                with open(path, "rb") as f:
                    self.files[rel] = f.read()
        self.meta = {}
        for rel, data in self.files.items():
            self.meta[rel] = {
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "git_sha1": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
                "lfs": rel.endswith(LFS_SUFFIXES),
            }
        self.revisions = {"main": self.commit_for("main")}
        self.gated = False

    def commit_for(self, rev):
        h = hashlib.sha1(("%s@%s" % (self.name, rev)).encode())
        for rel in sorted(self.meta):
            h.update(("%s %s\n" % (rel, self.meta[rel]["sha256"])).encode())
        return h.hexdigest()

    def commit(self, rev):
        if rev in self.revisions:
            return self.revisions[rev]
        if rev in self.revisions.values():
            return rev
        return None


class State:
    def __init__(self, args):
        self.args = args
        self.repos = {}
        self.renames = dict(r.split("=", 1) for r in args.rename)
        self.faults = {}
        self.cut_done = set()
        self.lock = threading.Lock()
        self.log = open(args.log, "a") if args.log else None
        self.cdn_port = 0
        for spec in args.repo:
            name, folder = spec.split("=", 1)
            self.repos[name] = Repo(name, folder)
        for spec in args.tag:
            name, rev = spec.split("@", 1)
            self.repos[name].revisions[rev] = self.repos[name].commit_for(rev)
        for name in args.gated:
            self.repos[name].gated = True
        for spec in args.fault:
            kind, path = spec.split(":", 1)
            self.faults[path] = kind
        self.blobs = {}  # sha256 -> (repo, file)
        for repo in self.repos.values():
            for rel, m in repo.meta.items():
                self.blobs.setdefault(m["sha256"], (repo, rel))

    def record(self, server, handler):
        if not self.log:
            return
        line = {
            "server": server,
            "method": handler.command,
            "path": handler.path,
            "range": handler.headers.get("Range"),
            "auth": handler.headers.get("Authorization"),
        }
        with self.lock:
            self.log.write(json.dumps(line) + "\n")
            self.log.flush()


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "FakeHub/1.0"
    state = None
    role = "hub"

    def log_message(self, fmt, *args):
        pass

    def send(self, code, body=b"", headers=None, head=False):
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def error(self, code, err, msg, extra=None, head=False):
        h = {"X-Error-Code": err, "X-Error-Message": msg, "Content-Type": "application/json"}
        h.update(extra or {})
        self.send(code, json.dumps({"error": msg}).encode(), h, head)

    def authorized(self, repo):
        if not repo.gated:
            return None
        auth = self.headers.get("Authorization")
        if not auth:
            return 401
        return None if auth == "Bearer " + self.state.args.token else 403

    def do_POST(self):
        # POST /api/models/ORG/NAME/paths-info/REV {"paths": [...]}: what the JavaScript client
        # (@huggingface/hub) asks before it downloads a file
        st = self.state
        st.record(self.role, self)
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n) or b"{}")
        parts = urllib.parse.urlsplit(self.path).path.split("/")
        if len(parts) < 7 or parts[1:3] != ["api", "models"] or parts[5] != "paths-info":
            return self.send(404, b"not a Hub endpoint\n")
        repo = st.repos.get(parts[3] + "/" + parts[4])
        if repo is None:
            return self.error(404, "RepoNotFound", "Repository not found")
        if self.authorized(repo):
            return self.error(self.authorized(repo), "GatedRepo", "restricted")
        commit = repo.commit(urllib.parse.unquote("/".join(parts[6:])))
        if commit is None:
            return self.error(404, "RevisionNotFound", "Invalid rev id")
        out = []
        for p in body.get("paths", []):
            if p in repo.meta:
                m = repo.meta[p]
                item = {"type": "file", "path": p, "oid": m["git_sha1"], "size": m["size"],
                        "lastCommit": {"id": commit, "title": "x", "date": "2025-01-01T00:00:00Z"}}
                if m["lfs"]:
                    item["lfs"] = {"oid": m["sha256"], "size": m["size"], "pointerSize": 134}
                out.append(item)
        self.send(200, json.dumps(out).encode(), {"Content-Type": "application/json"})

    def do_HEAD(self):
        self.handle_any(head=True)

    def do_GET(self):
        self.handle_any(head=False)

    def handle_any(self, head):
        st = self.state
        st.record(self.role, self)
        path = urllib.parse.urlsplit(self.path).path
        if self.role == "cdn":
            return self.serve_cdn(path, head)
        parts = path.split("/")
        # /api/models/ORG/NAME/revision/REV
        if len(parts) >= 7 and parts[1:3] == ["api", "models"] and parts[5] == "revision":
            repo_id = parts[3] + "/" + parts[4]
            if repo_id in st.renames:
                new = path.replace("/" + repo_id + "/", "/" + st.renames[repo_id] + "/", 1)
                return self.send(307, b"", {"Location": new}, head)
            rev = urllib.parse.unquote("/".join(parts[6:]))
            repo = st.repos.get(repo_id)
            if repo is None:
                return self.error(404, "RepoNotFound", "Repository not found", head=head)
            denied = self.authorized(repo)
            if denied:
                return self.error(denied, "GatedRepo", "Access to model %s is restricted" % repo_id,
                                  head=head)
            commit = repo.commit(rev)
            if commit is None:
                return self.error(404, "RevisionNotFound", "Invalid rev id: " + rev, head=head)
            body = json.dumps({"id": repo_id, "sha": commit,
                               "siblings": [{"rfilename": n} for n in sorted(repo.files)]})
            return self.send(200, body.encode(), {"Content-Type": "application/json"}, head)
        # /ORG/NAME/resolve/REV/FILE
        if len(parts) >= 6 and parts[3] == "resolve":
            repo_id = parts[1] + "/" + parts[2]
            if repo_id in st.renames:
                new = path.replace("/" + repo_id + "/", "/" + st.renames[repo_id] + "/", 1)
                return self.send(307, b"", {"Location": new}, head)
            repo = st.repos.get(repo_id)
            if repo is None:
                return self.error(404, "RepoNotFound", "Repository not found", head=head)
            denied = self.authorized(repo)
            if denied:
                return self.error(denied, "GatedRepo", "Access to model %s is restricted" % repo_id,
                                  head=head)
            commit = repo.commit(urllib.parse.unquote(parts[4]))
            if commit is None:
                return self.error(404, "RevisionNotFound", "Invalid rev id", head=head)
            name = urllib.parse.unquote("/".join(parts[5:]))
            if name not in repo.files:
                return self.error(404, "EntryNotFound", "Entry not found",
                                  {"X-Repo-Commit": commit}, head)
            m = repo.meta[name]
            fault = st.faults.get(repo_id + "/" + name)
            if m["lfs"]:
                size = (1 << 50) if fault == "huge" else m["size"]
                loc = "http://127.0.0.1:%d/cdn/%s?repo=%s&file=%s" % (
                    st.cdn_port, m["sha256"], urllib.parse.quote(repo_id, safe=""),
                    urllib.parse.quote(name, safe=""))
                return self.send(302, b"", {
                    "Location": loc, "X-Repo-Commit": commit,
                    "X-Linked-Etag": '"%s"' % m["sha256"], "X-Linked-Size": str(size),
                    "ETag": '"%s"' % hashlib.sha1(name.encode()).hexdigest()}, head)
            return self.send_bytes(repo.files[name], head, {
                "ETag": '"%s"' % m["git_sha1"], "X-Repo-Commit": commit})
        self.send(404, b"not a Hub endpoint\n", {"Content-Type": "text/plain"}, head)

    def serve_cdn(self, path, head):
        st = self.state
        if self.headers.get("Authorization"):
            return self.send(400, b"a CDN URL is signed: no Authorization header\n", None, head)
        sha = path.rsplit("/", 1)[-1]
        if not path.startswith("/cdn/") or sha not in st.blobs:
            return self.send(404, b"no such blob\n", None, head)
        repo, name = st.blobs[sha]
        # the resolve redirect names the repository and file (blobs are shared between repos)
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        if q.get("repo", [""])[0] in st.repos and q.get("file", [""])[0] in st.repos[q["repo"][0]].files:
            repo, name = st.repos[q["repo"][0]], q["file"][0]
        data = repo.files[name]
        key = repo.name + "/" + name
        fault = st.faults.get(key)
        if fault == "corrupt" and data:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        cut = False
        if fault == "cut" and not self.headers.get("Range") and not head:
            with st.lock:
                cut = key not in st.cut_done
                st.cut_done.add(key)
        self.send_bytes(data, head, {"ETag": '"%s"' % sha}, cut)

    def send_bytes(self, data, head, headers, cut=False):
        """data, or the single range "bytes=A-" / "bytes=A-B" asked for (206, or 416 past the
        end); cut: stop after half of the body, the connection closed under its length."""
        rng = self.headers.get("Range")
        start, end = 0, len(data) - 1
        if rng:
            spec = rng[6:] if rng.startswith("bytes=") else ""
            a, _, b = spec.partition("-")
            if not a.isdigit() or (b and not b.isdigit()):
                return self.send(400, b"only bytes=A- and bytes=A-B ranges\n", None, head)
            start = int(a)
            end = min(int(b), len(data) - 1) if b else len(data) - 1
            if start >= len(data) or start > end:
                return self.send(416, b"", {"Content-Range": "bytes */%d" % len(data)}, head)
        body = data[start:end + 1]
        headers = dict(headers, **{"Content-Type": "application/octet-stream",
                                   "Content-Length": str(len(body)), "Accept-Ranges": "bytes"})
        if rng:
            headers["Content-Range"] = "bytes %d-%d/%d" % (start, end, len(data))
        self.send_response(206 if rng else 200)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if head:
            return
        if cut:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--repo", action="append", default=[])
    ap.add_argument("--tag", action="append", default=[])
    ap.add_argument("--gated", action="append", default=[])
    ap.add_argument("--token", default="hf_kilntest")
    ap.add_argument("--rename", action="append", default=[])
    ap.add_argument("--fault", action="append", default=[])
    ap.add_argument("--log")
    ap.add_argument("--manifest")
    args = ap.parse_args()
    state = State(args)
    HubHandler.state = state

    class CdnHandler(HubHandler):
        role = "cdn"

    hub = ThreadingHTTPServer(("127.0.0.1", 0), HubHandler)
    cdn = ThreadingHTTPServer(("127.0.0.1", 0), CdnHandler)
    hub.daemon_threads = cdn.daemon_threads = True
    state.cdn_port = cdn.server_address[1]
    threading.Thread(target=cdn.serve_forever, daemon=True).start()
    if args.manifest:
        out = {n: {"revisions": r.revisions, "files": r.meta} for n, r in state.repos.items()}
        with open(args.manifest + ".tmp", "w") as f:
            json.dump(out, f)
        os.rename(args.manifest + ".tmp", args.manifest)
    with open(args.port_file + ".cdn.tmp", "w") as f:
        f.write(str(state.cdn_port))
    os.rename(args.port_file + ".cdn.tmp", args.port_file + ".cdn")
    with open(args.port_file + ".tmp", "w") as f:
        f.write(str(hub.server_address[1]))
    os.rename(args.port_file + ".tmp", args.port_file)
    try:
        hub.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
