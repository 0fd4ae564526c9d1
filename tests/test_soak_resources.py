"""The soak bench's resource audit (issue 56, part 7): RSS and descriptors read from /proc,
and growth judged between the window after the settling minutes and the run's last fifth,
leaving out a restarted role's first two minutes."""

from __future__ import annotations

import os

from bench.soak import proc_resources, resource_growth


def sample(t: float, rss: int, fds: int = 10, since_restart_s: float = 1e6,
           groups: int = 100) -> dict:
    return {"t": t, "roles": {"actor-0": {"rss_kib": rss, "fds": fds,
                                          "since_restart_s": since_restart_s}},
            "store": {"groups": groups, "bytes": 1000, "evicted": 0, "evicted_stale": 0}}


def test_this_process_resources_are_read_from_proc():
    got = proc_resources(os.getpid())
    assert got["rss_kib"] > 10_000 and 0 < got["anon_kib"] <= got["rss_kib"] and got["fds"] >= 3
    assert proc_resources(2 ** 22 + 12345) is None  # no such process


def test_flat_memory_passes_and_growth_past_the_limit_fails():
    # 60 minutes, sampled each minute; settle 10: windows 600-1200 s and 3000 s on.
    flat = [sample(60 * m, 1000 + (5 if m % 2 else 0)) for m in range(61)]
    got = resource_growth(flat, 60, 10, 0.10, 0)
    assert got["flat"] and abs(got["per_role"]["actor-0"]["rss_kib"]["growth"]) < 0.01
    leaking = [sample(60 * m, 1000 + 10 * m) for m in range(61)]
    got = resource_growth(leaking, 60, 10, 0.10, 0)
    assert not got["flat"] and got["max_growth"] > 0.10


def test_a_restarted_roles_first_minutes_are_left_out():
    # Killed at 3200 s: its samples while refilling its caches would read as a drop, and a
    # role killed early and measured from scratch as growth.
    samples = [sample(60 * m, 1000) for m in range(61)]
    for s in samples:
        if 3200 <= s["t"] < 3320:
            s["roles"]["actor-0"].update(rss_kib=100, since_restart_s=s["t"] - 3200)
    got = resource_growth(samples, 60, 10, 0.10, 0)
    assert got["per_role"]["actor-0"]["rss_kib"]["late"] == 1000 and got["flat"]


def test_the_store_must_reach_its_capacity_when_one_is_set():
    below = [sample(60 * m, 1000, groups=10 * m) for m in range(61)]
    assert not resource_growth(below, 60, 10, 0.1, 5000)["store"]["at_capacity"]
    assert resource_growth(below, 60, 10, 0.1, 600)["store"]["at_capacity"]


def test_a_soak_passes_only_with_nothing_lost_and_resources_flat():
    from bench.soak import passed

    clean = {"lost": 0, "duplicates": 0, "skipped": 0, "ledger_not_stored": 0,
             "checkpoint_fallbacks": 0, "faults": {},
             "resources": {"flat": True, "store": {"max_groups": 5000, "at_capacity": True}}}
    assert passed(clean)
    assert not passed({**clean, "lost": 1})
    assert not passed({**clean, "faults": {"checkpoints_damaged": 1}})  # no fallback seen
    assert not passed({**clean, "resources": {"flat": False, "store": {}}})
    assert not passed({**clean, "resources": {"flat": True, "store": {"max_groups": 5000,
                                                                     "at_capacity": False}}})
