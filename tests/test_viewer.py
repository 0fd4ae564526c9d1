"""``autodidact view``'s HTTP API: every endpoint on a real run directory, and bad input.

The real run is the session's tiny job from tests/test_status.py (:func:`test_status.tiny_run`:
embedded Redis, replay, learner, one actor, one judge), shared with tests/test_report.py and
tests/test_viewer_browser.py. Small stores written by the real replay server stand in where a
test needs a shape the tiny run lacks (a damaged group, groups arriving while the viewer
reads). The app is driven in-process (Starlette's TestClient): the same routes the served
process runs; tests/test_viewer_browser.py starts the real process.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgpack
import pytest
from click.testing import CliRunner
from helpers_replay import labels_for, make_group
from starlette.testclient import TestClient
from test_status import tiny_run

from autodidact.diagnosis import run_diagnosis
from autodidact.viewer.data import RunView
from autodidact.viewer.server import Viewer, make_app, run_views
from metrics.jsonl import read_metrics
from protocol import codec
from protocol.config import ReplayConfig
from protocol.run_dir import RunDir
from protocol.transport import Incoming
from replay.server import ReplayServer
from replay.store import GroupRecord, Store, read_stats

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tiny_run(tmp_path_factory)["dir"]


@pytest.fixture(scope="module")
def client(run_dir):
    with TestClient(make_app(Viewer([RunView(run_dir, "tiny")]))) as c:
        yield c


def _get(client, path: str, status: int = 200) -> dict:
    reply = client.get(path)
    assert reply.status_code == status, (path, reply.text[:500])
    body = reply.json()
    if status != 200:
        assert set(body) == {"error"} and "\n" not in body["error"] and "Traceback" not in \
            body["error"], body
    return body


def test_run_and_curves_of_a_real_run(client, run_dir):
    run = _get(client, "/api/run")
    assert run["finished"] and run["phase"] == "done"
    assert {r["name"] for r in run["roles"]} >= {"learner", "replay"}
    assert run["version"] >= 1
    curves = _get(client, "/api/curves?runs=0")["runs"][0]
    plots = {p["name"]: p for p in curves["plots"]}
    loss = [line for panel in plots["loss"]["panels"] for line in panel["lines"]
            if line["metric"] == "learner/loss"][0]
    assert len(loss["x"]) == len(loss["y"]) >= 2
    stages = [h["stage"] for h in curves["heldout"]]
    assert stages[0] == "base" and "rl" in stages
    assert all(len(h["ci"]) == 2 and h["ci"][0] <= h["avg"] <= h["ci"][1]
               for h in curves["heldout"])
    # "Why RL moved or stalled" first, with the likely cause report.md names
    # (tests/test_diagnosis_run.py checks the line itself on a run planted to say it)
    why = [p for p in curves["plots"] if p["section"] == "why"]
    assert why == curves["plots"][:len(why)] and {p["name"] for p in why} >= {
        "why_success", "why_signal", "why_policy", "why_step"}
    assert curves["diagnosis"]["line"] == run_diagnosis(run_dir).line
    assert any("learner/kl_ref" in m for m in curves["missing"])  # no penalty, and it says so
    # the validation probe (eval.probe_every on the tiny run) beside training-task success
    success = {line["metric"]: line for panel in plots["why_success"]["panels"]
               for line in panel["lines"]}
    probes = [r for r in read_metrics(run_dir, "eval") if "eval/probe_success" in r]
    assert success["eval/probe_success"]["x"] == [r["eval/version"] for r in probes]
    assert success["eval/probe_success"]["y"] == [r["eval/probe_success"] for r in probes]
    assert success["eval/probe_success"]["x_axis"] == success["actor/success_rate"]["x_axis"]


def test_groups_list_pages_and_filters(client, run_dir):
    stored = read_stats(run_dir)["groups"]
    first = _get(client, "/api/groups?per_page=5")
    assert first["total"] == first["stored"] == stored > 5
    seqs = [g["seq"] for g in first["groups"]]
    assert seqs == sorted(seqs, reverse=True) and len(seqs) == 5  # newest first
    second = _get(client, "/api/groups?per_page=5&page=1")
    assert max(g["seq"] for g in second["groups"]) < min(seqs)
    # Each filter splits the groups: its choices add up to the whole, and each kept row obeys it.
    for name, choices in (("outcome", ("all_success", "all_fail", "mixed")),
                          ("judged", ("yes", "no")), ("guided", ("yes", "no"))):
        totals = []
        for choice in choices:
            page = _get(client, f"/api/groups?{name}={choice}&per_page=200")
            totals.append(page["total"])
            for g in page["groups"]:
                if name == "outcome":
                    assert g["outcome"] == choice
                if name == "judged":
                    assert g["judged"] == (choice == "yes")
        assert sum(totals) == stored, (name, totals)
    assert _get(client, "/api/groups?judged=yes")["total"] > 0
    task = first["groups"][0]["task_id"]
    kept = _get(client, f"/api/groups?task={task}&per_page=200")
    assert 0 < kept["total"] <= stored and all(task in g["task_id"] for g in kept["groups"])
    version = first["groups"][0]["max_version"]
    for g in _get(client, f"/api/groups?version={version}&per_page=200")["groups"]:
        assert g["min_version"] <= version <= g["max_version"]


def test_one_group_shows_each_step_with_label_reason_and_advantage(client):
    gid = _get(client, "/api/groups?judged=yes&outcome=mixed&per_page=1")["groups"][0]["group_id"]
    group = _get(client, f"/api/group/{gid}")
    assert group["group_id"] == gid and group["judge"]["name"] == "reference"
    assert group["advantage"].startswith("composite")
    steps = [t for r in group["rollouts"] for t in r["turns"]]
    assert steps and all(t["label"] in (0, 1) and t["reason"] for t in steps)
    assert all(isinstance(t["advantage"], float) for t in steps)
    # the outcome advantage is the group's z-score: rollouts that succeeded are above 0
    for r in group["rollouts"]:
        assert (r["advantage"] > 0) == r["success"]


def test_tokens_carry_sampler_and_learner_numbers(client, run_dir):
    gid = _get(client, "/api/groups?judged=yes&per_page=1")["groups"][0]["group_id"]
    view = _get(client, f"/api/tokens/{gid}/0")
    rows = view["tokens"]
    generated = [r for r in rows if r["generated"]]
    assert generated and all(r["logprob"] is not None and r["logprob"] <= 0 for r in generated)
    assert all(r["logprob"] is None and r["version"] == -1 for r in rows if not r["generated"])
    assert "".join(r["text"] for r in rows).strip()
    assert view["prompt_len"] > 0
    # A group the learner trained on carries its log-probs; the ratio is exp(learner - sampler).
    trained = [g for g in _get(client, "/api/groups?per_page=200")["groups"] if g["consumed"]]
    seen = [v for v in (_get(client, f"/api/tokens/{g['group_id']}/0") for g in trained[:20])
            if v["learner"]["seen"]]
    assert seen, "no trained group of the tiny run has the learner's token log"
    for r in seen[0]["tokens"]:
        if r["ratio"] is not None:
            assert r["ratio"] == pytest.approx(2.718281828 ** (r["learner_logprob"] -
                                                               r["logprob"]), rel=1e-4)
    assert any(r["ratio"] is not None for r in seen[0]["tokens"])


def test_tasks_with_success_and_coverage(client):
    tasks = _get(client, "/api/tasks?per_page=200")
    assert tasks["total"] > 0 and "stored groups" in tasks["outcomes_from"]
    rolled = [t for t in tasks["tasks"] if t["trials"]]
    assert rolled and all(0 <= t["successes"] <= t["trials"] for t in rolled)
    assert all(t["rate"] == t["successes"] / t["trials"] for t in rolled)
    assert "kinds" in tasks["coverage"]


def test_the_page_and_its_assets_are_served_from_the_package(client):
    page = client.get("/")
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert "http://" not in page.text and "https://" not in page.text  # nothing from a CDN
    assert client.get("/static/app.js").status_code == 200


def test_no_reply_carries_the_runs_redis_password(client, run_dir):
    password = RunDir(run_dir).redis_password.read_text().strip()
    assert password
    gid = _get(client, "/api/groups?per_page=1")["groups"][0]["group_id"]
    for path in ("/api/runs", "/api/run", "/api/curves", "/api/groups", f"/api/group/{gid}",
                 "/api/tasks"):
        assert password not in client.get(path).text, path


def test_bad_requests_get_one_line_and_the_server_keeps_serving(client):
    _get(client, "/api/group/no-such-group", 404)
    assert "no-such-group" in _get(client, "/api/group/no-such-group", 404)["error"]
    assert "outcome" in _get(client, "/api/groups?outcome=sometimes", 400)["error"]
    assert "version" in _get(client, "/api/groups?version=new", 400)["error"]
    assert "past the last page" in _get(client, "/api/groups?page=100000", 400)["error"]
    _get(client, "/api/groups?per_page=0", 400)
    _get(client, "/api/tokens/no-such-group/0", 404)
    _get(client, "/api/run?run=7", 404)
    _get(client, "/api/nothing/here", 404)
    assert _get(client, "/api/runs")["errors"] == 0  # none of that was a failure of the viewer


def _store(run_dir: Path, groups, labelled=()) -> None:
    server = ReplayServer(run_dir, ReplayConfig(), "tcp://127.0.0.1:*")
    try:
        burst = [Incoming([], g.group_id, msg=g, body=codec.encode_body(g)) for g in groups]
        burst += [Incoming([], "l" + g.group_id, msg=labels_for(g),
                           body=codec.encode_body(labels_for(g))) for g in labelled]
        server.handle(burst)
    finally:
        server.close()


def _small_run(tmp_path: Path) -> Path:
    (tmp_path / "config.yaml").write_text("name: small\n")
    return tmp_path


def test_a_run_being_written_or_missing_gets_a_clear_page(tmp_path):
    missing, starting = tmp_path / "missing", tmp_path / "starting"
    starting.mkdir()
    (no_store := tmp_path / "no-store").mkdir()
    _small_run(no_store)
    views = [RunView(missing, "missing"), RunView(starting, "starting"),
             RunView(no_store, "no-store")]
    with TestClient(make_app(Viewer(views))) as c:
        assert "no such run directory" in _get(c, "/api/run?run=0", 404)["error"]
        assert "being set up" in _get(c, "/api/groups?run=1", 404)["error"]
        assert "no replay store yet" in _get(c, "/api/groups?run=2", 404)["error"]
        assert "no replay store yet" in _get(c, "/api/group/g-1?run=2", 404)["error"]
        assert _get(c, "/api/runs")["errors"] == 0


def test_a_damaged_group_gets_a_clear_page_and_the_rest_still_serve(tmp_path):
    run_dir = _small_run(tmp_path)
    groups = [make_group(i) for i in range(4)]
    _store(run_dir, groups, labelled=groups[:2])
    store = Store(run_dir, map_size=1 << 24)
    with store.env.begin(write=True) as txn:  # the `replay check` case: a flipped byte
        body = bytearray(store.body(txn, groups[1].group_id))
        body[len(body) // 2] ^= 0xFF
        txn.put(groups[1].group_id.encode(), bytes(body), db=store.db["groups"])
    store.close()
    with TestClient(make_app(Viewer([RunView(run_dir, "small")]))) as c:
        error = _get(c, f"/api/group/{groups[1].group_id}", 422)["error"]
        assert "damaged" in error and "replay check" in error
        assert _get(c, "/api/groups")["total"] == 4
        assert _get(c, f"/api/group/{groups[0].group_id}")["judge"]["name"] == "reference"
        assert _get(c, "/api/runs")["errors"] == 0


def test_groups_that_arrive_while_the_viewer_reads_are_listed(tmp_path):
    run_dir = _small_run(tmp_path)
    groups = [make_group(i) for i in range(6)]
    _store(run_dir, groups[:3])
    with TestClient(make_app(Viewer([RunView(run_dir, "live")]))) as c:
        assert _get(c, "/api/groups")["total"] == 3
        assert _get(c, "/api/groups?judged=yes")["total"] == 0
        _store(run_dir, groups[3:], labelled=groups[:2])
        # listed within seconds: the index is brought up to date at most FRESH_S apart
        deadline = time.monotonic() + 10
        while _get(c, "/api/groups")["total"] < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _get(c, "/api/groups")["total"] == 6
        assert _get(c, "/api/groups?judged=yes")["total"] == 2  # flags are read again


def test_requests_beside_the_indexer_never_fail(tmp_path):
    # LMDB refuses a second open of one store in a process: requests and the background
    # indexer take turns (this failed as HTTP 500s before they did).
    from concurrent.futures import ThreadPoolExecutor

    run_dir = _small_run(tmp_path)
    groups = [make_group(i) for i in range(40)]
    _store(run_dir, groups)
    with TestClient(make_app(Viewer([RunView(run_dir, "busy")]))) as c:
        paths = [f"/api/group/{g.group_id}" for g in groups] + ["/api/groups"] * 20
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda p: c.get(p).status_code, paths))
    assert codes == [200] * len(paths)


def test_a_folder_of_runs_serves_each_arm(tmp_path):
    for arm in ("a", "b"):
        (tmp_path / arm).mkdir()
        (tmp_path / arm / "config.yaml").write_text(f"name: {arm}\n")
    assert [v.label for v in run_views([tmp_path])] == [f"{tmp_path.name}/a",
                                                         f"{tmp_path.name}/b"]


def test_the_command_refuses_a_missing_run_directory(tmp_path):
    from autodidact.cli import main

    result = CliRunner().invoke(main, ["view", "--run-dir", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "no such run directory" in result.output


def test_summaries_survive_a_record_from_before_checksums(tmp_path):
    run_dir = _small_run(tmp_path)
    group = make_group(1)
    _store(run_dir, [group])
    store = Store(run_dir, map_size=1 << 24)
    with store.env.begin(write=True) as txn:
        old = GroupRecord.unpack(txn.get(group.group_id.encode(), db=store.db["index"]))
        txn.put(group.group_id.encode(), msgpack.packb(
            [old.seq, old.task_id, old.min_version, old.max_version, old.nbytes, old.judged,
             old.delivered, old.consumed, old.created]), db=store.db["index"])
    store.close()
    with TestClient(make_app(Viewer([RunView(run_dir, "old")]))) as c:
        page = _get(c, "/api/groups")
        assert page["total"] == 1 and page["groups"][0]["rollouts"] == \
            len(group.trajectories)
        assert json.loads(c.get(f"/api/group/{group.group_id}").text)["group_id"] == \
            group.group_id


# --- the run's password never leaves, in any encoding -------------------------------------------

# Quotes and backslashes (JSON and Python escape them), non-ASCII and an astral character
# (\uXXXX and surrogate pairs), %, +, space, /, :, @ (URL-encoded in redis.url), markup.
HOSTILE = "p\"w\\d'ö€😀 %41<&>/+:@x"


def _encodings(secret: str) -> dict[str, str]:
    """Every way the test knows a reply could carry `secret`: computed here, not by the
    viewer's scrubber."""
    import html
    import urllib.parse

    out = {"raw": secret, "json": json.dumps(secret)[1:-1],
           "json-utf8": json.dumps(secret, ensure_ascii=False)[1:-1],
           "json-twice": json.dumps(json.dumps(secret))[1:-1], "repr": repr(secret)[1:-1],
           "ascii": ascii(secret)[1:-1], "url": urllib.parse.quote(secret, safe=""),
           "url-path": urllib.parse.quote(secret), "url-plus": urllib.parse.quote_plus(secret),
           "url-lower": urllib.parse.quote(secret, safe="").lower(),
           "html": html.escape(secret),
           "charrefs": secret.encode("ascii", "xmlcharrefreplace").decode()}
    out.update({f"{k} in json": json.dumps(v)[1:-1] for k, v in list(out.items())})
    return out


class _CharTokenizer:
    """A tokenizer whose ids are code points: a rollout's tokens spell its text one
    character a token, so a secret in it is spread over many rows of the token view."""

    def decode(self, ids) -> str:
        return "".join(chr(int(i)) for i in ids)


def _planted_run(tmp_path: Path, password: str) -> tuple[Path, str]:
    """A run whose redis.url holds `password` (URL-encoded, as a URL must) and whose stored
    data quotes it raw and encoded everywhere a reply reads from: (run dir, a group id)."""
    import dataclasses
    import urllib.parse

    import numpy as np
    import yaml

    from protocol.messages import Step
    from questioning.task_store import TaskStore

    run_dir = tmp_path / "planted"
    run_dir.mkdir()
    url = f"redis://:{urllib.parse.quote(password, safe='')}@127.0.0.1:1/0"
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"name": "planted",
                                                         "redis": {"url": url}}))
    quoted = " | ".join(_encodings(password).values())
    base = make_group(3)
    text = f"say {password} now"
    ids = np.array([ord(c) for c in text], np.int32)
    prompt = len(text) - len(" now")  # the prompt holds the password, the policy says " now"
    mask = (np.arange(len(ids)) >= prompt).astype(np.uint8)
    traj = dataclasses.replace(
        base.trajectories[0], tokens=ids, logprobs=np.where(mask, -0.5, 0).astype(np.float32),
        versions=np.where(mask, 0, -1).astype(np.int32), action_mask=mask, prompt_len=prompt,
        experience_span=[0, prompt], experience_ids=[f"e-{password}"],
        info={"note": quoted, password: 1},
        steps=[Step(action=f"echo {password}", observation=quoted, start=prompt, end=len(ids),
                    thought=f"the password is {password}", info={"url": url})])
    task = dataclasses.replace(base.task, task_id=f"t-{password}", query=f"{'x' * 150}{password}")
    group = dataclasses.replace(base, group_id="g-planted", task=task, trajectories=[traj])
    _store(run_dir, [group], labelled=[group])
    with TaskStore(run_dir) as store:
        store.put(dataclasses.replace(task, task_id="syn/planted", source="synthetic",
                                      query=f"find {quoted}", meta={"exploration": password}))
    RunDir(run_dir).split.write_text(json.dumps({"train": [f"split-{password}"]}))
    return run_dir, group.group_id


def _leaks(text: str, password: str) -> list[str]:
    return [name for name, form in _encodings(password).items() if form in text]


def test_no_reply_carries_a_planted_password_in_any_encoding(tmp_path):
    import urllib.parse

    run_dir, gid = _planted_run(tmp_path, HOSTILE)
    view = RunView(run_dir, f"label {HOSTILE}")
    view._tokenizer = _CharTokenizer()
    assert HOSTILE in view.secrets()[0] or urllib.parse.unquote(view.secrets()[0]) == HOSTILE
    pw_in_url = urllib.parse.quote(HOSTILE, safe="")
    paths = ["/api/runs", "/api/run", "/api/curves", "/api/groups?per_page=200",
             f"/api/groups?task={urllib.parse.quote(HOSTILE[:3])}", f"/api/group/{gid}",
             f"/api/tokens/{gid}/0", "/api/tasks?per_page=200", "/api/tasks?source=original",
             # the password sent back: error lines that quote the request
             f"/api/run?run={pw_in_url}", f"/api/groups?outcome={pw_in_url}",
             f"/api/curves?runs={pw_in_url}"]
    # Path parameters too (TestClient decodes a path twice, so these need not arrive as the
    # password: no leak is asserted, not a mask).
    echoed = [f"/api/group/{pw_in_url}", f"/api/tokens/{pw_in_url}/0", f"/api/{pw_in_url}"]
    with TestClient(make_app(Viewer([view]))) as c:
        for path in paths + echoed:
            reply = c.get(path)
            assert reply.status_code < 500, (path, reply.text[:300])
            assert not _leaks(reply.text, HOSTILE), (path, _leaks(reply.text, HOSTILE))
            # decoded, too: the JSON parser undoes every escape the serialiser made
            assert not _leaks(json.dumps(reply.json(), ensure_ascii=False), HOSTILE), path
            # the plant reached the reply and was masked there (the token view: per row, below)
            assert "***" in reply.text or path in echoed or \
                path.startswith(f"/api/tokens/{gid}"), (path, reply.text[:300])
        # The token view spreads the password over one row per character: masked across rows.
        rows = c.get(f"/api/tokens/{gid}/0").json()["tokens"]
        joined = "".join(r["text"] for r in rows)
        assert joined == "say " + "*" * len(HOSTILE) + " now"
        # The group list cuts a query: the password it would have split is masked first.
        summary = c.get("/api/groups").json()["groups"][0]
        assert summary["query"].startswith("x" * 150) and HOSTILE[:2] not in summary["query"]
        assert c.get("/api/runs").json()["errors"] == 0


def test_the_planted_password_test_can_fail(tmp_path, monkeypatch):
    """Without the scrubber the same plant shows on the endpoints (the test above is not
    vacuous)."""
    from autodidact.viewer import data as viewer_data

    run_dir, gid = _planted_run(tmp_path, HOSTILE)
    view = RunView(run_dir, f"label {HOSTILE}")
    view._tokenizer = _CharTokenizer()
    monkeypatch.setattr(viewer_data.Scrubber, "__init__",
                        lambda self, secrets: setattr(self, "pattern", None))
    viewer_data.Scrubber.of.cache_clear()
    try:
        with TestClient(make_app(Viewer([view]))) as c:
            for path in ("/api/runs", "/api/run", "/api/curves", "/api/groups", "/api/tasks",
                         f"/api/group/{gid}"):
                assert _leaks(c.get(path).text, HOSTILE), path
            rows = c.get(f"/api/tokens/{gid}/0").json()["tokens"]
            assert HOSTILE in "".join(r["text"] for r in rows)
    finally:
        viewer_data.Scrubber.of.cache_clear()


def test_the_scrubber_matches_every_encoding_and_mixes_of_them():
    from autodidact.viewer.data import Scrubber

    scrub = Scrubber([HOSTILE]).text
    for name, form in _encodings(HOSTILE).items():
        masked = scrub(f"<{form}>")
        assert "***" in masked and not _leaks(masked, HOSTILE), (name, masked)
    # one secret, its first half JSON-escaped and the rest percent-encoded
    mixed = json.dumps(HOSTILE[:5])[1:-1] + "".join(f"%{b:02x}" for b in HOSTILE[5:].encode())
    assert scrub(f"<{mixed}>") == "<***>"
    assert scrub("nothing secret here") == "nothing secret here"
    assert Scrubber([]).text("p\"w") == "p\"w"


# --- the door: loopback only, unless --allow-remote, and then a token ----------------------------


def test_a_remote_host_is_refused_without_the_flag(tmp_path):
    from autodidact.cli import main
    from protocol.security import is_loopback_host as is_loopback

    for host in ("0.0.0.0", "::", "192.168.1.7", "example.org"):
        result = CliRunner().invoke(main, ["view", "--run-dir", str(tmp_path), "--host", host])
        assert result.exit_code != 0, host
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "--allow-remote" in lines[0] and host in lines[0], lines
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "10.0.0.1", "box.local"))


TOKEN = "s3cret-view-token"


def test_with_a_token_every_endpoint_refuses_a_request_without_it(tmp_path):
    run_dir = _small_run(tmp_path)
    group = make_group(5)
    _store(run_dir, [group])
    viewer = Viewer([RunView(run_dir, "small")])
    paths = ["/", "/static/app.js", "/static/app.css", "/static/vendor/uPlot.iife.min.js",
             "/api/runs", "/api/run", "/api/curves", "/api/groups",
             f"/api/group/{group.group_id}", f"/api/tokens/{group.group_id}/0", "/api/tasks",
             "/api/nothing", "/nothing"]
    with TestClient(make_app(viewer, TOKEN), follow_redirects=False) as c:
        refused = 0
        for path in paths:
            for headers, cookies, status in (
                    ({}, {}, 401), ({"Authorization": "Bearer wrong"}, {}, 403),
                    ({"Authorization": f"Basic {TOKEN}"}, {}, 403),
                    ({}, {"autodidact_view_token": "wrong"}, 403)):
                c.cookies.clear()
                c.cookies.update(cookies)
                reply = c.get(path, headers=headers)
                refused += 1
                assert reply.status_code == status, (path, headers, reply.status_code)
                line = reply.json()["error"] if path.startswith("/api") else reply.text
                assert line.startswith("refused:") and line.strip().count("\n") == 0, line
                assert TOKEN not in reply.text
            c.cookies.clear()
            for a_wrong in ("wrong", TOKEN + "x", ""):
                assert c.get(f"{path}?token={a_wrong}").status_code == 403
                refused += 1
        c.cookies.clear()
        # With it, as a header (scripts) or as the cookie the printed URL sets (a browser):
        # every path answers as it does on the loopback.
        for path in paths:
            want = 404 if "nothing" in path else 200
            assert c.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == want
        first = c.get(f"/?token={TOKEN}")
        assert first.status_code == 303 and first.headers["location"] == "/"
        cookie = first.headers["set-cookie"]
        assert f"autodidact_view_token={TOKEN}" in cookie and "HttpOnly" in cookie
        assert "samesite=strict" in cookie.lower()
        deep = c.get(f"/api/groups?per_page=1&token={TOKEN}")
        assert deep.status_code == 303 and deep.headers["location"] == "/api/groups?per_page=1"
        c.cookies.set("autodidact_view_token", TOKEN)
        for path in paths:
            assert c.get(path).status_code == (404 if "nothing" in path else 200), path
        runs = c.get("/api/runs").json()
        assert runs["refused"] == refused and runs["errors"] == 0  # counted, still serving


def test_the_loopback_without_the_flag_needs_no_token(tmp_path):
    with TestClient(make_app(Viewer([RunView(_small_run(tmp_path), "small")]))) as c:
        assert c.get("/").status_code == 200 and c.get("/api/runs").json()["refused"] == 0
