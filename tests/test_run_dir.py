"""The run directory's layout is named in one module, documented there as a tree, and the
writers use it."""

from __future__ import annotations

import inspect

import protocol.run_dir as run_dir_module
from protocol.run_dir import RunDir


def test_every_name_is_in_the_documented_tree():
    names = {k: v for k, v in vars(run_dir_module).items()
             if k.isupper() and isinstance(v, str)}
    assert len(names) > 20
    doc = run_dir_module.__doc__
    assert [k for k, v in names.items() if v not in doc] == []


def test_every_path_lies_in_the_run_directory(tmp_path):
    rd = RunDir(tmp_path)
    paths = [getattr(rd, name) for name, member in inspect.getmembers(RunDir)
             if isinstance(member, property)]
    paths += [rd.node_config("gpu1"), rd.node_pids("gpu1"), rd.log("actor-0"),
              rd.weights_file(42), rd.eval_results("files", "test", "model", 8)]
    assert len(paths) > 25 and all(p.is_relative_to(tmp_path) for p in paths)
    assert len(set(paths)) == len(paths)
    assert rd.weights_file(42).name == "v000042.safetensors"
    assert rd.eval_results("files", "test", "model", 8).name == "files-test-model-k8.jsonl"


def test_published_weights_are_listed_oldest_first(tmp_path):
    rd = RunDir(tmp_path)
    rd.weights.mkdir()
    for v in (10, 2, 7):
        rd.weights_file(v).write_bytes(b"")
    (rd.weights / "v000011.tmp").write_bytes(b"")  # a write in progress is not published
    assert [p.name for p in rd.published_weights()] == [
        "v000002.safetensors", "v000007.safetensors", "v000010.safetensors"]


def test_writers_use_the_layout(tmp_path):
    from actor.outbox import Outbox
    from autodidact.embedded_redis import EmbeddedRedis
    from protocol.weights import weights_path
    from questioning.factory import explorations_path, profile_path

    rd = RunDir(tmp_path)
    assert weights_path(tmp_path, 5) == rd.weights_file(5)
    assert Outbox(tmp_path, "actor-3").log_path.parent == rd.acks
    assert (explorations_path(tmp_path), profile_path(tmp_path)) == (rd.explorations,
                                                                     rd.profile)
    assert EmbeddedRedis(tmp_path).data_dir == rd.redis
