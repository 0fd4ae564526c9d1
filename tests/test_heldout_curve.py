"""bench/heldout_curve.py: reading the updates to a held-out level off a learning curve."""

from __future__ import annotations

import pytest

from bench.heldout_curve import ablation_curves, compare, show, updates_to_reach


def test_the_level_is_interpolated_between_evaluated_versions():
    points = {0: 0.40, 5: 0.50, 10: 0.60, 15: 0.55}
    assert updates_to_reach(points, 0.55) == pytest.approx(7.5)
    assert updates_to_reach(points, 0.40) == 0.0  # reached before any update
    assert updates_to_reach(points, 0.61) is None  # never reached


def test_a_curve_that_dips_is_credited_with_its_first_crossing():
    assert updates_to_reach({0: 0.5, 4: 0.3, 8: 0.7}, 0.6) == pytest.approx(7.0)
    assert updates_to_reach({0: 0.5, 4: 0.6, 8: 0.4}, 0.6) == pytest.approx(4.0)


# Two seeds whose warm-starts lie ten points apart, as the SmolLM2 seeds do.
SEEDS = {"grpo": {"seed 0": {0: 0.30, 5: 0.32, 15: 0.34}, "seed 1": {0: 0.40, 5: 0.41, 15: 0.44}},
         "ref": {"seed 0": {0: 0.30, 5: 0.34, 15: 0.35}, "seed 1": {0: 0.40, 5: 0.42, 15: 0.46}}}


def test_one_level_for_seeds_that_start_apart_is_never_reached_by_the_lower_one():
    result = compare(SEEDS, None)
    assert result["level"] == pytest.approx(0.39)
    assert result["updates_to_level"]["grpo"]["seed 0"] is None
    assert result["updates_to_level"]["ref"]["seed 1"] == 0.0  # reached before any update


def test_paired_by_seed_each_seed_has_its_own_level_and_ratio():
    result = compare(SEEDS, None, paired=True)
    assert result["level"] == {"seed 0": 0.34, "seed 1": 0.44}  # GRPO's final on each seed
    assert result["updates_to_level"]["grpo"] == {"seed 0": 15.0, "seed 1": 15.0}
    assert result["updates_to_level"]["ref"] == pytest.approx({"seed 0": 5.0, "seed 1": 10.0})
    assert result["ratio_to_first"]["ref"] == pytest.approx({"seed 0": 3.0, "seed 1": 1.5})
    assert "ref updates, paired: seed 0 3.00x, seed 1 1.50x (mean 2.25x)" in show(result)
    # the mean gain over versions 5 and 15: (2 + 4) / 2 and (1 + 4) / 2 points for GRPO
    assert result["mean_gain"]["grpo"] == pytest.approx({"seed 0": 0.03, "seed 1": 0.025})
    assert result["mean_gain"]["ref"] == pytest.approx({"seed 0": 0.045, "seed 1": 0.04})


def test_a_groups_gain_over_the_first_is_labelled_from_its_interval_over_seeds():
    # Three seeds, the second group's gain above the first's on every one (+1.0, +0.1 and
    # +2.0 points): the t-interval over three seeds spans 0, so no change.
    grpo = {"seed 0": {0: .30, 15: .32}, "seed 1": {0: .40, 15: .41}, "seed 2": {0: .5, 15: .5}}
    ref = {"seed 0": {0: .30, 15: .33}, "seed 1": {0: .40, 15: .411}, "seed 2": {0: .5, 15: .52}}
    result = compare({"grpo": grpo, "ref": ref}, None, paired=True)
    change = result["gain_vs_first"]["ref"]
    assert change["value"] == pytest.approx(0.0103, abs=1e-4) and change["seeds"] == 3
    assert change["low"] < 0 < change["high"] and change["label"] == "no change"
    assert "ref − grpo mean gain, paired by seed: +1.0 points (95% " in show(result)
    assert "over 3 seeds (t): no change" in show(result)
    # the same gain on every seed, well apart from the first group's: helps
    steady = {k: {0: c[0], 15: c[15] + 0.05} for k, c in grpo.items()}
    assert compare({"grpo": grpo, "steady": steady}, None, paired=True)[
        "gain_vs_first"]["steady"]["label"] == "helps"


def test_points_are_shown_with_their_intervals_where_records_were_kept(tmp_path):
    import json

    def cell(seed, outcomes):
        return {"arm": "+questioning", "seed": seed, "stamp": ["s"], "final": {"avg": 0.5},
                "warm": {"avg": 0.5}, "base": {}, "curve": {"0": 0.5, "5": 0.75, "15": 1.0},
                "outcomes": outcomes, "updates": 15, "seconds": 1.0, "run_dir": None}

    kept = {"split": "validation", "warm": {"a": "4/4", "b": "0/4"},
            "final": {"a": "4/4", "b": "4/4"}}
    path = tmp_path / "abl.json"
    path.write_text(json.dumps({"runs": [cell(0, kept), cell(1, {})]}))
    curves, intervals = ablation_curves(path, {"grpo": "+questioning"})
    assert curves["grpo"]["seed 0"] == {0: 0.5, 5: 0.75, 15: 1.0}
    assert set(intervals["grpo"]["seed 0"]) == {0, 15}  # version 5 kept no records
    assert intervals["grpo"]["seed 1"] == {}  # a cell made before records were kept
    # two tasks, each always or never solved: the draws' means are 0, 0.5, 1 (as by hand in
    # tests/test_intervals.py); after RL both always solved: no width
    assert intervals["grpo"]["seed 0"] == {0: [0.0, 1.0], 15: [1.0, 1.0]}
    result = {**compare(curves, None, paired=True), "intervals": intervals}
    assert "v0:50.0% (95% 0.0–100.0)  v5:75.0%  v15:100.0% (95% 100.0–100.0)" in show(result)


def test_a_runs_curve_points_have_intervals_from_its_records(tmp_path):
    import json

    from autodidact.heldout import curve_intervals, version_records_path
    from autodidact.resolve import resolve_config
    from protocol.config import dump_resolved
    from protocol.run_dir import RunDir

    rd = RunDir(tmp_path)
    rd.config.write_text(dump_resolved(resolve_config(None, ["eval.k=2"])))
    rd.summary.write_text(json.dumps({"success_warm": {"avg": 0.25},
                                      "success_rl": {"avg": 0.5, "split": "validation"},
                                      "learner": {"learner/version": 15}}))

    def write(path, solved):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"task_id": t, "rewards": r}) + "\n"
                                for t, r in solved.items()))

    write(rd.heldout_records("validation", "warm"), {"a": [1.0, 1.0], "b": [0.0, 0.0]})
    write(rd.heldout_records("validation", "rl"), {"a": [0.0, 0.0], "b": [0.0, 0.0]})
    write(version_records_path(tmp_path, 5, "validation"), {"a": [1.0, 1.0], "b": [1.0, 1.0]})
    assert version_records_path(tmp_path, 5, "validation").name == \
        "files-validation-version-5-k2.jsonl"
    found = curve_intervals(tmp_path, {0: 0.5, 5: 1.0, 10: 0.5, 15: 0.0})
    assert found == {0: [0.0, 1.0], 5: [1.0, 1.0], 15: [0.0, 0.0]}  # 10: no records kept


def test_paired_a_seed_missing_from_a_group_is_left_out_of_every_group():
    curves = {"grpo": {**SEEDS["grpo"], "seed 2": {0: 0.5, 15: 0.6}}, "ref": SEEDS["ref"]}
    result = compare(curves, None, paired=True)
    assert result["left_out"] == ["seed 2"]
    assert all(set(cs) == {"seed 0", "seed 1"} for cs in result["curves"].values())
    assert "left out, not in every group: seed 2" in show(result)


def test_paired_with_a_gain_the_level_is_each_seeds_start_plus_the_gain():
    result = compare(SEEDS, None, paired=True, gain=0.02)
    assert result["level"] == pytest.approx({"seed 0": 0.32, "seed 1": 0.42})
    assert result["updates_to_level"]["grpo"] == pytest.approx({"seed 0": 5.0,
                                                                "seed 1": 5 + 10 / 3})
    assert result["updates_to_level"]["ref"] == pytest.approx({"seed 0": 2.5, "seed 1": 5.0})


def test_a_curve_is_the_runs_own_points_and_the_kept_evaluations(tmp_path):
    import json

    from autodidact.heldout import curve

    (tmp_path / "summary.json").write_text(json.dumps({
        "success_warm": {"avg": 0.3}, "success_rl": {"avg": 0.5},
        "learner": {"learner/version": 15}}))
    (tmp_path / "heldout_curve.json").write_text(json.dumps({"5": 0.4}))
    # version 5 is read from the cache (nothing is evaluated); 20 is past the run's last
    assert curve(tmp_path, [5, 20]) == {0: 0.3, 5: 0.4, 15: 0.5}


def test_the_plot_draws_every_group_even_when_its_runs_kept_different_versions(tmp_path):
    from bench.heldout_curve import plot

    result = {"level": 0.45, "curves": {
        "grpo": {"a": {0: 0.3, 8: 0.4, 15: 0.45}, "b": {0: 0.32, 15: 0.44}},
        "composite": {"c": {0: 0.3, 8: 0.5, 15: 0.5}}}}
    path = plot(result, tmp_path / "curve.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_the_paired_plot_draws_the_change_since_each_seeds_start(tmp_path):
    from bench.heldout_curve import plot

    path = plot(compare(SEEDS, None, paired=True), tmp_path / "paired.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
