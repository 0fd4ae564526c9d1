"""bench/training_success.py: windows of rollouts and the split of a change in training success
into the task mix and the policy, on hand-made episodes with known answers."""

from __future__ import annotations

import pytest

from bench.training_success import Episode, decompose, window_rows


def ep(version, task, difficulty, success, guided=False, neg_logprob=1.0, warm=False):
    return Episode(version=version, group_id=f"g{version}-{task}", task_id=task,
                   difficulty=difficulty, reference_len=int(difficulty), guided=guided,
                   success=success, neg_logprob=neg_logprob, invalid_share=0.0,
                   truncated=False, warmstarted=warm)


def test_a_fall_from_a_harder_mix_is_told_from_a_worse_policy():
    # Window 0: easy tasks (difficulty 1, all solved) and hard ones (3, none solved), half each.
    # Window 1: the same policy (same per-difficulty success) on a mix of 1 easy to 3 hard.
    early = [ep(0, f"e{i}", 1.0, True) for i in range(4)] + \
            [ep(1, f"h{i}", 3.0, False) for i in range(4)]
    late = [ep(2, "e0", 1.0, True)] + [ep(3, f"h{i}", 3.0, False) for i in range(3)]
    d = decompose(early + late, width=2)
    assert d["first"] == pytest.approx(0.5) and d["last"] == pytest.approx(0.25)
    # on the first window's mix the late policy does as well as the early one: the mix did it
    assert d["last_on_first_mix"] == pytest.approx(0.5)
    assert d["same_tasks"] == 4  # e0, h0, h1, h2
    assert d["same_tasks_first"] == d["same_tasks_last"] == pytest.approx(0.25)


def test_a_fall_on_the_same_tasks_is_the_policy():
    early = [ep(0, f"t{i}", 2.0, True) for i in range(4)]
    late = [ep(5, f"t{i}", 2.0, i < 1) for i in range(4)]
    d = decompose(early + late, width=5)
    assert d["last_on_first_mix"] == pytest.approx(0.25)  # no mix change to blame
    assert (d["same_tasks_first"], d["same_tasks_last"]) == (1.0, 0.25)


def test_guided_rollouts_are_left_out_of_the_decomposition_and_split_in_windows():
    eps = [ep(0, "a", 1.0, True, guided=True), ep(0, "b", 1.0, False),
           ep(1, "a", 1.0, True, neg_logprob=3.0), ep(1, "c", 1.0, True)]
    rows = window_rows(eps, width=1, lags={0: 0.0, 1: 2.0})
    assert [r["versions"] for r in rows] == ["0-0", "1-1"]
    assert rows[0]["success_guided"] == 1.0 and rows[0]["success_unguided"] == 0.0
    assert rows[1]["revisit_share"] == 0.5  # "a" was rolled out in window 0
    assert rows[1]["neg_logprob"] == pytest.approx(2.0) and rows[1]["lag_mean"] == 2.0
    assert decompose(eps, width=1)["first"] == 0.0  # the guided success in window 0 is not counted


def test_a_thin_last_window_is_not_taken_for_the_end_of_the_run():
    eps = [ep(v, f"t{v}-{i}", 1.0, True) for v in (0, 1) for i in range(4)]
    eps += [ep(2, "late", 1.0, False)]  # one group rolled out after the last update
    d = decompose(eps, width=1)
    assert d["first"] == d["last"] == 1.0


def test_tasks_the_warm_start_trained_on_are_told_apart():
    eps = [ep(0, "w", 1.0, True, warm=True), ep(0, "x", 1.0, False), ep(0, "y", 1.0, True)]
    (row,) = window_rows(eps, width=1, lags={})
    assert row["warmstarted_share"] == pytest.approx(1 / 3)
    assert row["success_warmstarted"] == 1.0 and row["success_other"] == 0.5


def test_a_run_without_the_warm_starts_task_list_says_nothing_about_it():
    (row,) = window_rows([ep(0, "a", 1.0, True, warm=None)], width=1, lags={})
    assert all(row[k] != row[k] for k in ("warmstarted_share", "success_warmstarted",
                                          "success_other"))  # NaN, not 0
