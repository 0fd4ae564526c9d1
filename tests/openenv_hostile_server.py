"""A server that speaks OpenEnv's wire (a WebSocket at ``/ws``, ``GET /schema``) but answers
whatever it is told to, for tests/test_openenv_hostile.py: ``python
tests/openenv_hostile_server.py PORT`` serves at http://127.0.0.1:PORT.

A test sends a *script* as one JSON message on a WebSocket at ``/control`` (answered ``ok``
once it is in place)::

    {"replies": [REPLY, ...], "schema": {"status": 200, "body": "..."}}

Each message a client sends on ``/ws`` takes the next REPLY, across connections, in order:
``{"text": "..."}`` is sent as a text frame, ``{"bytes": "<hex>"}`` as a binary frame,
``{"hang_up": true}`` closes the connection unanswered; with no replies left the connection is
closed too. A client's ``{"type": "close"}`` takes none: the server closes the session, as an
OpenEnv server does. ``GET /schema`` answers the script's status and body; ``GET /health``
answers 200.
"""

from __future__ import annotations

import http
import json
import sys
import threading

from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Response
from websockets.sync.server import serve

LOCK = threading.Lock()
SCRIPT: dict = {"replies": [], "schema": {"status": 404, "body": ""}}


def next_reply() -> dict | None:
    with LOCK:
        return SCRIPT["replies"].pop(0) if SCRIPT["replies"] else None


def respond(status: int, body: str) -> Response:
    data = body.encode("utf-8", "replace")
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "Whatever"
    return Response(status, phrase, Headers([("Content-Type", "application/json"),
                                             ("Content-Length", str(len(data)))]), data)


def process_request(connection, request):
    path = request.path.split("?")[0]
    if path in ("/ws", "/control"):
        return None  # the WebSocket handshake
    if path == "/health":
        return respond(200, '{"status": "healthy"}')
    if path == "/schema":
        with LOCK:
            schema = dict(SCRIPT["schema"])
        return respond(int(schema.get("status", 200)), str(schema.get("body", "")))
    return respond(404, "{}")


def handler(ws) -> None:
    try:
        if ws.request.path == "/control":
            for message in ws:
                script = json.loads(message)
                with LOCK:
                    SCRIPT.update(replies=list(script.get("replies", [])),
                                  schema=script.get("schema", {"status": 404, "body": ""}))
                ws.send("ok")
            return
        for message in ws:
            try:
                said = json.loads(message)
            except ValueError:
                said = None
            if isinstance(said, dict) and said.get("type") == "close":
                return  # the server ends the session it was asked to end
            reply = next_reply()
            if reply is None or reply.get("hang_up"):
                return
            if "bytes" in reply:
                ws.send(bytes.fromhex(reply["bytes"]))
            else:
                ws.send(str(reply.get("text", "")))
    except ConnectionClosed:
        pass


if __name__ == "__main__":
    with serve(handler, "127.0.0.1", int(sys.argv[1]), process_request=process_request,
               max_size=None, compression=None) as server:
        server.serve_forever()
