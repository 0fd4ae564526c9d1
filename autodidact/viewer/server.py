"""The viewer's HTTP server: Starlette routes over :mod:`autodidact.viewer.data`, run by uvicorn.

Read-only: every route is a GET, and the page (``static/``, with its charting library vendored)
is served from the package, never from the internet. A request the viewer cannot answer gets
``{"error": one line}`` with a 4xx status; anything unexpected is logged, counted
(``/api/runs`` reports ``errors``) and answered 500 with one line, and the server keeps serving.

The door (docs/viewer.md): on the loopback the viewer answers anyone who can reach it, as the
machine's own users can; any other address is refused unless ``allow_remote``, and then every
request (page, asset, API) must carry the token printed once at start (:class:`TokenDoor`).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import secrets
import threading
import time
import urllib.parse
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from autodidact.viewer.data import RunView, Scrubber, page_params
from autodidact.viewer.groups import Filters, ViewError
from protocol.security import is_loopback_host

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
DEFAULT_PORT = 8765
INDEX_EVERY_S = 2.0  # how often new groups are summarized in the background
INDEX_SLICE_S = 0.2  # one slice of unpacking: requests wait at most this for the index
REQUEST_INDEX_S = 0.3  # a groups request summarizes what is new for at most this long
FRESH_S = 1.0  # ... unless the index was brought up to date this recently
TOKEN_COOKIE = "autodidact_view_token"


class Viewer:
    """The served runs, and what the server counts about itself."""

    def __init__(self, runs: list[RunView]):
        self.runs = runs
        self.errors = 0
        self.refused = 0  # requests the token door turned away
        self._stop = threading.Event()
        self._indexer = threading.Thread(target=self._index, name="viewer-index", daemon=True)

    def start(self) -> None:
        self._indexer.start()

    def stop(self) -> None:
        self._stop.set()

    def scrubber(self) -> Scrubber:
        """Masks every served run's secrets (a reply about one run can quote another's)."""
        return Scrubber.of(tuple(s for view in self.runs for s in view.secrets()))

    def run(self, request: Request, param: str = "run") -> RunView:
        raw = request.query_params.get(param, "0")
        try:
            return self.runs[int(raw)]
        except (ValueError, IndexError):
            raise ViewError(f"{param}={raw!r}: this viewer serves runs 0 to "
                            f"{len(self.runs) - 1} (/api/runs lists them)", 404) from None

    def _index(self) -> None:
        # Summarize new groups in slices so a request never waits long behind the indexer.
        self._warm()
        while not self._stop.is_set():
            for view in self.runs:
                try:
                    while not view.groups.refresh(budget_s=INDEX_SLICE_S):
                        if self._stop.is_set():
                            return
                except ViewError:
                    pass  # no store yet: the next pass looks again
                except Exception:
                    log.exception("indexing %s", view.path)
            self._stop.wait(INDEX_EVERY_S)


    def _warm(self) -> None:
        """Load what the token view needs (a tokenizer, the learner's token log) ahead of the
        first request for it: importing transformers takes seconds."""
        for view in self.runs:
            try:
                view.warm()
            except Exception:  # the token view says what is missing when it is asked
                log.exception("warming %s", view.path)


class TokenDoor:
    """ASGI middleware in front of the whole viewer: a request passes only with ``token`` as
    the ``autodidact_view_token`` cookie or an ``Authorization: Bearer`` header. A ``?token=``
    in a URL (the one printed at start) sets the cookie and redirects to the same URL without
    it, so the token does not stay in the address bar, the history or a Referer.

    Anything else is refused with one line (401 without a token, 403 with a wrong one; JSON
    ``{"error"}`` under ``/api``), counted in ``viewer.refused`` (``/api/runs`` reports it) and
    logged at the 1st, 10th, 100th... refusal; the server keeps serving."""

    def __init__(self, app, token: str, viewer: Viewer):
        self.app, self.viewer = app, viewer
        self._token = token.encode()

    def _good(self, given: str) -> bool:
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self._token)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        if scope["type"] != "http":  # no websockets here: close whatever else comes
            return await send({"type": "websocket.close", "code": 1008})
        request = Request(scope)
        query = urllib.parse.parse_qsl(request.url.query, keep_blank_values=True)
        in_url = [v for k, v in query if k == "token"]
        auth = request.headers.get("authorization", "")
        scheme, _, bearer = auth.partition(" ")
        cookie = request.cookies.get(TOKEN_COOKIE)
        if in_url:
            if len(in_url) == 1 and self._good(in_url[0]):
                rest = urllib.parse.urlencode([(k, v) for k, v in query if k != "token"])
                response = RedirectResponse(request.url.path + (f"?{rest}" if rest else ""),
                                            status_code=303,
                                            headers={"Cache-Control": "no-store",
                                                     "Referrer-Policy": "no-referrer"})
                response.set_cookie(TOKEN_COOKIE, self._token.decode(), httponly=True,
                                    samesite="strict", path="/")
                return await response(scope, receive, send)
            return await self._refuse(request, 403, "the token in the URL is wrong")(
                scope, receive, send)
        if auth:
            if scheme.lower() == "bearer" and self._good(bearer.strip()):
                return await self.app(scope, receive, send)
            return await self._refuse(request, 403, "the Authorization header's token is "
                                      "wrong (send: Authorization: Bearer <token>)")(
                scope, receive, send)
        if cookie is not None:
            if self._good(cookie):
                return await self.app(scope, receive, send)
            return await self._refuse(request, 403, "the token cookie is wrong: a restarted "
                                      "viewer prints a new token; open its URL again")(
                scope, receive, send)
        return await self._refuse(request, 401, "this viewer needs its token: open the URL "
                                  "`autodidact view` printed (it ends in ?token=...), or send "
                                  "Authorization: Bearer <token>")(scope, receive, send)

    def _refuse(self, request: Request, status: int, why: str) -> Response:
        self.viewer.refused += 1
        n = self.viewer.refused
        if n == 10 ** (len(str(n)) - 1):  # 1, 10, 100, ...: a flood does not flood the log
            log.warning("viewer: refused %s %r from %s: %s (%d refused so far)",
                        request.method, request.url.path,
                        request.client.host if request.client else "?", why, n)
        headers = {"Cache-Control": "no-store"}
        if status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="autodidact view"'
        if request.url.path.startswith("/api"):
            return Response(json.dumps({"error": f"refused: {why}"}), status,
                            media_type="application/json", headers=headers)
        return Response(f"refused: {why}\n", status, media_type="text/plain", headers=headers)


def make_app(viewer: Viewer, token: str | None = None) -> Starlette | TokenDoor:
    """The viewer's app; with ``token``, behind a :class:`TokenDoor` that wants it."""
    app = _routes(viewer)
    return TokenDoor(app, token, viewer) if token else app


def _routes(viewer: Viewer) -> Starlette:
    def endpoint(answer):
        def handle(request: Request) -> Response:
            try:
                status, body = 200, answer(request)
            except ViewError as exc:
                status, body = exc.status, {"error": str(exc)}
            except Exception as exc:  # a bug or a file changing under us: one line, not a trace
                viewer.errors += 1
                log.exception("viewer: %s failed", request.url.path)
                status, body = 500, {"error": f"the viewer failed on {request.url.path} "
                                              f"({type(exc).__name__}: {exc}); see its log"}
            # The run's password never leaves: masked in the data, whatever it was quoted in,
            # then in the text, whatever the serialising escaped it to.
            scrubber = viewer.scrubber()
            text = scrubber.text(json.dumps(scrubber.data(body), default=str, allow_nan=False))
            return Response(text, status, media_type="application/json",
                            headers={"Cache-Control": "no-store"})

        return handle

    def runs(request):
        return {"runs": [{"index": i, "label": v.label, "dir": str(v.path)}
                         for i, v in enumerate(viewer.runs)], "errors": viewer.errors,
                "refused": viewer.refused}

    def run(request):
        return viewer.run(request).overview()

    def curves(request):
        raw = request.query_params.get("runs", "0")
        try:
            picked = [viewer.runs[int(i)] for i in raw.split(",") if i.strip()]
        except (ValueError, IndexError):
            raise ViewError(f"runs={raw!r}: give indices from 0 to {len(viewer.runs) - 1}, "
                            "comma-separated", 404) from None
        return {"runs": [view.curves() for view in picked]}

    def groups(request):
        view = viewer.run(request)
        view.check()
        filters = Filters.parse(request.query_params)
        page, per_page = page_params(request.query_params)
        if time.time() - view.groups.refreshed_at > FRESH_S:
            view.groups.refresh(budget_s=REQUEST_INDEX_S)
        return view.groups.page(filters, page, per_page)

    def group(request):
        return viewer.run(request).group(request.path_params["group_id"])

    def tokens(request):
        return viewer.run(request).tokens(request.path_params["group_id"],
                                          request.path_params["traj"])

    def tasks(request):
        return viewer.run(request).tasks(request.query_params)

    def index(request):
        return FileResponse(STATIC / "index.html")

    def unknown(request):
        raise ViewError(f"no endpoint {request.url.path}; docs/viewer.md lists them", 404)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        viewer.start()
        try:
            yield
        finally:
            viewer.stop()

    return Starlette(lifespan=lifespan, routes=[
        Route("/", index),
        Route("/api/runs", endpoint(runs)),
        Route("/api/run", endpoint(run)),
        Route("/api/curves", endpoint(curves)),
        Route("/api/groups", endpoint(groups)),
        Route("/api/group/{group_id:path}", endpoint(group)),
        Route("/api/tokens/{group_id:path}/{traj:int}", endpoint(tokens)),
        Route("/api/tasks", endpoint(tasks)),
        Route("/api/{rest:path}", endpoint(unknown)),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ])


def run_views(run_dirs: list[Path]) -> list[RunView]:
    """A view per run directory; a folder of runs (an ablation's arms) gives one per arm."""
    views = []
    for path in run_dirs:
        arms = sorted(p.parent for p in Path(path).glob("*/config.yaml"))
        if not (Path(path) / "config.yaml").exists() and arms:
            views += [RunView(arm, f"{Path(path).name}/{arm.name}") for arm in arms]
        else:
            views.append(RunView(Path(path), Path(path).name))
    return views


class RemoteRefused(ValueError):
    """A non-loopback address to bind without ``allow_remote``."""


def remote_refusal(host: str) -> str:
    return (f"refusing --host {host}: it is not the loopback, and the viewer shows every "
            "rollout, prompt and path of the run; add --allow-remote to serve it there behind "
            "a token (or keep 127.0.0.1 and tunnel over SSH)")


def serve(run_dirs: list[Path], host: str = "127.0.0.1", port: int = DEFAULT_PORT,
          allow_remote: bool = False) -> None:
    """Serve the viewer until interrupted; prints ``viewer: <url>`` once it listens. A host
    that is not the loopback needs ``allow_remote``; with it every request needs a token,
    made here and printed once, in that URL."""
    import uvicorn

    if not (allow_remote or is_loopback_host(host)):
        raise RemoteRefused(remote_refusal(host))
    token = secrets.token_urlsafe(32) if allow_remote else None
    viewer = Viewer(run_views(run_dirs))
    config = uvicorn.Config(make_app(viewer, token), host=host, port=port, log_level="warning",
                            access_log=False)
    server = uvicorn.Server(config)

    def announce():
        while not server.started and not server.should_exit:
            threading.Event().wait(0.05)
        if server.started:
            bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
            where = f"[{host}]" if ":" in host else host
            if token:
                print(f"viewer: http://{where}:{bound}/?token={token}", flush=True)
                print("viewer: every request needs that token: the URL sets it as a cookie; "
                      "scripts send Authorization: Bearer <token>", flush=True)
            else:
                print(f"viewer: http://{where}:{bound}", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    server.run()
