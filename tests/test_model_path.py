"""A model path that holds no model is refused at once, naming the path, before any process
starts (issue 21: it used to fail after 15-33 s with a hub error from transformers)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from autodidact.cli import main
from inference.models import ModelNotFound, check_model_path, model_folder


def test_paths_that_hold_no_model_are_refused(tmp_path):
    with pytest.raises(ModelNotFound, match="does not exist"):
        check_model_path(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelNotFound, match="holds no config.json"):
        model_folder(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert model_folder(str(tmp_path)) == str(tmp_path)
    check_model_path("")  # the run's own tiny model
    check_model_path("smollm2-135m")  # a named model: resolved (and checked) when used


@pytest.mark.parametrize("command", [
    ["run", "--set", "model.path={bad}", "--run-dir", "{run}"],
    ["eval", "--model", "{bad}", "-k", "1", "--run-dir", "{run}"],
    ["explore", "--set", "model.path={bad}", "--run-dir", "{run}"],
])
def test_commands_refuse_a_bad_model_path_before_starting_anything(tmp_path, command):
    bad, run = tmp_path / "Qwen2.5-7B-Instruct", tmp_path / "run"
    argv = [a.format(bad=bad, run=run) for a in command]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert lines == [f"Error: model path '{bad}' does not exist: give a local Hugging Face "
                     "model folder or a named model (smollm2-135m)"]
    assert not (run / "redis").exists() and not (run / "replay.lmdb").exists()
