"""The viewer's HTTP server: Starlette routes over :mod:`autodidact.viewer.data`, run by uvicorn.

Read-only: every route is a GET, and the page (``static/``, with its charting library vendored)
is served from the package, never from the internet. A request the viewer cannot answer gets
``{"error": one line}`` with a 4xx status; anything unexpected is logged, counted
(``/api/runs`` reports ``errors``) and answered 500 with one line, and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from autodidact.viewer.data import RunView, page_params, scrub
from autodidact.viewer.groups import Filters, ViewError

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
DEFAULT_PORT = 8765
INDEX_EVERY_S = 2.0  # how often new groups are summarized in the background
INDEX_SLICE_S = 0.2  # one slice of unpacking: requests wait at most this for the index
REQUEST_INDEX_S = 0.3  # a groups request summarizes what is new for at most this long
FRESH_S = 1.0  # ... unless the index was brought up to date this recently


class Viewer:
    """The served runs, and what the server counts about itself."""

    def __init__(self, runs: list[RunView]):
        self.runs = runs
        self.errors = 0
        self._stop = threading.Event()
        self._indexer = threading.Thread(target=self._index, name="viewer-index", daemon=True)

    def start(self) -> None:
        self._indexer.start()

    def stop(self) -> None:
        self._stop.set()

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


def make_app(viewer: Viewer) -> Starlette:
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
            text = json.dumps(body, default=str, allow_nan=False)
            for view in viewer.runs:
                text = scrub(text, view.secrets())
            return Response(text, status, media_type="application/json",
                            headers={"Cache-Control": "no-store"})

        return handle

    def runs(request):
        return {"runs": [{"index": i, "label": v.label, "dir": str(v.path)}
                         for i, v in enumerate(viewer.runs)], "errors": viewer.errors}

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


def serve(run_dirs: list[Path], host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
    """Serve the viewer until interrupted; prints ``viewer: <url>`` once it listens."""
    import uvicorn

    viewer = Viewer(run_views(run_dirs))
    config = uvicorn.Config(make_app(viewer), host=host, port=port, log_level="warning",
                            access_log=False)
    server = uvicorn.Server(config)

    def announce():
        while not server.started and not server.should_exit:
            threading.Event().wait(0.05)
        if server.started:
            bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
            print(f"viewer: http://{host}:{bound}", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    server.run()
