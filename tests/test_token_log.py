"""The token log: the learner keeps the log-prob it scored each token at, aligned with the
trajectory as the actor sent it, for the newest groups it trained (learner/token_log.py).

Real rollouts of a tiny model, a real learner update on them (real Redis control plane, no
replay: groups are handed to ``Learner.update``): the first update starts from the weights
that sampled, so its recorded log-probs are the sampler's wherever the learner saw the tokens
as the sampler did.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers_rollouts import guided_files_groups, learner_for
from test_context import CORPUS
from transformers import AutoModelForCausalLM

from environments.files import FilesEnv
from episodes.context import ContextManager
from episodes.rollout import (
    RolloutSettings,
    rollout,
    start_episodes,
    to_groups,
)
from inference.backends.base import SamplingParams
from inference.backends.hf import TransformersBackend
from inference.codecs import make_codec
from inference.tiny_model import make_tiny_chat_model
from learner.batching import build_batch, strip_experience, to_trajectories
from learner.logprobs import token_logprobs
from learner.token_log import TokenLog, read_token_log
from metrics.jsonl import read_metrics
from protocol.run_dir import RunDir

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def guided_groups(files_policy_path):
    """Two groups of 4 from the files policy, rollouts 1 and 3 with injected experience."""
    return guided_files_groups(files_policy_path)


@pytest.fixture(scope="module")
def chat_path(tmp_path_factory) -> str:
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("chat") / "m", CORPUS))


@pytest.fixture(scope="module")
def windowed_group(chat_path):
    """One group of 3 six-turn episodes whose context was rebuilt (env.context=window keep 2),
    sampled by the transformers engine (as tests/test_context.py)."""
    with TransformersBackend(chat_path, device="cpu") as backend:
        codec = make_codec(backend.tokenizer)
        settings = RolloutSettings(max_turns=6, max_context=4096, max_action_tokens=6,
                                   constrained=False, context=ContextManager("window", keep=2))
        episodes = start_episodes(FilesEnv().tasks("train")[:1], 3, FilesEnv, codec)
        rollout(backend, episodes, codec, SamplingParams(
            temperature=1.0, max_new_tokens=6, seed=7, stop_token_ids=(codec.eoa_id,),
            logprobs_mode="raw"), settings)
    for i, ep in enumerate(episodes):
        ep.reward = float(i)
    [group] = to_groups(episodes, 3, "a", 0.0)
    assert all(t.contexts for t in group.trajectories)
    return group


def _learner(model_path, run_dir, control, **sets):
    return learner_for(model_path, run_dir, control, None, **sets)


def _check_sampler(recorded: dict, group, tolerance: float = TOLERANCE) -> None:
    """Recorded = the sampler's at every generated token, NaN at every other."""
    assert len(recorded["logprobs"]) == len(group.trajectories)
    for traj, got in zip(group.trajectories, recorded["logprobs"]):
        assert got.dtype == np.float32 and got.shape == (len(traj.tokens),)
        gen = traj.action_mask.astype(bool)
        assert gen.any() and np.isnan(got[~gen]).all()
        diff = np.abs(got[gen] - traj.logprobs[gen]).max()
        assert diff < tolerance, f"{traj.traj_id}: learner and sampler differ by {diff:.2e}"


# --- (a) the learner's log-probs are the sampler's, in the trajectory's own positions -------


@pytest.mark.parametrize("sets", [{}, {"minibatches": 2}, {"micro_batch_tokens": 200},
                                  {"accumulation": 3}],
                         ids=["one-step", "proximal-ahead", "token-budget", "accumulation"])
def test_the_first_update_records_the_samplers_log_probs(files_policy_path, tmp_path, control,
                                                         guided_groups, sets):
    """Experience kept in context: every row is its trajectory as sampled. However the rows
    fall to minibatches and micro-batches, each comes back to its own trajectory."""
    learner = _learner(files_policy_path, tmp_path, control, experience__train_context="keep",
                       **sets)
    learner.update(guided_groups)
    learner.close()
    for group in guided_groups:
        got = read_token_log(tmp_path, group.group_id)
        assert got["version"] == 0
        _check_sampler(got, group)
    row = read_metrics(tmp_path, "learner")[-1]
    assert row["learner/token_log_errors"] == 0


def test_the_check_can_fail_on_moved_weights(files_policy_path, tmp_path, control,
                                            guided_groups):
    """After a large step the learner scores the same tokens differently: the comparison
    above is not vacuous. The file is rewritten, with the version the second update began at."""
    learner = _learner(files_policy_path, tmp_path, control, experience__train_context="keep",
                       lr=0.05)
    learner.update(guided_groups)
    learner.update(guided_groups[:1])
    learner.close()
    got = read_token_log(tmp_path, guided_groups[0].group_id)
    assert got["version"] == 1
    with pytest.raises(AssertionError, match="differ"):
        _check_sampler(got, guided_groups[0])


# --- (b) stripped experience and rebuilt contexts map back ---------------------------------


def test_stripped_experience_maps_back_past_the_span(files_policy_path, tmp_path, control,
                                                     guided_groups):
    """experience.train_context=discard: a guided row is scored without its experience span,
    so its tokens sit ``len(span)`` positions earlier in the row; the log keeps them at the
    trajectory's own positions, NaN over the span."""
    learner = _learner(files_policy_path, tmp_path, control)
    learner.update(guided_groups)
    learner.close()
    model = AutoModelForCausalLM.from_pretrained(files_policy_path, dtype=torch.float32).eval()
    moved = 0.0
    for group in guided_groups:
        got = read_token_log(tmp_path, group.group_id)["logprobs"]
        for traj, lp in zip(group.trajectories, got):
            gen = traj.action_mask.astype(bool)
            assert np.isnan(lp[~gen]).all() and not np.isnan(lp[gen]).any()
            if not traj.experience_span:  # unguided: the sampler's
                assert np.abs(lp[gen] - traj.logprobs[gen]).max() < TOLERANCE
                continue
            start, end = traj.experience_span
            assert end > start
            stripped = strip_experience(traj)
            ids = torch.from_numpy(stripped.tokens)[None]
            with torch.no_grad():
                want = token_logprobs(model, ids, torch.ones_like(ids))[0].numpy()
            where = np.flatnonzero(gen)
            assert (where >= end).all()
            diff = np.abs(lp[where] - want[where - (end - start)]).max()
            assert diff < TOLERANCE, f"stripped row mapped back wrong: {diff:.2e}"
            moved = max(moved, float(np.abs(lp[gen] - traj.logprobs[gen]).max()))
    # The experience did change what the model thought of the actions: not the sampler's.
    assert moved > 10 * TOLERANCE


def test_rebuilt_contexts_map_back_to_one_trajectory(chat_path, tmp_path, control,
                                                     windowed_group):
    """One row per context; each context's log-probs land on its own span of the
    trajectory's tokens, and they are the sampler's (taken in that very context)."""
    batch, stats = build_batch([windowed_group], 0)
    assert stats["rows"] > len(windowed_group.trajectories)
    learner = _learner(chat_path, tmp_path, control)
    learner.update([windowed_group])
    learner.close()
    got = read_token_log(tmp_path, windowed_group.group_id)
    assert got["version"] == 0
    _check_sampler(got, windowed_group)


def test_source_positions_name_the_tokens_each_row_holds(guided_groups, windowed_group):
    """Every row token is the trajectory token its source position names (split contexts,
    stripped spans, rows cut by max_len); positions past a cut come back NaN."""
    for groups, max_len in (([windowed_group], None), (guided_groups, None),
                            (guided_groups, 20)):
        batch, _ = build_batch(groups, 0, max_len=max_len)
        src = batch.source_positions
        assert src.shape == batch.input_ids.shape
        assert ((src >= 0) == batch.attention_mask.bool()).all()
        for r in range(len(src)):
            traj = groups[int(batch.group_index[r])].trajectories[int(batch.traj_index[r])]
            real = src[r] >= 0
            assert (torch.from_numpy(traj.tokens)[src[r][real]] == batch.input_ids[r][real]).all()
        ones = np.where(batch.action_mask.numpy() > 0, 1.0, np.nan)
        back = to_trajectories(batch, ones, groups)
        for group, per_traj in zip(groups, back):
            for traj, values in zip(group.trajectories, per_traj):
                gen = traj.action_mask.astype(bool)
                in_row = np.ones(len(gen), dtype=bool)
                if max_len is not None:  # the positions left after stripping, then cut
                    left = np.delete(np.arange(len(gen)), range(*(traj.experience_span
                                                                   or (0, 0))))
                    in_row[:] = False
                    in_row[left[:max_len]] = True
                    assert (gen & ~in_row).any()  # the cut did take generated tokens
                assert (values[gen & in_row] == 1).all()
                assert np.isnan(values[~(gen & in_row)]).all()


# --- (c) pruning, (d) off, (e) failures -----------------------------------------------------


def _groups(*ids):
    return [SimpleNamespace(group_id=i) for i in ids]


def _logprobs(n):
    return [[np.full(3, float(k), dtype=np.float32), np.full(5, np.nan, dtype=np.float32)]
            for k in range(n)]


def test_only_the_newest_files_are_kept(tmp_path):
    folder = RunDir(tmp_path).learner_tokens
    log = TokenLog(tmp_path, keep=3)
    for k in range(5):
        log.write(_groups(f"g{k}"), _logprobs(1), version=k)
    assert sorted(p.name for p in folder.iterdir()) == ["g2.npz", "g3.npz", "g4.npz"]
    got = read_token_log(tmp_path, "g4")
    assert got["version"] == 4 and [a.shape for a in got["logprobs"]] == [(3,), (5,)]
    assert read_token_log(tmp_path, "g0") is None and log.errors == 0
    log.close()

    # A learner started again lists the folder once, oldest first, and goes on pruning; a
    # write a crash left half-done is removed.
    for k, name in enumerate(["g2.npz", "g3.npz", "g4.npz"]):
        stamp = time.time() - 100 + k
        os.utime(folder / name, (stamp, stamp))
    (folder / ".writing-g9.npz").write_bytes(b"half")
    log = TokenLog(tmp_path, keep=2)
    assert sorted(p.name for p in folder.iterdir()) == ["g3.npz", "g4.npz"]
    log.write(_groups("g5"), _logprobs(1), version=5)
    assert sorted(p.name for p in folder.iterdir()) == ["g4.npz", "g5.npz"]
    log.write(_groups("g6", "g7"), _logprobs(2), version=6)
    assert sorted(p.name for p in folder.iterdir()) == ["g6.npz", "g7.npz"]
    assert read_token_log(tmp_path, "g7")["logprobs"][0][0] == 1.0


def test_a_learner_keeps_its_newest_groups(files_policy_path, tmp_path, control,
                                           guided_groups):
    learner = _learner(files_policy_path, tmp_path, control, token_log_groups=1)
    learner.update(guided_groups)
    learner.close()
    files = sorted(p.name for p in RunDir(tmp_path).learner_tokens.iterdir())
    assert files == [f"{guided_groups[1].group_id}.npz"]


def test_zero_groups_writes_nothing(files_policy_path, tmp_path, control, guided_groups):
    learner = _learner(files_policy_path, tmp_path, control, token_log_groups=0)
    assert not learner.step.keeps_token_logprobs  # not even scored into a buffer
    learner.update(guided_groups)
    learner.close()
    assert not RunDir(tmp_path).learner_tokens.exists()
    assert "learner/token_log_errors" not in read_metrics(tmp_path, "learner")[-1]
    log = TokenLog(tmp_path, keep=0)
    log.write(_groups("g"), _logprobs(1), version=0)
    assert not RunDir(tmp_path).learner_tokens.exists()


def test_a_write_that_fails_is_counted_and_training_goes_on(files_policy_path, tmp_path,
                                                            control, guided_groups, caplog):
    RunDir(tmp_path).learner_tokens.write_text("in the way")  # a file where the folder goes
    learner = _learner(files_policy_path, tmp_path, control)
    learner.update(guided_groups)
    learner.update(guided_groups)
    learner.close()
    rows = read_metrics(tmp_path, "learner")
    assert [r["learner/token_log_errors"] for r in rows[-2:]] == [2, 4]
    assert rows[-1]["learner/updates"] == 2
    warnings = [r for r in caplog.records if "token log" in r.getMessage()]
    assert len(warnings) == 1  # warned once
    assert read_token_log(tmp_path, guided_groups[0].group_id) is None
