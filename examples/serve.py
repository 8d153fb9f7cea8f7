"""A stand-in inference server with an OpenAI-compatible `/v1/completions` (standard library only).

    python examples/serve.py [--port 8000] [--token-ms 20] [--batch-cost 0.05] [--max-batch 16]

It answers as vLLM and TGI do: `POST /v1/completions` {prompt, max_tokens, stream}; with
`stream: true` the tokens come as server-sent events (`data: {...}`, then `data: [DONE]`).
Concurrent requests are decoded together, one token each per step, as continuous batching
does: a step takes `token_ms * (1 + batch_cost * (batch - 1))`, and at most `max_batch`
sequences share a step (the rest wait their turn). So a replica has a real capacity curve:
more concurrent requests, more tokens a second, each a little slower, until the batch is full
and requests queue. The tokens are words drawn from the prompt (no model).

`GET /healthz` answers 200 once it is ready (after `--startup-s`, a model's load time), 503
before; `GET /v1/models` names its model; `GET /metrics` is Prometheus text (requests, tokens,
sequences running and waiting). Each answer's `usage` has `batch_max`: the largest step it was
decoded in. On a GPU host the same API can front a real model; this one needs none.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import socketserver
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WORDS = "the a of GPU rack node token batch model serve fast slow cloud train infer".split()
MAX_TOKENS = 4096


@dataclass
class Sequence:
    prompt: str
    max_tokens: int
    out: queue.Queue = field(default_factory=queue.Queue)  # tokens, then None
    made: int = 0
    batch_max: int = 0


class Engine:
    """The decode loop: every step, one token to each of up to `max_batch` sequences."""

    def __init__(self, token_ms: float, batch_cost: float, max_batch: int):
        self.token_s, self.batch_cost, self.max_batch = token_ms / 1000, batch_cost, max_batch
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.cv = threading.Condition()
        self.requests = self.tokens = 0
        threading.Thread(target=self._loop, daemon=True).start()

    def submit(self, seq: Sequence) -> None:
        with self.cv:
            self.requests += 1
            self.waiting.append(seq)
            self.cv.notify()

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.waiting and not self.running:
                    self.cv.wait()
                room = self.max_batch - len(self.running)
                self.running += self.waiting[:room]
                del self.waiting[:room]
                batch = list(self.running)
            time.sleep(self.token_s * (1 + self.batch_cost * (len(batch) - 1)))
            done = []
            for seq in batch:
                seq.batch_max = max(seq.batch_max, len(batch))
                seq.out.put(_word(seq.prompt, seq.made))
                seq.made += 1
                if seq.made >= seq.max_tokens:
                    seq.out.put(None)
                    done.append(seq)
            with self.cv:
                self.tokens += len(batch)
                self.running = [s for s in self.running if s not in done]

    def metrics(self) -> str:
        with self.cv:
            rows = {
                "serve_requests_total": self.requests,
                "serve_tokens_total": self.tokens,
                "serve_sequences_running": len(self.running),
                "serve_sequences_waiting": len(self.waiting),
            }
        return "".join(f"{k} {v}\n" for k, v in rows.items())


def _word(prompt: str, i: int) -> str:
    h = hashlib.blake2b(f"{prompt}:{i}".encode(), digest_size=2).digest()
    return " " + WORDS[int.from_bytes(h, "big") % len(WORDS)]


def handler(engine: Engine, model: str, ready_at: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args) -> None:  # quiet: one line per request is noise
            pass

        def _json(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
            self._json(status, {"error": {"message": message, "type": kind, "code": None}})

        def do_GET(self) -> None:
            if self.path == "/healthz":
                if time.monotonic() < ready_at:
                    self._json(503, {"status": "loading"})
                else:
                    self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
            elif self.path == "/metrics":
                data = engine.metrics().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._error(404, f"no route {self.path}")
                return
            if time.monotonic() < ready_at:
                self._error(503, "the model is loading", "server_error")
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                prompt = body.get("prompt", "")
                if isinstance(prompt, list):
                    prompt = " ".join(str(p) for p in prompt)
                max_tokens = int(body.get("max_tokens", 16))
                stream = bool(body.get("stream", False))
            except (ValueError, TypeError, AttributeError) as exc:
                self._error(400, f"not a completion request: {exc}")
                return
            if not isinstance(prompt, str) or not 1 <= max_tokens <= MAX_TOKENS:
                self._error(400, f"prompt must be text and max_tokens 1 to {MAX_TOKENS}")
                return
            seq = Sequence(prompt, max_tokens)
            engine.submit(seq)
            rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
            if stream:
                self._stream(seq, rid, created)
                return
            text = "".join(iter(seq.out.get, None))
            self._json(
                200,
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                    "usage": _usage(prompt, seq),
                },
            )

        def _stream(self, seq: Sequence, rid: str, created: int) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def send(data: str) -> None:
                event = f"data: {data}\n\n".encode()
                self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                self.wfile.flush()

            try:
                for token in iter(seq.out.get, None):
                    chunk = {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [{"index": 0, "text": token, "finish_reason": None}],
                    }
                    send(json.dumps(chunk))
                last = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                    "usage": _usage(seq.prompt, seq),
                }
                send(json.dumps(last))
                send("[DONE]")
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the caller went away; its sequence runs out on its own

    return Handler


def _usage(prompt: str, seq: Sequence) -> dict:
    words = len(prompt.split())
    return {
        "prompt_tokens": words,
        "completion_tokens": seq.made,
        "total_tokens": words + seq.made,
        "batch_max": seq.batch_max,
    }


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self) -> None:
        # As HTTPServer's, without its reverse lookup of the address (slow with no resolver).
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("PORT", "8000")),
        help="default: $PORT (what a Rackplane endpoint's replica is given), else 8000",
    )
    p.add_argument("--model", default="rackplane-stand-in")
    p.add_argument("--token-ms", type=float, default=20.0, help="a decode step, batch of one")
    p.add_argument("--batch-cost", type=float, default=0.05, help="extra per sequence in a step")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--startup-s", type=float, default=0.0, help="load time before it is ready")
    args = p.parse_args(argv)
    engine = Engine(args.token_ms, args.batch_cost, args.max_batch)
    ready_at = time.monotonic() + args.startup_s
    server = Server((args.host, args.port), handler(engine, args.model, ready_at))
    print(f"serving {args.model} on {args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
