"""``autodidact view`` in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by scripts/setup.sh where it runs as root) driven by Selenium over
the real server on the session's tiny run (:func:`test_status.tiny_run`, made once however the
modules that share it are selected).

One Chromium and one server serve the whole module; both are killed in finalizers, so none
outlives a timeout. A failing test saves a screenshot and the page's HTML and names the folder.
Every test fails on a severe browser-console error (a script error, a failed request) other than
the API errors a test asks for. Skipped, with the reason, where Chromium, its driver or Selenium
is missing or the browser does not start.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from test_status import tiny_run

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WAIT_S = 60  # the suite runs beside other jobs on two cores: pages can take a while
INSTALL = ("as root: apt-get install -y --no-install-recommends chromium chromium-driver; "
           ".venv/bin/pip install 'selenium>=4.20'")


def _kill_group(proc: subprocess.Popen | None) -> None:
    """SIGKILL a process started with start_new_session and everything in its group."""
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(10)


@pytest.fixture(scope="module")
def browser(request):
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if importlib.util.find_spec("selenium") is None:
        missing.append("the selenium package")
    if missing:
        pytest.skip(f"no {', '.join(missing)}: the browser tests need them ({INSTALL})")
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,800", "--disable-extensions", "--no-first-run",
                "--disable-background-networking", "--disable-component-update"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Its own session: the driver and every Chromium process it starts share one process group,
    # killed whole at the end whatever state the browser is in.
    service = Service(executable_path=str(CHROMEDRIVER), popen_kw={"start_new_session": True})
    try:
        driver = webdriver.Chrome(service=service, options=options)
    except WebDriverException as exc:
        _kill_group(service.process if hasattr(service, "process") else None)
        pytest.skip(f"Chromium did not start ({str(exc).splitlines()[0]})")

    def close():
        with contextlib.suppress(Exception):
            driver.quit()
        _kill_group(getattr(service, "process", None))

    request.addfinalizer(close)
    driver.set_page_load_timeout(WAIT_S)
    return driver


@pytest.fixture(scope="module")
def run_dir(browser, tmp_path_factory) -> Path:
    # after `browser`: a machine without one skips before the tiny run is made for it
    return tiny_run(tmp_path_factory)["dir"]


@pytest.fixture(scope="module")
def viewer(run_dir, tmp_path_factory, request) -> str:
    """The real server (`autodidact view`) on a free port: its base URL."""
    return _serve(run_dir, tmp_path_factory, request)


def _serve(run_dir: Path, tmp_path_factory, request, *extra: str) -> str:
    """`autodidact view` over `run_dir` (and `extra` arguments), stopped when `request`'s scope
    ends: the URL it prints (with ``?token=`` when it wants one)."""
    log = tmp_path_factory.mktemp("viewer") / "viewer.log"
    err = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "autodidact.cli", "view", "--run-dir",
                             str(run_dir), "--port", "0", *extra], stdout=subprocess.PIPE,
                            stderr=err, text=True, start_new_session=True)
    request.addfinalizer(lambda: (_kill_group(proc), err.close()))
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if found := re.match(r"viewer: (http://\S+)", line):
            return found.group(1)
    pytest.fail(f"`autodidact view` did not say where it listens in {WAIT_S} s "
                f"(exit {proc.poll()}): {log.read_text()[-2000:]}")


def _api(base: str, path: str) -> dict:
    with urllib.request.urlopen(base + path, timeout=WAIT_S) as resp:
        return json.loads(resp.read())


class Page:
    """The browser on one view of the viewer, with the checks every test ends with."""

    def __init__(self, driver, base: str, shots: Path):
        self.driver, self.base, self.shots = driver, base, shots

    def open(self, route: str) -> None:
        """Load `#/route` and wait until the page has drawn it (or its error)."""
        self.driver.get(f"{self.base}/#/{route}")
        self.wait_drawn()

    def wait_drawn(self) -> None:
        self.wait(lambda d: d.execute_script(
            "const m = document.querySelector('#main');"
            "return m && m.dataset.rendered !== undefined"
            " && m.dataset.rendered === location.hash;"), "the view to be drawn")

    def wait(self, condition, what: str):
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, WAIT_S, poll_frequency=0.1).until(
            condition, f"waited {WAIT_S} s for {what}")

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def error_text(self) -> str | None:
        return self.js("const e = document.querySelector('#error');"
                       "return e.hidden ? null : e.textContent;")

    def console_errors(self, allowed: str | None = None) -> list[str]:
        """Severe console entries since the last call, but for failed requests whose URL
        matches `allowed` (an API error the test asked for)."""
        bad = []
        for entry in self.driver.get_log("browser"):
            if entry["level"] != "SEVERE":
                continue
            if allowed and entry.get("source") == "network" and re.search(allowed,
                                                                            entry["message"]):
                continue
            bad.append(entry["message"])
        return bad

    @contextlib.contextmanager
    def checked(self, name: str, allowed: str | None = None):
        """Run a test's steps; on a failure keep a screenshot and the page, and name the
        folder. Then no severe console error may have been logged."""
        self.console_errors()  # what an earlier test left
        try:
            yield self
            errors = self.console_errors(allowed)
            assert not errors, f"browser console errors: {errors}"
        except Exception as exc:
            self.shots.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(Exception):
                self.driver.save_screenshot(str(self.shots / f"{name}.png"))
                (self.shots / f"{name}.html").write_text(self.driver.page_source)
            raise AssertionError(f"{exc}\n(screenshot and page of {name!r} in {self.shots})") \
                from exc


@pytest.fixture(scope="module")
def page(browser, viewer, tmp_path_factory) -> Page:
    return Page(browser, viewer, tmp_path_factory.mktemp("viewer-screenshots"))


@pytest.fixture(scope="module")
def groups(viewer) -> list[dict]:
    return _api(viewer, "/api/groups?run=0&per_page=200")["groups"]


def test_run_page_shows_phase_and_drawn_charts(page, viewer):
    with page.checked("run"):
        page.open("run/0")
        info = _api(viewer, "/api/run?run=0")
        assert page.js("return document.querySelector('#run-phase').textContent") == info["phase"]
        assert page.js("return document.querySelectorAll('#roles tbody tr').length") == \
            len(info["roles"])
        assert page.js("return document.querySelectorAll('#heldout tbody tr').length") >= 1
        assert "updated" in page.js("return document.querySelector('#last-updated').textContent")
        curves = _api(viewer, "/api/curves?runs=0")["runs"][0]
        plots = {p["name"] for p in curves["plots"]}
        charts = page.js("return [...document.querySelectorAll('.chart')].map(c => [c.dataset"
                         ".plot, Number(c.dataset.points), !!c.querySelector('canvas')])")
        assert {c[0] for c in charts} == plots, charts
        # "Why RL moved or stalled": the likely cause, and its charts under it
        assert page.js("return document.querySelector('#why-line').textContent") == \
            curves["diagnosis"]["line"]
        why = page.js("return [...document.querySelectorAll('#why-charts .chart')]"
                      ".map(c => c.dataset.plot)")
        assert set(why) == {p["name"] for p in curves["plots"] if p["section"] == "why"}
        assert all(has_canvas for _, _, has_canvas in charts), charts
        # Drawn data: coloured pixels on a canvas (axes and grid are grey, lines are coloured).
        coloured = page.js("""
            const counts = [];
            for (const c of document.querySelectorAll('.chart')) {
              if (!(Number(c.dataset.points) > 0)) continue;
              const canvas = c.querySelector('canvas');
              const px = canvas.getContext('2d').getImageData(0, 0, canvas.width,
                                                              canvas.height).data;
              let n = 0;
              for (let i = 0; i < px.length; i += 4) {
                const [r, g, b, a] = [px[i], px[i + 1], px[i + 2], px[i + 3]];
                if (a > 0 && Math.max(r, g, b) - Math.min(r, g, b) > 60) n++;
              }
              counts.push(n);
            }
            return counts;""")
        assert coloured and max(coloured) > 50, f"no chart has drawn lines: {coloured}"


def test_group_page_shows_each_steps_label_and_advantage(page, viewer, groups):
    judged = [g for g in groups if g["judged"]]
    assert judged, "the tiny run stored no judged group"
    group_id = judged[0]["group_id"]
    expected = _api(viewer, f"/api/group/{group_id}?run=0")
    with page.checked("group"):
        page.open(f"group/0/{group_id}")
        shown = page.js("""
            return [...document.querySelectorAll('.rollout')].map(r =>
              [...r.querySelectorAll('.turn')].map(t => [
                t.querySelector('.label').textContent,
                t.querySelector('.advantage').textContent,
                t.querySelector('.reason') !== null]));""")
        want = [[("GOOD" if t["label"] == 1 else "BAD", t["advantage"])
                 for t in r["turns"]] for r in expected["rollouts"]]
        assert [len(r) for r in shown] == [len(r) for r in want]
        for shown_rollout, want_rollout in zip(shown, want):
            for (label, advantage, has_reason), (want_label, want_adv) in zip(shown_rollout,
                                                                              want_rollout):
                assert label == want_label and has_reason
                assert float(advantage) == pytest.approx(want_adv, abs=1e-3)
        links = page.js("return [...document.querySelectorAll('.rollout a.tokens-link')]"
                        ".map(a => a.getAttribute('href'))")
        assert links == [f"#/tokens/0/{group_id}/{i}" for i in range(len(want))]


def test_outcome_filter_changes_the_list(page, groups):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    with page.checked("groups"):
        page.open("groups/0")
        total = int(page.js("return document.querySelector('#group-total').textContent"))
        assert total == len(groups) > 0
        totals = {}
        for outcome in ("all_success", "all_fail", "mixed"):
            Select(page.driver.find_element(By.ID, "f-outcome")).select_by_value(outcome)
            page.wait(lambda d, o=outcome: d.execute_script(
                "return location.hash") == f"#/groups/0?outcome={o}", "the filter in the link")
            page.wait_drawn()
            totals[outcome] = int(page.js(
                "return document.querySelector('#group-total').textContent"))
            rows = page.js("return [...document.querySelectorAll('#group-list tr.group-row')]"
                           ".map(r => [r.dataset.groupId, r.dataset.outcome])")
            assert len(rows) == min(totals[outcome], 50)
            assert {o for _, o in rows} <= {outcome}, rows
            assert page.js("return document.querySelector('#f-outcome').value") == outcome
        assert sum(totals.values()) == total
        assert any(n != total for n in totals.values()), totals


def test_token_view_colours_tokens(page, viewer, groups):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    group_id = groups[0]["group_id"]
    tokens = _api(viewer, f"/api/tokens/{group_id}/0?run=0")["tokens"]
    with page.checked("tokens"):
        page.open(f"tokens/0/{group_id}/0")
        spans = page.js("return [...document.querySelectorAll('span.tok')].map(s =>"
                        " [s.classList.contains('gen'), s.style.backgroundColor, s.title])")
        assert len(spans) == len(tokens)
        colours = {bg for gen, bg, _ in spans if gen}
        assert len(colours) >= 2, colours
        assert all(not bg for gen, bg, _ in spans if not gen)
        assert all("log-prob" in title and "version" in title for _, _, title in spans)
        Select(page.driver.find_element(By.ID, "token-mode")).select_by_value("version")
        page.wait(lambda d: "mode=version" in d.execute_script("return location.hash"),
                  "the mode in the link")
        assert page.js("return document.querySelectorAll('span.tok').length") == len(tokens)


def test_unknown_group_shows_the_error_line(page):
    with page.checked("error", allowed=r"/api/group/no-such-group"):
        page.open("group/0/no-such-group")
        text = page.error_text()
        assert text and "no-such-group" in text, text
        assert page.js("return document.querySelectorAll('.rollout').length") == 0


def test_run_and_tasks_pages_show_tasks_by_origin(browser, tmp_path_factory, request):
    # Its own small run (tests/test_task_origins.py), whose every count is known: the table
    # the page draws must hold the numbers the API computed.
    from test_task_origins import EXPECTED, origins_run

    base = _serve(origins_run(tmp_path_factory.mktemp("origins")), tmp_path_factory, request)
    page = Page(browser, base, tmp_path_factory.mktemp("origins-screenshots"))
    for route in ("run/0", "tasks/0"):
        with page.checked(f"origins-{route.split('/')[0]}"):
            page.open(route)
            page.wait(lambda d: d.execute_script(
                "return document.querySelectorAll('#origin-table tbody tr').length") == 2,
                "the tasks-by-origin table")
            rows = page.js("return [...document.querySelectorAll('#origin-table tbody tr')]"
                           ".map(r => [...r.cells].map(c => c.textContent))")
            assert rows == [[origin, str(tasks), str(groups),
                             f"{100 * ok / n:.1f}% ({ok}/{n})",
                             f"{100 * good / groups:.1f}% ({good}/{groups})"]
                            for origin, (tasks, groups, ok, n, good) in EXPECTED.items()], rows
            assert "configured 0.4, effective 0.4, drawn 40.0%" in page.js(
                "return document.querySelector('#origins').textContent")


def test_run_page_shows_each_envs_held_out_success_for_a_mix(browser, tmp_path_factory,
                                                              request):
    # An env mix's summary.json (tests/test_env_mix_evidence.py) beside a few stored groups:
    # the table the page draws holds each env's numbers per split and stage, and the mean.
    from helpers_replay import make_group
    from test_env_mix_evidence import write_summary
    from test_viewer import _store

    run_dir = tmp_path_factory.mktemp("mix")
    summary = write_summary(run_dir)
    _store(run_dir, [make_group(i) for i in range(3)])
    page = Page(browser, _serve(run_dir, tmp_path_factory, request),
                tmp_path_factory.mktemp("mix-screenshots"))
    with page.checked("mix-run"):
        page.open("run/0")
        page.wait(lambda d: d.execute_script(
            "return document.querySelectorAll('#heldout-envs-table tbody tr').length") == 12,
            "the per-env held-out table")
        rows = page.js("return [...document.querySelectorAll('#heldout-envs-table tbody tr')]"
                       ".map(r => [...r.cells].map(c => c.textContent))")
        shop = summary["success_warm"]["envs"]["shop"]
        low, high = shop["avg_ci"]
        assert ["shop", "validation", "after warm-start", "12.5%",
                f"{100 * low:.1f}% to {100 * high:.1f}%", "25.0%", "4"] in rows, rows
        assert ["mean over envs", "test", "after RL", "50.0%", "–", "62.5%", "–"] in rows, rows


# --- the door: a remote bind needs --allow-remote, and then the token --------------------------


@pytest.fixture(scope="module")
def small_run(browser, tmp_path_factory) -> Path:
    """A run of a few stored groups (no training): enough for the Groups page."""
    from helpers_replay import make_group
    from test_viewer import _small_run, _store

    run_dir = _small_run(tmp_path_factory.mktemp("door"))
    _store(run_dir, [make_group(i) for i in range(3)])
    return run_dir


def test_a_remote_bind_is_refused_without_the_flag(browser, small_run):
    from protocol.transport import free_tcp_port

    port = free_tcp_port()
    refused = subprocess.run([sys.executable, "-m", "autodidact.cli", "view", "--run-dir",
                              str(small_run), "--host", "0.0.0.0", "--port", str(port)],
                             capture_output=True, text=True, timeout=WAIT_S)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode != 0 and refused.stdout == "", refused
    assert len(lines) == 1 and "--allow-remote" in lines[0], lines
    # Nothing listens: the browser gets no page from that port.
    from selenium.common.exceptions import WebDriverException

    with pytest.raises(WebDriverException, match="ERR_CONNECTION_REFUSED"):
        browser.get(f"http://127.0.0.1:{port}/")
    browser.get_log("browser")  # the refused connection's entry, for no later test to see


def test_with_allow_remote_the_page_needs_the_printed_token(browser, small_run,
                                                            tmp_path_factory, request):
    printed = _serve(small_run, tmp_path_factory, request, "--host", "0.0.0.0",
                     "--allow-remote")
    found = re.fullmatch(r"http://0\.0\.0\.0:(\d+)/\?token=([\w-]+)", printed)
    assert found, printed
    base, token = f"http://127.0.0.1:{found.group(1)}", found.group(2)
    page = Page(browser, base, tmp_path_factory.mktemp("door-shots"))
    fetch = ("const done = arguments[arguments.length - 1];"
             "fetch(arguments[0]).then(r => r.text().then(t => done([r.status, t])))"
             ".catch(e => done([0, String(e)]));")
    browser.delete_all_cookies()
    with page.checked("door-without", allowed=r"127\.0\.0\.1"):
        browser.get(f"{base}/#/groups/0")  # no token: one line, no page
        text = page.js("return document.body.innerText").strip()
        assert text.startswith("refused:") and "token" in text and "\n" not in text, text
        assert page.js("return document.querySelector('#main')") is None
        browser.get(f"{base}/?token=not-{token}")
        assert page.js("return document.body.innerText").startswith("refused:")
        assert not browser.get_cookies()
    # (a refused page has no icon link: the browser's own /favicon.ico ask is refused too)
    with page.checked("door-with", allowed=r"/favicon\.ico"):
        browser.get(f"{base}/?token={token}#/groups/0")  # the printed URL, as a user opens it
        page.wait_drawn()
        assert page.error_text() is None
        assert int(page.js("return document.querySelector('#group-total').textContent")) == 3
        # the token left the address bar; it stays as an HttpOnly cookie the page cannot read
        assert page.js("return location.search") == "" and "token" not in browser.current_url
        assert page.js("return document.cookie") == ""
        cookies = {c["name"]: c for c in browser.get_cookies()}
        assert cookies["autodidact_view_token"]["httpOnly"]
        status, body = browser.execute_async_script(fetch, "/api/runs")
        assert status == 200 and json.loads(body)["refused"] >= 2
        page.open("groups/0?outcome=mixed")  # navigating on: the cookie goes with every request
    browser.delete_all_cookies()
    with page.checked("door-dropped", allowed=r"127\.0\.0\.1"):
        status, body = browser.execute_async_script(fetch, "/api/groups")
        assert status == 401 and json.loads(body)["error"].startswith("refused:")
        browser.refresh()
        assert page.js("return document.body.innerText").strip().startswith("refused:")
