#!/usr/bin/env python3
"""fake_openai_server.py - a small OpenAI-compatible streaming server for testing `kiln bench
serve` without a model (Python 3 standard library only).

GET /v1/models lists one model. POST /v1/completions and /v1/chat/completions stream, as vLLM
does, max_tokens content chunks (" tok0", " tok1", ...): the first after --ttft seconds, the
others --itl seconds apart; then a usage chunk (when stream_options.include_usage) and
`data: [DONE]`, in chunked transfer encoding over keep-alive connections. prompt_tokens counts
the prompt's token ids, or its whitespace-separated words (for chat, those of every message).
GET /stats answers {"requests": N, "max_in_flight": M}.

Faults: with --fault KIND --fault-every K, every K-th request (1-based, in arrival order) fails
in one way:
  500       HTTP 500 with an OpenAI-style JSON error
  400text   HTTP 400 with a plain-text body
  garbage   a good chunk, then a data line that is not JSON
  error     a good chunk, then an error event (vLLM's way of failing mid-stream), then [DONE]
  close     two chunks, then the connection is dropped mid-stream
  nodone    the stream ends cleanly but without data: [DONE]
  raw       bytes that are not HTTP, then the connection is closed
  hang      nothing for 5 s
--odd-sse writes legal but unusual SSE (CRLF line ends, comments, event: fields, "data:" with no
space, each event split across two writes). --require-key KEY answers 401 to requests without
"Authorization: Bearer KEY". --log FILE appends one JSON line per POST: {"path",
"authorization", "body"}.

Usage: fake_openai_server.py [--port 0] [--port-file FILE] [options]; the port it listens on
(a free one for --port 0) is written to --port-file once it accepts connections.
"""
import argparse
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class State:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.log = open(args.log, "a") if args.log else None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "FakeOpenAI/1.0"

    def setup(self):
        super().setup()
        # Each chunk goes out at once: without this, Nagle's algorithm may hold a small chunk
        # until the previous one is acknowledged, which would distort the measured gaps.
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt, *args):  # quiet
        pass

    @property
    def state(self):
        return self.server.state

    def send_json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [
                {"id": self.state.args.model, "object": "model", "owned_by": "fake"}]})
        elif self.path == "/stats":
            with self.state.lock:
                self.send_json(200, {"requests": self.state.requests,
                                     "max_in_flight": self.state.max_in_flight})
        else:
            self.send_json(404, {"error": {"message": "no such path", "code": 404}})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self.send_json(404, {"error": {"message": "no such path", "code": 404}})
            return
        st = self.state
        with st.lock:
            st.requests += 1
            seq = st.requests
            st.in_flight += 1
            st.max_in_flight = max(st.max_in_flight, st.in_flight)
        try:
            self.serve_post(raw, seq)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            with st.lock:
                st.in_flight -= 1

    def serve_post(self, raw, seq):
        st = self.state
        args = st.args
        auth = self.headers.get("Authorization")
        try:
            body = json.loads(raw)
        except ValueError as e:
            self.send_json(400, {"error": {"message": "bad JSON: %s" % e, "code": 400}})
            return
        if st.log:
            with st.lock:
                st.log.write(json.dumps({"path": self.path, "authorization": auth,
                                         "body": body}) + "\n")
                st.log.flush()
        if args.require_key and auth != "Bearer " + args.require_key:
            self.send_json(401, {"error": {"message": "invalid API key", "code": 401}})
            return
        if not body.get("stream"):
            self.send_json(400, {"error": {"message": "only streaming is faked", "code": 400}})
            return
        fault = args.fault if args.fault_every and seq % args.fault_every == 0 else None
        if fault == "500":
            self.send_json(500, {"error": {"message": "injected failure %d" % seq,
                                           "type": "InternalServerError", "code": 500}})
            return
        if fault == "400text":
            text = b"bad request: injected\n"
            self.send_response(400)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)
            return
        if fault == "raw":
            self.wfile.write(b"this is not HTTP at all\r\n\r\n")
            self.close_connection = True
            return
        if fault == "hang":
            time.sleep(5)
            self.close_connection = True
            return

        chat = self.path.endswith("/chat/completions")
        n = int(body.get("max_tokens") or 16)
        prompt = body.get("prompt")
        if chat:
            ptoks = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
        elif isinstance(prompt, list):
            ptoks = len(prompt)
        else:
            ptoks = len(str(prompt).split())
        usage = (body.get("stream_options") or {}).get("include_usage")
        rid = "fake-%d" % seq
        created = int(time.time())

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def write_chunk(payload):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))

        def send(data):
            if not args.odd_sse:
                write_chunk(("data: %s\n\n" % data).encode())
                return
            # Legal but unusual SSE: CRLF line ends, comments, an event field, no space after
            # "data:", and each event split in the middle across two writes.
            payload = (": keep-alive\r\nevent: message\r\ndata:%s\r\n\r\n" % data).encode()
            half = len(payload) // 2
            write_chunk(payload[:half])
            time.sleep(0.001)
            write_chunk(payload[half:])

        def chunk(i, text, finish=None):
            if chat:
                delta = {"content": text} if i >= 0 else {"role": "assistant", "content": ""}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                return {"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": body.get("model"), "choices": [choice]}
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": body.get("model"), "choices": [choice]}

        if chat:  # vLLM's first chat chunk: the role, no content
            send(json.dumps(chunk(-1, "")))
        time.sleep(args.ttft)
        for i in range(n):
            if i:
                time.sleep(args.itl)
            send(json.dumps(chunk(i, " tok%d" % i, "length" if i == n - 1 else None)))
            if i == 0 and fault == "garbage":
                send("{this is not json")
            if i == 0 and fault == "error":
                send(json.dumps({"error": {"message": "injected stream error", "code": 500}}))
                send("[DONE]")
                self.wfile.write(b"0\r\n\r\n")
                return
            if i == 1 and fault == "close":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
        if usage:
            send(json.dumps({"id": rid, "object": "chunk", "created": created,
                             "model": body.get("model"), "choices": [],
                             "usage": {"prompt_tokens": ptoks, "completion_tokens": n,
                                       "total_tokens": ptoks + n}}))
        if fault != "nodone":
            send("[DONE]")
        self.wfile.write(b"0\r\n\r\n")


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # many clients connect at once


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file")
    p.add_argument("--model", default="fake-model")
    p.add_argument("--ttft", type=float, default=0.05, help="seconds before the first chunk")
    p.add_argument("--itl", type=float, default=0.01, help="seconds between chunks")
    p.add_argument("--fault", choices=["500", "400text", "garbage", "error", "close", "nodone",
                                       "raw", "hang"])
    p.add_argument("--fault-every", type=int, default=0)
    p.add_argument("--odd-sse", action="store_true",
                   help="CRLF, comments, event fields, events split across writes")
    p.add_argument("--require-key")
    p.add_argument("--log")
    args = p.parse_args()
    srv = Server(("127.0.0.1", args.port), Handler)
    srv.state = State(args)
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            f.write("%d\n" % srv.server_address[1])
        os.replace(args.port_file + ".tmp", args.port_file)
    try:
        srv.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
