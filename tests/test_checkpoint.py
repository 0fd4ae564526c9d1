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

from learner.checkpoint import CheckpointError, read_checkpoint, rng_states, save_checkpoint
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
