"""bench/call_formats.py on two eval run directories written as autodidact eval writes them."""

from __future__ import annotations

import json

import pytest

from bench.call_formats import main


def _eval_dir(root, name, rows, env="bfcl"):
    (root / name / "eval").mkdir(parents=True)
    path = root / name / "eval" / f"{env}-test-model-k2.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / name


def _row(task, category, rewards, steps, valid):
    return {"task_id": task, "category": category, "rewards": rewards, "steps": steps,
            "valid_steps": valid, "total_steps": sum(steps)}


def test_each_arm_and_the_paired_difference(tmp_path, capsys):
    a = _eval_dir(tmp_path, "a", [_row("e1", "base", [0.0, 0.0], [0, 0], 0),
                                  _row("e2", "long", [0.0, 0.0], [3, 1], 0)])
    b = _eval_dir(tmp_path, "b", [_row("e1", "base", [1.0, 0.0], [2, 2], 4),
                                  _row("e2", "long", [1.0, 1.0], [1, 1], 1),
                                  _row("e3", "long", [0.0, 0.0], [1, 0], 1)])
    out = tmp_path / "r.json"
    assert main(["--a", str(a), "--b", str(b), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m bench.call_formats --a ")
    assert result["a"]["reached_first_action"] == 0.5 and result["a"]["valid_action_rate"] == 0
    assert result["b"]["entries"] == 3 and result["b"]["best"] == pytest.approx(2 / 3)
    assert result["b"]["valid_action_rate"] == pytest.approx(6 / 7)
    assert result["b"]["categories"]["long"]["avg"] == 0.5
    diff = result["b_minus_a"]["avg"]
    assert diff["tasks"] == 2 and diff["diff"] == pytest.approx(0.75)  # e3: B only, unpaired
    assert result["b_minus_a"]["reached_first_action"]["diff"] == pytest.approx(0.5)


def test_a_directory_without_an_eval_says_what_to_run(tmp_path):
    with pytest.raises(SystemExit, match="run autodidact eval --env bfcl --split test"):
        main(["--a", str(tmp_path), "--b", str(tmp_path)])


def test_another_envs_evals_are_read_by_its_name(tmp_path):
    a = _eval_dir(tmp_path, "a", [_row("t1", "shop", [0.0, 1.0], [3, 4], 5)], env="shop")
    b = _eval_dir(tmp_path, "b", [_row("t1", "shop", [1.0, 1.0], [2, 2], 4)], env="shop")
    out = tmp_path / "r.json"
    assert main(["--a", str(a), "--b", str(b), "--env", "shop", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["env"] == "shop" and result["b_minus_a"]["avg"]["diff"] == pytest.approx(0.5)
    with pytest.raises(SystemExit, match="no files-test-model-k"):
        main(["--a", str(a), "--b", str(b), "--env", "files"])


def test_an_arm_may_be_its_results_file_with_a_line_a_kill_cut(tmp_path):
    rows = [_row("t1", "base", [0.0, 1.0], [3, 4], 5), _row("t2", "base", [1.0, 1.0], [2, 2], 4)]
    a = _eval_dir(tmp_path, "a", rows)
    kept = tmp_path / "kept.jsonl"
    kept.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1])[:30])
    out = tmp_path / "r.json"
    assert main(["--a", str(a), "--b", str(kept), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["b"]["entries"] == 1 and result["b"]["results"] == str(kept)
    assert result["b_minus_a"]["avg"]["tasks"] == 1
