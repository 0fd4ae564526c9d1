"""A user's environment outside the package (issue 22): ``autodidact tasks verify`` imports the
plugin module the run's config names (it used to answer ``unknown_env`` for every task), and
eval result files carry no colon from ``pkg.module:name``."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from environments.files import build_tasks
from protocol.run_dir import RunDir
from questioning.task_store import TaskStore

REPO = Path(__file__).resolve().parents[1]
PLUGIN = '''
from environments import register_env
from environments.files import FilesEnv


@register_env("myfiles")
class MyFiles(FilesEnv):
    """The files env under another name, as a user's module would register it."""
'''


def verify(run_dir: Path, plugin_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_dir), str(REPO)])}
    return subprocess.run([sys.executable, "-m", "autodidact.cli", "tasks", "verify",
                           "--run-dir", str(run_dir), *args], capture_output=True, text=True,
                          env=env, timeout=120, cwd=REPO)


@pytest.mark.timeout(300)
def test_tasks_verify_imports_the_plugin_its_config_names(tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "user_envs.py").write_text(PLUGIN)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    tasks = [dataclasses.replace(t, env="myfiles") for t in build_tasks(num_worlds=2)
             if t.reference][:4]
    with TaskStore(run_dir) as store:
        store.put_many(tasks)
    config = tmp_path / "user.yaml"
    config.write_text("env:\n  name: user_envs:myfiles\n")

    named = verify(run_dir, plugins, "-c", str(config))
    assert named.returncode == 0, named.stdout + named.stderr
    assert "verified 4/4 tasks" in named.stdout and "unknown_env" not in named.stdout

    # Without -c, the run directory's own config says which env made the tasks.
    RunDir(run_dir).config.write_text(config.read_text())
    own = verify(run_dir, plugins)
    assert own.returncode == 0 and "verified 4/4 tasks" in own.stdout, own.stdout + own.stderr

    missing = verify(run_dir, plugins, "-c", str(config), "--set", "env.name=nowhere:myfiles")
    assert missing.returncode != 0 and "nowhere" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_eval_result_files_have_no_colon_from_a_plugin_name(tmp_path):
    path = RunDir(tmp_path).eval_results("user_envs:myfiles", "test", "ground-truth", 4)
    assert path.name == "user_envs_myfiles-test-ground-truth-k4.jsonl"
    assert RunDir(tmp_path).eval_results("files", "test", "policy", 1).name == \
        "files-test-policy-k1.jsonl"


def test_a_synthesized_task_names_its_plugin_for_every_command_that_replays_it(tmp_path):
    """Rule extraction replays a task in its env; in a fresh process that has never imported
    the plugin, ``meta.env_spec`` is what finds it."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "user_envs.py").write_text(PLUGIN)
    code = (
        "from environments.files import build_tasks\n"
        "from navigating.extraction import _run\n"
        "import dataclasses\n"
        "t = next(t for t in build_tasks(num_worlds=1) if t.reference)\n"
        "named = dataclasses.replace(t, env='myfiles', meta={'env_spec': 'user_envs:myfiles'})\n"
        "bare = dataclasses.replace(t, env='myfiles', meta={})\n"
        "print(_run(bare, t.reference) is None, _run(named, t.reference).reward)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugins), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, cwd=REPO)
    assert out.stdout.split() == ["True", "1.0"], out.stdout + out.stderr
