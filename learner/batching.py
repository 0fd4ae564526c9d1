"""Turn replayed groups into one right-padded batch of tensors with per-token advantages.

Token arrays of a :class:`protocol.messages.Trajectory` index one sequence: prompt, then
alternating actions (generated, ``action_mask == 1``) and observations. Only generated tokens are
trained, so every per-token quantity below is zero (or -1 for versions) elsewhere.

A trajectory guided by retrieved experience (self-navigating) carries the injected block's span
inside its prompt; :func:`strip_experience` removes it, which is how ``build_batch`` trains such
rows on the context the policy will see at test time (``experience="discard"``).

A trajectory whose context was rebuilt during the episode (``env.context`` window or summary:
``Trajectory.contexts``) is one row per context (:func:`split_contexts`): every action is
trained against exactly the tokens it was sampled after, nothing of another context.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import numpy as np
import torch

from learner.advantages import composite_step_advantages, grpo_advantages
from protocol.messages import Group, StepLabels, Trajectory

EXPERIENCE_MODES = ("discard", "keep")


@dataclass
class TrainBatch:
    """One learner batch; every ``[B, L]`` tensor is right-padded to the longest row.

    * ``input_ids`` long — tokens, ``pad_id`` after each row's end.
    * ``attention_mask`` long — 1 on real tokens, 0 on padding.
    * ``action_mask`` float — 1 on tokens the policy generated (the trained tokens).
    * ``behaviour_logprobs`` float — the sampler's log-prob of each generated token, else 0.
    * ``advantages`` float — per-token advantage, 0 off ``action_mask``.
    * ``versions`` long — policy version that generated each token, -1 elsewhere.
    * ``num_tokens`` — number of trained tokens (``action_mask.sum()``), the token-mean
      denominator when a batch is split into micro-batches.
    * ``group_index`` long ``[B]`` — which input group each row came from.
    * ``guided`` float ``[B]`` — 1 where the trajectory's prompt had experience injected
      (non-empty ``experience_ids`` or ``experience_span``), whether or not it was stripped.
    * ``stripped`` float ``[B]`` — 1 where that experience was removed from the row before
      batching, so the row's tokens are not the context its behaviour log-probs were taken in.
    * ``row_weight`` float ``[B]`` — the row's share of its trajectory's generated tokens: 1,
      except for the rows of a trajectory whose context was rebuilt (one row per context),
      which add up to 1 (``seq-mean-token-mean`` weighs each trajectory once).
    * ``traj_index`` long ``[B]`` — which trajectory of its group (``group.trajectories``
      order) the row came from.
    * ``source_positions`` long ``[B, L]`` — the position in that trajectory's own tokens (as
      the actor sent them) of each of the row's tokens; -1 on padding. A row of a later
      context starts past 0, a stripped row skips its experience span, a cut row stops at
      ``max_len``: :func:`to_trajectories` puts per-row values back where they belong.

    (The last two are None in a batch made by hand; only :func:`to_trajectories` reads them.)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    versions: torch.Tensor
    num_tokens: int
    group_index: torch.Tensor
    guided: torch.Tensor
    stripped: torch.Tensor
    row_weight: torch.Tensor
    traj_index: torch.Tensor | None = None
    source_positions: torch.Tensor | None = None

    def rows(self, index: torch.Tensor, width: int | None = None) -> TrainBatch:
        """The sub-batch of rows ``index`` (a minibatch); ``num_tokens`` is recounted. With
        ``width``, the ``[B, L]`` tensors keep only their first ``width`` positions (rows are
        right-padded: nothing but padding may lie past it)."""
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value[index]
                picked[f.name] = value[:, :width] if width is not None and value.dim() == 2 \
                    else value
        return TrainBatch(**picked, num_tokens=int(picked["action_mask"].sum()))

    def lengths(self) -> torch.Tensor:
        """Each row's length up to its last real token ``[B]``."""
        positions = torch.arange(1, self.attention_mask.shape[1] + 1,
                                 device=self.attention_mask.device)
        return (self.attention_mask.bool() * positions).amax(dim=1)

    def to(self, device: torch.device | str) -> TrainBatch:
        """A copy with every tensor on ``device``."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device) if isinstance(value, torch.Tensor) else value
        return TrainBatch(**moved)


def build_batch(
    groups: list[Group],
    pad_id: int,
    advantages: list[list[np.ndarray]] | None = None,
    labels: Mapping[str, StepLabels] | Iterable[StepLabels] | None = None,
    alpha: float = 0.1,
    max_len: int | None = None,
    experience: str = "discard",
    advantage_std: str = "group",
) -> tuple[TrainBatch, dict]:
    """Stack the trajectories of ``groups`` (in order) into a :class:`TrainBatch`.

    Advantages, one of three ways:

    * default — GRPO: each trajectory's scalar :func:`grpo_advantages` on all its generated
      tokens;
    * ``labels`` (group_id → :class:`StepLabels`, or a list of them) — the attribution
      composite :func:`composite_step_advantages` with weight ``alpha``: step ``t``'s advantage
      goes to the generated tokens of its action span ``steps[t].start:steps[t].end`` and to no
      other token. A group without labels falls back to GRPO (counted in
      ``stats["unlabelled_groups"]``);
    * ``advantages`` — precomputed, per group per trajectory: a scalar (broadcast over the
      generated tokens) or a length-``T`` per-token array (masked by ``action_mask``).

    Advantages are computed on the trajectories as sent (a per-token array indexes their tokens,
    experience included); with ``experience="discard"`` each row's injected experience is then
    cut out of its tokens and its advantages alike (:func:`strip_experience`), so the policy is
    trained to act without the advice. ``"keep"`` trains with the experience in context.

    ``advantage_std`` (``learner.advantage_std``): whether the outcome advantages, plain or
    the composite's outcome part, are divided by their group's std (``group``) or only
    centred (``none``, Dr. GRPO; :func:`grpo_advantages`).

    ``max_len`` cuts longer rows to their first ``max_len`` tokens (counted in ``truncated``);
    it applies after stripping.

    Returns the batch and ``stats``: ``groups``, ``trajectories``, ``degenerate_groups`` (all
    rewards equal, so zero outcome advantage), ``tokens`` (non-padding), ``action_tokens``,
    ``truncated``, ``guided_trajectories``, ``stripped_trajectories``, and with ``labels`` also
    ``unlabelled_groups``.
    """
    if experience not in EXPERIENCE_MODES:
        raise ValueError(f"experience must be one of {EXPERIENCE_MODES}, not {experience!r}")
    if advantages is not None and labels is not None:
        raise ValueError("pass either precomputed advantages or step labels, not both")
    if advantages is not None and len(advantages) != len(groups):
        raise ValueError(f"{len(advantages)} advantage lists for {len(groups)} groups")
    label_map = _label_map(labels) if labels is not None else None

    rows: list[_Row] = []
    stats = {"groups": len(groups), "degenerate_groups": 0}
    if label_map is not None:
        stats["unlabelled_groups"] = 0
    for gi, group in enumerate(groups):
        stats["degenerate_groups"] += int(group.outcomes_equal())
        if advantages is not None:
            per_traj = _given_advantages(group, advantages[gi])
        elif label_map is not None and group.group_id in label_map:
            per_traj = _composite_token_advantages(group, label_map[group.group_id], alpha,
                                                   advantage_std)
        else:
            if label_map is not None:
                stats["unlabelled_groups"] += 1
            per_traj = _grpo_token_advantages(group, advantage_std)
        for ti, (traj, adv) in enumerate(zip(group.trajectories, per_traj)):
            generated = max(int(traj.action_mask.sum()), 1)
            for (lo, hi), part in split_contexts(traj):
                share = 1.0 if not traj.contexts else float(part.action_mask.sum()) / generated
                row, row_adv, stripped, positions = _row(part, adv[lo:hi], experience,
                                                         np.arange(lo, hi))
                rows.append(_Row(gi, ti, row, row_adv, stripped, share, positions))
    if not rows:
        raise ValueError("no trajectories to batch")
    batch, pad_stats = _pad(rows, pad_id, max_len)
    stats.update(trajectories=sum(len(g.trajectories) for g in groups), rows=len(rows),
                 **pad_stats)
    return batch, stats


def to_trajectories(batch: TrainBatch, values: np.ndarray,
                    groups: list[Group]) -> list[list[np.ndarray]]:
    """Per-row values of ``batch`` (``[B, L']``, NaN where a row has none) back on the tokens
    of the trajectories the rows came from: per group, per trajectory (in ``groups`` order),
    a float32 array as long as its tokens, holding the value of the row position that
    ``source_positions`` maps there and NaN at every position no row gave a value (a stripped
    experience span, tokens past ``max_len``, and wherever ``values`` is NaN)."""
    if batch.traj_index is None or batch.source_positions is None:
        raise ValueError("the batch does not say where its rows came from (made by hand?)")
    out = [[np.full(len(t.tokens), np.nan, dtype=np.float32) for t in g.trajectories]
           for g in groups]
    width = min(values.shape[1], batch.source_positions.shape[1])
    source = batch.source_positions[:, :width].cpu().numpy()
    values = np.asarray(values[:, :width], dtype=np.float32)
    for r, (gi, ti) in enumerate(zip(batch.group_index.tolist(), batch.traj_index.tolist())):
        where = (source[r] >= 0) & ~np.isnan(values[r])
        out[gi][ti][source[r][where]] = values[r][where]
    return out


def split_contexts(traj: Trajectory) -> list[tuple[tuple[int, int], Trajectory]]:
    """Each context ``traj`` holds, as a trajectory of its own with the [start, end) of its
    tokens in ``traj``: its steps and experience span moved to its own positions (a later
    context's prompt runs to its first generated token). One context: ``traj`` itself."""
    if not traj.contexts:
        return [((0, len(traj.tokens)), traj)]
    out = []
    for k, (lo, hi) in enumerate(traj.context_bounds()):
        mask = traj.action_mask[lo:hi]
        if k == 0:
            prompt, span = traj.prompt_len, list(traj.experience_span)
        else:
            ctx = traj.contexts[k - 1]
            generated = np.flatnonzero(mask)
            prompt = int(generated[0]) if generated.size else hi - lo
            span = [ctx[1] - lo, ctx[2] - lo] if ctx[2] > ctx[1] else []
        steps = [replace(s, start=s.start - lo, end=s.end - lo) for s in traj.steps
                 if lo <= s.start < hi]
        out.append(((lo, hi), replace(
            traj, tokens=traj.tokens[lo:hi], logprobs=traj.logprobs[lo:hi],
            versions=traj.versions[lo:hi], action_mask=mask, prompt_len=prompt, steps=steps,
            experience_span=span, contexts=[])))
    return out


def strip_experience(traj: Trajectory) -> Trajectory:
    """A copy of ``traj`` without its injected experience tokens ``tokens[start:end]``.

    Token arrays are cut at ``experience_span``; step spans after it and ``prompt_len`` move left
    by its length; ``experience_span`` becomes ``[]``. ``experience_ids`` are kept: the row was
    still generated under guidance. Prompts are built piecewise from token lists, so the result
    is exactly the trajectory the same actions would make from the unguided prompt. A copy
    (nothing shared with ``traj``) even when there is no span.

    Raises ``ValueError`` when the span is not inside the prompt, covers a generated token or
    cuts into a step's action span.
    """
    if not traj.experience_span:
        return _copy(traj, 0, 0)
    start, end = _checked_span(traj)
    return _copy(traj, start, end)


def _checked_span(traj: Trajectory) -> tuple[int, int]:
    span = traj.experience_span
    if len(span) != 2 or not 0 <= span[0] <= span[1] <= traj.prompt_len:
        raise ValueError(f"{traj.traj_id}: experience_span {span} is not [start, end] inside "
                         f"the prompt (prompt_len {traj.prompt_len})")
    start, end = int(span[0]), int(span[1])
    if traj.action_mask[start:end].any():
        raise ValueError(f"{traj.traj_id}: experience_span {span} covers generated tokens")
    for i, s in enumerate(traj.steps):
        if s.start < end and start < s.end:
            raise ValueError(f"{traj.traj_id}: experience_span {span} overlaps step {i} "
                             f"[{s.start}, {s.end})")
    return start, end


def _cut(arr: np.ndarray, start: int, end: int) -> np.ndarray:
    """``arr`` without ``arr[start:end]``, always a new array."""
    return np.concatenate([arr[:start], arr[end:]])


def _copy(traj: Trajectory, start: int, end: int) -> Trajectory:
    """A deep-enough copy of ``traj`` with tokens ``[start, end)`` removed and no span left."""
    n = end - start

    def shift(pos: int) -> int:
        # Steps never overlap the span (checked), so each boundary lies before it or after it.
        return pos - n if pos >= end else pos

    steps = [replace(s, start=shift(s.start), end=shift(s.end), info=dict(s.info))
             for s in traj.steps]
    return replace(
        traj, tokens=_cut(traj.tokens, start, end), logprobs=_cut(traj.logprobs, start, end),
        versions=_cut(traj.versions, start, end),
        action_mask=_cut(traj.action_mask, start, end), prompt_len=traj.prompt_len - n,
        steps=steps, experience_span=[], experience_ids=list(traj.experience_ids),
        info=dict(traj.info))


class _Row(NamedTuple):
    group: int  # index of its group in the batch
    traj: int  # index of its trajectory in the group
    trajectory: Trajectory  # the row's own tokens (one context, experience stripped or not)
    advantages: np.ndarray
    stripped: bool
    weight: float  # row_weight
    positions: np.ndarray  # each token's position in the trajectory as sent


def _row(traj: Trajectory, adv: np.ndarray, experience: str, positions: np.ndarray
         ) -> tuple[Trajectory, np.ndarray, bool, np.ndarray]:
    """The trajectory, its per-token advantages, whether its experience was stripped, and
    where each of its tokens was in the trajectory as sent (``positions``, cut alike)."""
    span = traj.experience_span
    if experience == "keep" or not span:
        return traj, adv, False, positions
    start, end = _checked_span(traj)
    # Advantages were computed on the unstripped layout: cut the same tokens out of them.
    return (strip_experience(traj), _cut(adv, start, end), end > start,
            _cut(positions, start, end))


def _is_guided(traj: Trajectory) -> bool:
    return bool(traj.experience_ids) or bool(traj.experience_span)


def _label_map(labels) -> dict[str, StepLabels]:
    if isinstance(labels, Mapping):
        return dict(labels)
    return {lab.group_id: lab for lab in labels}


def _generated(traj: Trajectory) -> np.ndarray:
    return traj.action_mask.astype(np.float32)


def _grpo_token_advantages(group: Group, std: str = "group") -> list[np.ndarray]:
    adv = grpo_advantages([t.reward for t in group.trajectories], std=std)
    return [a * _generated(t) for t, a in zip(group.trajectories, adv)]


def _composite_token_advantages(group: Group, labels: StepLabels, alpha: float,
                                std: str = "group") -> list[np.ndarray]:
    trajs = group.trajectories
    if len(labels.labels) != len(trajs):
        raise ValueError(
            f"group {group.group_id}: {len(labels.labels)} label rows for {len(trajs)} trajectories"
        )
    for i, (t, row) in enumerate(zip(trajs, labels.labels)):
        if len(row) != len(t.steps):
            raise ValueError(
                f"group {group.group_id} trajectory {i}: {len(row)} labels for {len(t.steps)} steps"
            )
    step_adv = composite_step_advantages(labels.labels, [t.reward for t in trajs], alpha,
                                         std=std)
    out = []
    for t, adv in zip(trajs, step_adv):
        tok = np.zeros(len(t.tokens), dtype=np.float32)
        for step, a in zip(t.steps, adv):
            tok[step.start : step.end] = a
        # A step span may include tokens the policy did not generate (e.g. a forced stop
        # token); those are not trained and must carry no advantage.
        out.append(tok * _generated(t))
    return out


def _given_advantages(group: Group, given: list[np.ndarray]) -> list[np.ndarray]:
    if len(given) != len(group.trajectories):
        raise ValueError(
            f"group {group.group_id}: {len(given)} advantages for "
            f"{len(group.trajectories)} trajectories"
        )
    out = []
    for t, a in zip(group.trajectories, given):
        a = np.asarray(a, dtype=np.float32)
        if a.size != 1 and a.shape != (len(t.tokens),):
            raise ValueError(f"advantage of shape {a.shape} for {len(t.tokens)} tokens")
        # A one-element array broadcasts over the tokens, a length-T one multiplies per token.
        out.append(a.reshape(-1) * _generated(t))
    return out


def _pad(rows: list[_Row], pad_id: int, max_len: int | None) -> tuple[TrainBatch, dict]:
    lengths = [len(r.trajectory.tokens) for r in rows]
    truncated = sum(n > max_len for n in lengths) if max_len is not None else 0
    if max_len is not None:
        lengths = [min(n, max_len) for n in lengths]
    b, seq = len(rows), max(lengths)
    ids = np.full((b, seq), pad_id, dtype=np.int64)
    attn = np.zeros((b, seq), dtype=np.int64)
    act = np.zeros((b, seq), dtype=np.float32)
    blp = np.zeros((b, seq), dtype=np.float32)
    adv = np.zeros((b, seq), dtype=np.float32)
    ver = np.full((b, seq), -1, dtype=np.int64)
    src = np.full((b, seq), -1, dtype=np.int64)
    for i, (row, n) in enumerate(zip(rows, lengths)):
        t, a = row.trajectory, row.advantages
        gen = t.action_mask[:n].astype(bool)
        ids[i, :n] = t.tokens[:n]
        attn[i, :n] = 1
        act[i, :n] = gen
        blp[i, :n] = np.where(gen, t.logprobs[:n], 0.0)
        adv[i, :n] = a[:n]
        ver[i, :n] = np.where(gen, t.versions[:n], -1)
        src[i, :n] = row.positions[:n]
    batch = TrainBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attn),
        action_mask=torch.from_numpy(act),
        behaviour_logprobs=torch.from_numpy(blp),
        advantages=torch.from_numpy(adv),
        versions=torch.from_numpy(ver),
        num_tokens=int(act.sum()),
        group_index=torch.tensor([r.group for r in rows], dtype=torch.long),
        # A stripped row has lost its span but keeps its experience_ids; count it as guided
        # either way.
        guided=torch.tensor([float(_is_guided(r.trajectory) or r.stripped) for r in rows]),
        stripped=torch.tensor([float(r.stripped) for r in rows]),
        row_weight=torch.tensor([r.weight for r in rows], dtype=torch.float32),
        traj_index=torch.tensor([r.traj for r in rows], dtype=torch.long),
        source_positions=torch.from_numpy(src),
    )
    stats = {"tokens": int(attn.sum()), "action_tokens": batch.num_tokens, "truncated": truncated,
             "guided_trajectories": int(batch.guided.sum()),
             "stripped_trajectories": int(batch.stripped.sum())}
    return batch, stats


def token_budget_parts(rows: torch.Tensor, lengths: torch.Tensor,
                       budget: int) -> list[torch.Tensor]:
    """``rows`` in micro-batches of at most ``budget`` padded tokens (rows × longest row):
    longest first, each part filled while it fits; a row longer than ``budget`` is a part of
    its own. Sorting by length keeps short rows from paying for a long row's padding."""
    order = sorted(rows.tolist(), key=lambda r: -int(lengths[r]))
    parts, current, longest = [], [], 0
    for row in order:
        width = max(longest, int(lengths[row]))
        if current and width * (len(current) + 1) > budget:
            parts.append(current)
            current, width = [], int(lengths[row])
        current.append(row)
        longest = width
    if current:
        parts.append(current)
    return [torch.tensor(p, dtype=torch.long) for p in parts]
