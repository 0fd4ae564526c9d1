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


# --- bench/compare_arms.py: two settings over seeds, from their runs' own records -------------


def run_with_records(root, name, rows, split="validation", stage="rl"):
    from protocol.run_dir import RunDir

    run_dir = root / name
    path = RunDir(run_dir).heldout_records(split, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path, rows)
    return run_dir


def test_two_arms_compared_per_seed_and_over_seeds(tmp_path):
    from bench.compare_arms import main

    tasks = [f"t{i}" for i in range(40)]
    a = [run_with_records(tmp_path, f"a-s{s}", {t: [1, 0, 0, 0] for t in tasks})
         for s in range(3)]
    # B solves 3, 3 and 4 of 4 where A solves 1: +50, +50 and +75 points.
    b = [run_with_records(tmp_path, f"b-s{s}", {t: [1, 1, 1, int(s == 2)] for t in tasks})
         for s in range(3)]
    out = tmp_path / "cmp.json"
    main(["--a", *map(str, a), "--b", *map(str, b), "--json", str(out)])
    result = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in json"))
    assert [p["b_minus_a"]["label"] for p in result["pairs"]] == ["helps"] * 3
    seeds = result["over_seeds"]
    assert seeds["per_seed"] == pytest.approx([0.5, 0.5, 0.75])
    # every seed's 40 tasks pooled: 120 pairs, each task its seed's own
    assert seeds["pooled"]["tasks"] == 120 and seeds["pooled"]["label"] == "helps"
    assert seeds["pooled"]["diff"] == pytest.approx(0.5833, abs=1e-4)
    # the t-interval of three differences: mean +- 4.303 * sd 0.1443 / sqrt(3)
    assert seeds["mean"] == pytest.approx(0.5833, abs=1e-4) and seeds["t_label"] == "helps"
    assert seeds["t_ci"] == pytest.approx([0.5833 - 0.3586, 0.5833 + 0.3586], abs=1e-3)
    assert result["command"].startswith("python -m bench.compare_arms --a ")
    # one seed: a difference, no interval
    one = main(["--a", str(a[0]), "--b", str(b[0])])["over_seeds"]
    assert one["t_ci"] is None and one["t_label"] == "one seed: no interval"
    assert one["pooled"]["diff"] == pytest.approx(0.5) and one["pooled"]["tasks"] == 40


def test_compare_arms_reads_each_learners_updates_and_uninformative_share(tmp_path):
    from autodidact.experiments.pairing import learner_totals
    from bench.compare_arms import main
    from protocol.run_dir import RunDir

    a = run_with_records(tmp_path, "a", {"t1": [1, 0]})
    b = run_with_records(tmp_path, "b", {"t1": [1, 1]})
    steps = [{"role": "learner", "step": i, "learner/groups": 8,
              "learner/uninformative_groups": skipped} for i, skipped in enumerate([0, 4, 12])]
    steps.append({"role": "actor", "actor/groups": 3})  # another role's line: not counted
    write_lines(RunDir(b).metrics, steps)
    assert learner_totals(b) == {"updates": 3, "groups_trained": 24, "uninformative_groups": 16,
                                 "uninformative_share": 0.4}
    assert learner_totals(a)["uninformative_share"] is None  # no learner ran: no share
    result = main(["--a", str(a), "--b", str(b)])
    [pair] = result["pairs"]
    assert pair["b_learner"]["updates"] == 3 and pair["a_learner"]["updates"] == 0
    assert result["over_seeds"]["uninformative_share"] is None  # A has no share to compare
    write_lines(RunDir(a).metrics, steps[:2])  # 4 of 20 groups set aside: 0.2
    shares = main(["--a", str(a), "--b", str(b)])["over_seeds"]["uninformative_share"]
    assert shares["per_seed"] == pytest.approx([0.2]) and shares["t_ci"] is None


def write_lines(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_compare_arms_refuses_unmatched_or_unfinished_runs(tmp_path):
    from bench.compare_arms import main

    a = run_with_records(tmp_path, "a", {"t1": [1]})
    with pytest.raises(SystemExit, match="give one of each per seed"):
        main(["--a", str(a), str(a), "--b", str(a)])
    with pytest.raises(SystemExit, match="no per-task records of the rl stage on validation"):
        main(["--a", str(a), "--b", str(tmp_path / "never-ran")])


def test_fewer_groups_without_signal_reads_as_fewer_not_as_hurts():
    """The share of uninformative groups is better lower: its label names the direction."""
    from autodidact.experiments.pairing import share_change

    def pair(a: float, b: float) -> dict:
        return {"a_learner": {"uninformative_share": a}, "b_learner": {"uninformative_share": b}}

    fewer = share_change([pair(0.7, 0.5), pair(0.72, 0.49), pair(0.69, 0.52)])
    assert fewer["t_ci"][1] < 0 and fewer["t_label"] == "fewer"
    more = share_change([pair(0.5, 0.7), pair(0.49, 0.72), pair(0.52, 0.69)])
    assert more["t_label"] == "more"
    assert share_change([pair(0.5, 0.6), pair(0.6, 0.5), pair(0.55, 0.56)])["t_label"] == \
        "no change"
