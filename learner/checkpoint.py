"""The learner's checkpoint: plain tensors only, verified before it is loaded, one good one kept.

    save_checkpoint(run_dir, state)
        torch.save -> checkpoints/latest.tmp, fsync, sha256
        digests.json <- the new digest, then those it listed for latest.pt and previous.pt
        latest.pt -> previous.pt; latest.tmp -> latest.pt
    read_checkpoint(run_dir)
        latest.pt, else previous.pt (with a warning): the first whose sha256 is in
        digests.json and that loads with weights_only=True

The digests are written before the files move, so whichever moment a crash picks, each file
on disk is either one the digest file knows or damaged. A damaged latest falls back to the
checkpoint before it, losing the updates between the two, never loading wrong weights; the
learner's hello then carries the older ledger, and replay serves the groups only the lost
checkpoint covered again (trained once more, never twice in the surviving weights). A run directory
from before digests existed has no digests.json: its checkpoint loads unverified, with a
warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import zipfile
from pathlib import Path

import numpy as np
import torch

from protocol.run_dir import RunDir

log = logging.getLogger(__name__)

CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "updates", "version", "consumed",
                   "torch_rng", "numpy_rng", "python_rng")
# Optional, so checkpoints written before it existed still load: the GPUs' generator states
# (an empty list from a CPU run).
CUDA_RNG = "cuda_rng"


# Checkpoints written before the RNG states were plain tensors hold numpy's as an ndarray.
# Rebuilding an ndarray runs no code from the file (torch documents this allowlist), so those
# still load, with weights_only=True all the same.
_NUMPY_GLOBALS = [getattr(np, "_core", getattr(np, "core", None)).multiarray._reconstruct,
                  np.ndarray, np.dtype, type(np.dtype(np.uint32))]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from (refused, not the expected content)."""


def rng_states() -> dict:
    """The RNG states as tensors, ints and lists only, so checkpoints load with
    ``weights_only=True`` (numpy's state holds an ndarray, which that refuses). ``cuda_rng``
    holds one state per visible GPU once CUDA is in use, else none (a CPU run)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"torch_rng": torch.get_rng_state(),
            "numpy_rng": [name, torch.from_numpy(keys.astype(np.int64)), int(pos),
                          int(has_gauss), float(gauss)],
            "python_rng": [version, list(internal), gauss_next],
            CUDA_RNG: cuda_rng_states()}


def cuda_rng_states() -> list[torch.Tensor]:
    """Each visible GPU's generator state; none when this process never initialised CUDA
    (asking would initialise it, taking GPU memory a CPU learner never uses)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return []
    return torch.cuda.get_rng_state_all()


def set_rng_states(state: dict) -> None:
    torch.set_rng_state(state["torch_rng"])
    name, keys, pos, has_gauss, gauss = state["numpy_rng"]
    keys = keys.numpy() if torch.is_tensor(keys) else keys
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python_rng"]
    random.setstate((version, tuple(internal), gauss_next))
    set_cuda_rng_states(state.get(CUDA_RNG))


def set_cuda_rng_states(saved: list | None) -> None:
    """Restore the GPUs' generators where both the checkpoint and this process have them; a
    checkpoint of a CPU run (or from before the key existed) on a GPU, or of a GPU run on a
    CPU, leaves them as seeded, with one log line saying so."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if saved is None:
        if available:
            log.info("the checkpoint holds no CUDA RNG state (written before it was saved): "
                     "the GPU generators start from their seed")
        return
    if not saved:
        if available:
            log.info("the checkpoint holds no CUDA RNG state (a CPU run's): the GPU generators "
                     "start from their seed")
        return
    if not available:
        log.info("the checkpoint holds the CUDA RNG state of %d GPU(s) and CUDA is not "
                 "available here: not restored", len(saved))
        return
    if len(saved) != available:
        log.info("the checkpoint holds the CUDA RNG state of %d GPU(s), this process sees %d: "
                 "restoring the first %d", len(saved), available, min(len(saved), available))
    # Applied when CUDA initialises, if it has not yet (torch queues the call).
    torch.cuda.set_rng_state_all(saved[:available])


def load_checkpoint(path: Path) -> dict:
    """Tensors and plain data only (``weights_only=True``): a checkpoint that would need any
    other object unpickled is refused, before anything in it runs."""
    try:
        # CPU first: the saved RNG state must stay a CPU ByteTensor (set_rng_state refuses a
        # CUDA one); load_state_dict moves model and optimizer tensors to the model's device.
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = f"it asks to unpickle {found.group(1)}" if found else str(exc).splitlines()[0]
        raise CheckpointError(
            f"refused to load {path}: not a plain tensor checkpoint ({what}); checkpoints are "
            "loaded with weights_only=True and never run code from the file") from None
    except (OSError, RuntimeError, EOFError, zipfile.BadZipFile) as exc:  # cut short, garbled
        raise CheckpointError(f"{path} cannot be read ({str(exc).splitlines()[0]})") from None
    missing = [k for k in CHECKPOINT_KEYS if k not in state] if isinstance(state, dict) \
        else list(CHECKPOINT_KEYS)
    if missing:
        raise CheckpointError(f"{path} is not a learner checkpoint: missing {missing}")
    return state


def file_digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            sha.update(chunk)
    return sha.hexdigest()


def save_checkpoint(run_dir: Path, state: dict) -> Path:
    """Write ``state`` as the run's latest checkpoint (see the module docstring); the one it
    replaces becomes previous.pt. Returns the latest checkpoint's path."""
    rd = RunDir(run_dir)
    rd.checkpoints.mkdir(parents=True, exist_ok=True)
    tmp = rd.checkpoint.with_suffix(".tmp")
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    # Carried over, not recomputed: a file damaged since it was written must stay unknown.
    known = [file_digest(tmp), *_listed_digests(rd)[:2]]
    digests_tmp = rd.checkpoint_digests.with_suffix(".tmp")
    digests_tmp.write_text(json.dumps({"sha256": known}))
    os.replace(digests_tmp, rd.checkpoint_digests)
    if rd.checkpoint.exists():
        os.replace(rd.checkpoint, rd.previous_checkpoint)
    os.replace(tmp, rd.checkpoint)
    return rd.checkpoint


def read_checkpoint(run_dir: Path) -> tuple[dict, Path] | None:
    """The newest good checkpoint and its path; None when the run has none. A damaged latest
    is skipped with a warning; CheckpointError (one line naming the files and what to do) when
    no checkpoint is good."""
    rd = RunDir(run_dir)
    candidates = [p for p in (rd.checkpoint, rd.previous_checkpoint) if p.exists()]
    if not candidates:
        return None
    known = set(_listed_digests(rd)) if rd.checkpoint_digests.exists() else None
    problems = []
    for path in candidates:
        try:
            if known is None:
                log.warning("%s has no digest (written before digests existed): loading it "
                            "unverified", path)
            elif file_digest(path) not in known:
                raise CheckpointError(f"{path}: its sha256 is not one the learner wrote "
                                      f"(damaged on disk)")
            state = load_checkpoint(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if problems:
            log.warning("%s; resuming from %s instead, at update %d: the updates after it are "
                        "lost, and replay serves the groups they trained on again",
                        problems[0], path, state["updates"])
        return state, path
    raise CheckpointError(f"no good checkpoint in {rd.checkpoints}: {'; '.join(problems)}; "
                          f"move the directory away to start from the warm-started policy")


def _listed_digests(rd: RunDir) -> list[str]:
    """digests.json's list, newest first; empty when it is missing or unreadable (an
    unreadable digest file vouches for nothing)."""
    try:
        listed = json.loads(rd.checkpoint_digests.read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [d for d in listed if isinstance(d, str)] if isinstance(listed, list) else []
