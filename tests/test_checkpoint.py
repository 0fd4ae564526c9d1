"""Checkpoints are verified before they are loaded and one good one is kept (issue 21, part 2):
a bit-flipped or cut-short latest.pt falls back to previous.pt with a warning; with no good
checkpoint the learner exits with one line and the supervisor does not restart it; a crash at
any point of a save leaves something loadable."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.checkpoint import (
    CUDA_RNG,
    CheckpointError,
    read_checkpoint,
    rng_states,
    save_checkpoint,
    set_rng_states,
)
from protocol.errors import EXIT_UNRECOVERABLE
from protocol.run_dir import RunDir

ROOT = Path(__file__).resolve().parents[1]


def state(updates: int) -> dict:
    torch.manual_seed(updates)
    return {"model": {"w": torch.randn(64, 64)}, "optimizer": {"state": {}, "param_groups": []},
            "scheduler": {}, "updates": updates, "version": updates, "consumed": [f"g{updates}"],
            **rng_states()}


def flip_bytes(path: Path, count: int = 64) -> None:
    """Flip ``count`` bytes in the middle of the file (inside the tensor data)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_saved_checkpoint_reads_back_and_the_one_before_is_kept(tmp_path):
    save_checkpoint(tmp_path, state(1))
    save_checkpoint(tmp_path, state(2))
    got, path = read_checkpoint(tmp_path)
    assert path == RunDir(tmp_path).checkpoint and got["updates"] == 2
    assert torch.equal(got["model"]["w"], state(2)["model"]["w"])
    assert torch.load(RunDir(tmp_path).previous_checkpoint, weights_only=True)["updates"] == 1
    assert read_checkpoint(tmp_path / "none") is None


def test_a_bit_flipped_latest_falls_back_to_the_previous_with_a_warning(tmp_path, caplog):
    save_checkpoint(tmp_path, state(1))
    save_checkpoint(tmp_path, state(2))
    flip_bytes(RunDir(tmp_path).checkpoint)
    # Without the digest, the flipped file loads: the damage is in tensor bytes.
    assert torch.load(RunDir(tmp_path).checkpoint, weights_only=True)["updates"] == 2
    with caplog.at_level(logging.WARNING, logger="learner.checkpoint"):
        got, path = read_checkpoint(tmp_path)
    assert path == RunDir(tmp_path).previous_checkpoint and got["updates"] == 1
    assert torch.equal(got["model"]["w"], state(1)["model"]["w"])
    assert "latest.pt: its sha256 is not one the learner wrote" in caplog.text
    assert "resuming from" in caplog.text and "at update 1" in caplog.text


def test_no_good_checkpoint_is_one_error_naming_the_files(tmp_path):
    save_checkpoint(tmp_path, state(1))
    save_checkpoint(tmp_path, state(2))
    rd = RunDir(tmp_path)
    with open(rd.checkpoint, "r+b") as f:
        f.truncate(1000)
    flip_bytes(rd.previous_checkpoint)
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and "latest.pt" in message and "previous.pt" in message
    assert "move the directory away" in message


def test_a_cut_short_checkpoint_without_digests_is_refused_not_a_bare_oserror(tmp_path):
    rd = RunDir(tmp_path)
    rd.checkpoints.mkdir()
    torch.save(state(3), rd.checkpoint)
    assert read_checkpoint(tmp_path)[0]["updates"] == 3  # an older run's: loads unverified
    with open(rd.checkpoint, "r+b") as f:
        f.truncate(os.path.getsize(rd.checkpoint) // 2)
    with pytest.raises(CheckpointError, match="latest.pt cannot be read"):
        read_checkpoint(tmp_path)


def test_the_rng_states_include_the_gpus_and_none_on_a_cpu_run(tmp_path):
    save_checkpoint(tmp_path, state(1))
    got, _ = read_checkpoint(tmp_path)
    assert {"torch_rng", "numpy_rng", "python_rng", CUDA_RNG} <= set(got)
    if not torch.cuda.is_initialized():  # a CPU run: no GPU generator to carry
        assert got[CUDA_RNG] == []


def test_a_checkpoint_without_the_gpu_key_still_loads_and_restores(tmp_path):
    old = state(4)
    del old[CUDA_RNG]  # written before the GPU generators were saved
    rd = RunDir(tmp_path)
    rd.checkpoints.mkdir()
    torch.save(old, rd.checkpoint)
    got, _ = read_checkpoint(tmp_path)
    expected = torch.rand(4)
    set_rng_states(got)
    assert torch.equal(torch.rand(4), expected)


def test_a_gpu_runs_rng_on_a_cpu_is_left_with_a_log_line(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    saved = {**rng_states(), CUDA_RNG: [torch.zeros(16, dtype=torch.uint8)]}
    with caplog.at_level(logging.INFO, logger="learner.checkpoint"):
        set_rng_states(saved)
    assert "CUDA RNG state of 1 GPU(s) and CUDA is not available here: not restored" \
        in caplog.text


def test_a_cpu_runs_rng_on_a_gpu_is_left_with_a_log_line(monkeypatch, caplog):
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    with caplog.at_level(logging.INFO, logger="learner.checkpoint"):
        set_rng_states({**rng_states(), CUDA_RNG: []})
        set_rng_states({k: v for k, v in rng_states().items() if k != CUDA_RNG})
        assert "no CUDA RNG state (a CPU run's)" in caplog.text
        assert "no CUDA RNG state (written before it was saved)" in caplog.text
        assert restored == []
        three = [torch.full((16,), i, dtype=torch.uint8) for i in range(3)]
        set_rng_states({**rng_states(), CUDA_RNG: three})  # saved on 3 GPUs, restored on 2
    assert len(restored) == 1 and [int(t[0]) for t in restored[0]] == [0, 1]
    assert "restoring the first 2" in caplog.text


# Runs only where CUDA is: `python -m pytest tests/test_checkpoint.py -k cuda -q -n0`.
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_draws_come_back_after_a_checkpoint_round_trip(tmp_path):
    saved = state(1)  # seeds every generator, the GPUs' too
    torch.rand(3, device="cuda")  # moved on from the seed: the state, not the seed, must return
    saved.update(rng_states())
    assert len(saved[CUDA_RNG]) == torch.cuda.device_count()
    expected = [torch.rand(8, device=f"cuda:{i}").cpu()
                for i in range(torch.cuda.device_count())]
    expected_cpu = torch.rand(8)
    save_checkpoint(tmp_path, saved)
    torch.rand(100, device="cuda")  # drawn past the checkpoint
    got, _ = read_checkpoint(tmp_path)
    assert all(not t.is_cuda for t in got[CUDA_RNG])  # loaded to the CPU, as set_rng_state wants
    set_rng_states(got)
    again = [torch.rand(8, device=f"cuda:{i}").cpu() for i in range(torch.cuda.device_count())]
    assert all(torch.equal(a, b) for a, b in zip(again, expected))
    assert torch.equal(torch.rand(8), expected_cpu)


@pytest.mark.parametrize("crash_after", ["digests", "moved_latest"])
def test_a_save_cut_short_at_any_step_leaves_a_loadable_checkpoint(tmp_path, monkeypatch,
                                                                    crash_after):
    save_checkpoint(tmp_path, state(1))
    save_checkpoint(tmp_path, state(2))
    rd = RunDir(tmp_path)
    real_replace = os.replace

    def crashing_replace(src, dst):
        real_replace(src, dst)
        step = {rd.checkpoint_digests: "digests", rd.previous_checkpoint: "moved_latest"}
        if step.get(Path(dst)) == crash_after:
            raise KeyboardInterrupt  # the process dies here

    monkeypatch.setattr(os, "replace", crashing_replace)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, state(3))
    monkeypatch.setattr(os, "replace", real_replace)
    got, path = read_checkpoint(tmp_path)
    # Before the move: the old latest (update 2); after it, latest.pt is missing and the
    # moved file, now previous.pt, is still update 2.
    assert got["updates"] == 2


@pytest.mark.slow
def test_a_learner_with_no_good_checkpoint_exits_unrecoverable_in_one_line(tmp_path,
                                                                          files_policy_path,
                                                                          redis_url):
    from protocol.config import RunConfig, dump_resolved

    cfg = RunConfig()
    cfg.model.path = files_policy_path
    cfg.redis.url, cfg.redis.prefix = redis_url, "ckpt-test"
    cfg.replay.address = f"ipc://{tmp_path}/nobody.sock"
    config = tmp_path / "config.yaml"
    config.write_text(dump_resolved(cfg))
    rd = RunDir(tmp_path)
    rd.checkpoints.mkdir()
    rd.checkpoint.write_bytes(b"PK\x03\x04 not really a checkpoint")
    proc = subprocess.run([sys.executable, "-m", "autodidact.cli", "learner", "--run-dir",
                           str(tmp_path), "-c", str(config), "--resume"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_UNRECOVERABLE, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("learner: no good checkpoint in") and "latest.pt" in last


class _Weights:
    """The model step's part in a resume: it takes the checkpoint's state (no model here)."""

    def __init__(self):
        self.loaded: list[int] = []

    def load_state(self, state: dict, path: Path) -> None:
        self.loaded.append(state["updates"])


def test_a_resume_onto_a_damaged_latest_says_so_in_the_runs_output(tmp_path):
    """The fallback reaches the run's own output (issue 56, part 6): the learner records it in
    metrics.jsonl, and the launcher's summary and progress lines name it with the updates
    lost; a resume from a good latest records nothing."""
    from autodidact.progress import checkpoint_fallbacks
    from autodidact.resolve import learner_settings
    from learner.learner import Learner
    from metrics.jsonl import MetricsWriter
    from protocol.config import RunConfig

    before = MetricsWriter(tmp_path, "learner", "learner")
    for updates in (24, 25, 26, 27):  # the run logged update 27 before it was killed
        before.log({"loss": 0.5, "updates": updates})
    before.close()
    save_checkpoint(tmp_path, state(25))
    save_checkpoint(tmp_path, state(50))

    def resume() -> list[int]:
        weights = _Weights()
        learner = Learner(learner_settings(RunConfig()), tmp_path, None, None, step=weights,
                          publisher=None)
        assert learner.resume()
        learner.metrics.close()
        return weights.loaded

    assert resume() == [50] and checkpoint_fallbacks(tmp_path) == []
    flip_bytes(RunDir(tmp_path).checkpoint)
    assert resume() == [25]
    (line,) = checkpoint_fallbacks(tmp_path)
    assert line.startswith("learner: checkpoints/latest.pt was damaged; resumed from "
                           "previous.pt at update 25: 2 updates lost (the last logged was 27)")
