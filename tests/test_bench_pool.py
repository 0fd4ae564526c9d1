"""bench/pool_vs_examples.py: the self-made pool beside the env's own training tasks.

Known tasks whose features are worked out by hand (every goal form a kind is read from), and a
run directory made in a fraction of a second: ten groups stored by the real replay server,
pushed out of creation order, with outcomes chosen so every success count is known.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers_replay import make_group

from bench import pool_vs_examples as pool
from protocol import codec
from protocol.config import ReplayConfig
from protocol.messages import Task
from protocol.transport import Incoming
from questioning.task_store import TaskStore
from replay.server import ReplayServer


def task(task_id: str, query: str, goal, reference: list[str]) -> Task:
    return Task(task_id=task_id, env="shop", query=query, seed=1, goal=goal,
                reference=reference, source="synthetic" if task_id[0] == "s" else "original")


HAND = [  # kind, calls, conditions, entities, query words in the comments
    task("h0", "move a.md into b", {"all": [{"file": ["b", "a.md"]}, {"absent": ["a.md"]}]},
         ["mv a.md b"]),  # state, 1, 2, 2 (a.md b), 4
    task("h1", "show the stock of pipe", {"all": [{"response": "pipe 3"}]},
         ["stock pipe"]),  # read, 1, 1, 1, 5
    task("h2", "reserve 2 nut for order o1 and then cancel order o1",
         {"all": [{"event": "reserve o1 nut 2"}, {"event": "cancel o1"}]},
         ["reserve o1 nut 2", "cancel o1"]),  # event, 2, 2, 2 (o1 nut; 2 is a number), 11
    task("h3", "make b2 4", {"b2": 4}, []),  # not {"all": ...}: state, 0, 1, 0, 3
]
MADE = [
    task("s0", "make counter a1 5", {"all": [["a1", 5]]},
         ["new a1", "add a1 2", "add a1 3", "drop b1"]),  # state, long (a1 thrice), 4 calls
    task("s1", "make a1 5 and show a1", {"all": [{"response": "a1 5"}, ["a1", 5]]},
         ["new a1", "add a1 5", "add b1 1", "add c1 1", "show a1"]),  # read, long, 5 calls
    task("s2", "add 1 to a1", {"all": [{"event": "add a1 1"}, {"response": "r"}]},
         ["add a1 1"]),  # event (event beats response), 1 call
]
BY_ID = {t.task_id: t for t in HAND + MADE}

# (task, created_at, outcomes) in push order; the earliest is pushed last
GROUPS = [("h0", 105, [1, 1]), ("h1", 101, [1, 0]), ("h2", 102, [1, 1, 1, 0]),
          ("s0", 103, [0, 0]), ("s0", 104, [1, 0]), ("s1", 106, [0, 0, 0]),
          ("s2", 107, [1, 1]), ("h0", 108, [0, 0]), ("h3", 109, [1]),
          ("s1", 100, [1, 0, 0, 0])]


def test_kind_comes_from_the_goal():
    assert pool.goal_kind({"all": [{"file": ["a"]}]}) == "state"
    assert pool.goal_kind({"all": [["a1", 5]]}) == "state"  # a condition that is no dict
    assert pool.goal_kind(["b2", 4]) == "state" and pool.goal_kind({}) == "state"
    assert pool.goal_kind({"all": [{"file": ["a"]}, {"response": "x"}]}) == "read"
    assert pool.goal_kind({"all": [{"response": "x"}, {"event": "y"}]}) == "event"
    assert pool.goal_kind({"all": [{"event": "y"}]}) == "event"
    assert [pool.features(t)["kind"] for t in HAND + MADE] == \
        ["state", "read", "event", "state", "state", "read", "event"]
    assert [pool.features(t)["long"] for t in HAND + MADE] == \
        ["no", "no", "no", "no", "yes", "yes", "no"]


def test_the_other_features_of_each_task():
    got = [tuple(pool.features(t)[k] for k in pool.NUMERIC) for t in HAND + MADE]
    assert got == [(1, 2, 2, 4), (1, 1, 1, 5), (2, 2, 2, 11), (0, 1, 0, 3),
                   (4, 1, 2, 4), (5, 2, 3, 6), (1, 2, 1, 4)]


def test_buckets():
    assert [pool.bucket("calls", n) for n in range(8)] == \
        ["0", "1", "2", "3", "4", "5+", "5+", "5+"]
    assert [pool.bucket("conditions", n) for n in (0, 3, 4, 9)] == ["0", "3", "4+", "4+"]
    assert [pool.bucket("query_words", n) for n in (0, 3, 4, 5, 6, 8, 10, 11, 15, 16, 40)] == \
        ["0-3", "0-3", "4-5", "4-5", "6-7", "8-10", "8-10", "11-15", "11-15", "16+", "16+"]


def test_distance_is_0_for_the_same_pool_and_1_for_disjoint_ones():
    assert pool.tv_distance({"a": 2, "b": 2}, {"a": 1, "b": 1}) == 0
    assert pool.tv_distance({"a": 3}, {"b": 1, "c": 5}) == 1
    assert pool.tv_distance({"a": 1}, {}) is None
    same = pool.compare(HAND, HAND)["distance"]
    assert set(same.values()) == {0}
    apart = pool.compare(HAND, MADE)
    assert apart["distance"]["tools"] == pytest.approx(1)  # no tool in common
    assert apart["distance"]["kind"] == pytest.approx(1 / 6)  # 2/4 1/4 1/4 vs thirds
    assert apart["distance"]["calls"] == pytest.approx(2 / 3)
    assert apart["distance"]["long"] == pytest.approx(2 / 3)
    assert apart["biggest"] == "tools"


def test_pool_shares_and_means():
    hand, made = (pool.pool_features(p) for p in (HAND, MADE))
    assert hand["kind"]["shares"] == {"state": 0.5, "read": 0.25, "event": 0.25}
    assert hand["calls"]["counts"] == {"0": 1, "1": 2, "2": 1, "3": 0, "4": 0, "5+": 0}
    assert (hand["calls"]["mean"], made["calls"]["mean"]) == (1, pytest.approx(10 / 3))
    assert hand["entities"]["mean"] == 5 / 4 and made["long"]["mean"] == pytest.approx(2 / 3)
    assert made["tools"]["shares"] == {"add": 1.0, "drop": pytest.approx(1 / 3),
                                       "new": pytest.approx(2 / 3),
                                       "show": pytest.approx(1 / 3)}
    empty = pool.pool_features([])
    assert empty["tasks"] == 0 and empty["calls"]["mean"] is None


def make_run(root: Path) -> Path:
    (root / "policy_init").mkdir(parents=True)
    (root / "config.yaml").write_text("name: pool\nenv:\n  name: shop\n")
    (root / "policy_init" / "warmstart_tasks.json").write_text(json.dumps(["h0", "s1"]))
    with TaskStore(root) as store:
        store.put_many(MADE)
    groups = []
    for i, (task_id, created, outcomes) in enumerate(GROUPS):
        group = make_group(i, group_id=f"g{i}")
        template = group.trajectories[0]
        group.trajectories = [dataclasses.replace(template, traj_id=f"t{j}", reward=float(ok),
                                                  success=bool(ok))
                              for j, ok in enumerate(outcomes)]
        group.task, group.created_at = BY_ID[task_id], float(created)
        groups.append(group)
    server = ReplayServer(root, ReplayConfig(), "tcp://127.0.0.1:*")
    try:
        server.handle([Incoming([], g.group_id, msg=g, body=codec.encode_body(g))
                       for g in groups])
    finally:
        server.close()
    return root


def rate(row: dict) -> tuple[int, int, int]:
    return row["groups"], row["successes"], row["rollouts"]


def test_success_per_pool_and_bucket(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path / "run")
    monkeypatch.setattr(pool, "train_tasks", lambda _: ("shop", HAND))
    out = tmp_path / "pool.json"
    pool.main([str(run), "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["command"] == f"python -m bench.pool_vs_examples {run} --json {out}"
    mine = result["runs"][str(run)]
    assert mine["pools"]["self-made"]["tasks"] == 3 and mine["pools"]["hand-written"]["tasks"] == 4
    s = mine["success"]
    assert (s["groups"], s["early_groups"]) == (10, 1)
    hand, made = s["all"]["hand-written"], s["all"]["self-made"]
    assert rate(hand["overall"]) == (5, 7, 11) and hand["overall"]["tasks"] == 4
    assert {b: rate(r) for b, r in hand["kind"].items()} == \
        {"state": (3, 3, 5), "read": (1, 1, 2), "event": (1, 3, 4)}
    assert {b: rate(r) for b, r in hand["calls"].items()} == \
        {"0": (1, 1, 1), "1": (3, 3, 6), "2": (1, 3, 4)}
    assert {b: rate(r) for b, r in hand["example"].items()} == {"yes": (2, 2, 4), "no": (3, 5, 7)}
    assert rate(made["overall"]) == (5, 4, 13)
    assert made["overall"]["success"] == pytest.approx(4 / 13)
    assert {b: rate(r) for b, r in made["kind"].items()} == \
        {"state": (2, 1, 4), "read": (2, 1, 7), "event": (1, 2, 2)}
    assert {b: rate(r) for b, r in made["calls"].items()} == \
        {"1": (1, 2, 2), "4": (2, 1, 4), "5+": (2, 1, 7)}
    assert {b: rate(r) for b, r in made["long"].items()} == {"yes": (4, 2, 11), "no": (1, 2, 2)}
    # the first tenth by creation time is the group pushed last (created first)
    early = s["early"]
    assert rate(early["self-made"]["overall"]) == (1, 1, 4)
    assert early["hand-written"]["overall"]["success"] is None
    assert mine["distance"]["tools"] == pytest.approx(1) and mine["biggest"] == "tools"
    assert mine["damaged_groups"] == 0
    printed = capsys.readouterr().out
    assert "| calls 5+ | 0.0% (0) | 33.3% (1) | |" in printed
    assert "| calls 4 | - | 25.0% (1/4, 2 groups) | - | - |" in printed
    assert "biggest mismatch: tools (TV 1.00)" in printed


def test_several_runs_are_pooled(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path / "run")
    monkeypatch.setattr(pool, "train_tasks", lambda _: ("shop", HAND))
    result = pool.main([str(run), str(run)])
    pooled = result["pooled"]
    assert pooled["pools"]["hand-written"]["tasks"] == 8
    assert rate(pooled["success"]["all"]["self-made"]["overall"]) == (10, 8, 26)
    assert pooled["success"]["early_groups"] == 2
    assert pooled["distance"] == pytest.approx(result["runs"][str(run)]["distance"])
    assert "pooled over 2 runs" in capsys.readouterr().out


def test_hand_written_pool_is_the_configured_envs_train_split(tmp_path, monkeypatch):
    from environments.shop import ShopEnv

    asked = []
    real = ShopEnv.tasks

    def tasks(self, split):
        asked.append(split)
        return real(self, split)

    monkeypatch.setattr(ShopEnv, "tasks", tasks)
    (tmp_path / "config.yaml").write_text("name: pool\nenv:\n  name: shop\n")
    env, found = pool.train_tasks(tmp_path)
    assert env == "shop" and asked == ["train"]
    assert found and {(t.split, t.source) for t in found} == {("train", "original")}
    data = pool.load_run(tmp_path)  # no replay store, no tasks.lmdb: said, not raised
    assert data.made == [] and data.groups == [] and "no replay store yet" in data.error
