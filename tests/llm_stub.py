"""A scripted OpenAI-compatible chat server for tests.

It exists because no real LLM is available on this machine: tests use it in place of a remote
chat API. Everything else in those tests is real: the client sends real HTTP over a real socket,
and parses real (scripted) responses.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedChatServer:
    """Serves ``/v1/chat/completions`` on 127.0.0.1, answering each POST with the next reply.

    A reply is a str (a normal completion with that content), ``{"status": code}`` (that HTTP
    error), ``{"raw": text}`` (that body with status 200) or ``{"delay": s, "content": text}``
    (sleep, then complete). When the script runs out, ``default`` is sent, or HTTP 500 if None.
    """

    def __init__(self, replies: list, default: str | None = None):
        self.replies = list(replies)
        self.default = default
        self.requests: list[dict] = []
        self.headers: list[str | None] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        # A short poll interval so shutdown() at the end of each test returns promptly.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def __enter__(self) -> ScriptedChatServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _next_reply(self, body: dict, auth: str | None):
        with self._lock:
            self.requests.append(body)
            self.headers.append(auth)
            if self.replies:
                return self.replies.pop(0)
            return self.default if self.default is not None else {"status": 500}

    def _handler_class(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                reply = stub._next_reply(body, self.headers.get("Authorization"))
                self._answer(reply, body.get("model", "stub"))

            def _answer(self, reply, model):
                if isinstance(reply, dict) and "status" in reply:
                    self._send(reply["status"], {"error": {"message": "scripted error"}})
                elif isinstance(reply, dict) and "raw" in reply:
                    self._send_bytes(200, reply["raw"].encode())
                else:
                    if isinstance(reply, dict):
                        time.sleep(reply.get("delay", 0))
                        reply = reply["content"]
                    self._send(200, _completion(reply, model))

            def _send(self, status, payload):
                self._send_bytes(status, json.dumps(payload).encode())

            def _send_bytes(self, status, data):
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout test); nothing to tell it

            def log_message(self, format, *args):
                pass  # keep test output clean

        return Handler


def _completion(content: str, model: str) -> dict:
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
    }
