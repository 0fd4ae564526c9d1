"""bench/eval_noise.py: the noise of a held-out evaluation, read off its per-task records."""

from __future__ import annotations

import json

import pytest

from bench.eval_noise import noise, paired, show, successes


def write(path, rows):
    path.write_text("".join(json.dumps({"task_id": t, "rewards": r, "avg": 0}) + "\n"
                            for t, r in rows.items()))
    return path


def test_the_standard_errors_across_tasks_and_of_sampling(tmp_path):
    a = successes(write(tmp_path / "a.jsonl", {"t1": [1, 1, 0, 0], "t2": [1, 1, 1, 1]}))
    stats = noise(a)
    assert stats["avg"] == pytest.approx(0.75) and stats["k"] == 4
    assert stats["se_tasks"] == pytest.approx(0.25)  # per-task sd 0.354 over sqrt(2)
    # Only t1 is uncertain: 0.5 * 0.5 / (4 - 1) for its rate, over 2 tasks.
    assert stats["se_sampling"] == pytest.approx((0.25 / 3) ** 0.5 / 2)
    low, high = stats["ci"]
    assert low < 0.75 < high == 1.0  # t2 alone drawn twice (a quarter of draws) gives 1.0
    assert show("a", stats).startswith("a: avg@4 75.0% (95% ")


def test_a_pair_is_compared_task_by_task_on_the_tasks_both_have(tmp_path):
    a = successes(write(tmp_path / "a.jsonl", {"t1": [1, 1, 0, 0], "t2": [1, 1, 1, 1],
                                               "only_a": [0, 0, 0, 0]}))
    b = successes(write(tmp_path / "b.jsonl", {"t1": [1, 1, 1, 1], "t2": [1, 1, 1, 1]}))
    stats = paired(a, b)
    assert stats["tasks"] == 2 and stats["tasks_that_differ"] == 1
    assert stats["diff"] == pytest.approx(0.25) and stats["se_paired"] == pytest.approx(0.25)
    assert stats["se_sampling"] == pytest.approx((0.25 / 3) ** 0.5 / 2)
    # B is never below A, yet a quarter of the task draws hold t2 alone, where the two agree:
    # the paired interval starts at 0, so the reading is "no change".
    assert stats["ci"][0] == 0.0 and stats["ci"][1] > 0.25
    assert stats["label"] == "no change"
    assert "B - A +25.0 points (95% +0.0 to" in show("b_minus_a", stats)
    assert "(1 differ): no change; paired s.e. 25.00" in show("b_minus_a", stats)


def test_a_difference_on_many_tasks_is_labelled_from_its_paired_interval(tmp_path):
    tasks = {f"t{i}": [1, 0, 0, 0] for i in range(40)}
    a = successes(write(tmp_path / "a.jsonl", tasks))
    better = successes(write(tmp_path / "b.jsonl", {t: [1, 1, 1, 0] for t in tasks}))
    assert paired(a, better)["label"] == "helps" and paired(better, a)["label"] == "hurts"


def test_bad_input_names_the_file_and_line(tmp_path):
    bad = tmp_path / "eval.summary.json"
    bad.write_text('{"task_id": "t1", "rewards": [1]}\n{"avg": 0.4}\n')
    with pytest.raises(SystemExit, match=r"eval.summary.json:2: not a per-task record"):
        successes(bad)
    a = successes(write(tmp_path / "a.jsonl", {"t1": [1]}))
    b = successes(write(tmp_path / "b.jsonl", {"t2": [1]}))
    with pytest.raises(SystemExit, match="share no task"):
        paired(a, b)
