"""Every message that crosses a process boundary, defined once.

The schema version lives in :mod:`protocol.codec` (``SCHEMA_VERSION``); bump it on any
incompatible change here. Token-level arrays of one trajectory all have the same length ``T``
and index the same token sequence: prompt, then alternating model actions and observations.
"""

from __future__ import annotations

import math
import re
from dataclasses import field

import numpy as np

from protocol.codec import array_field, message
from protocol.errors import SchemaError

# Bounds a well-behaved peer never comes near; past them a request is refused, not served.
MAX_ID_BYTES = 256  # learner and judge ids (part of LMDB keys, which stop at 511 bytes)
MAX_VERSION = 2**31 - 1  # policy versions travel in int32 arrays (Trajectory.versions)
MAX_LEASE_S = 7 * 24 * 3600.0  # a judge lease longer than a week is a lease forever
WEIGHTS_CHUNK_BYTES = 4 * 1024 * 1024  # one chunk of a published version (weights.CHUNK_BYTES)
MAX_WEIGHTS_CHUNKS = 2**20  # 4 TiB of weights in 4 MiB chunks
MAX_BATCH_WAIT_S = 60.0  # a batch request held open longer would hold its learner past a stop
MAX_GROUPS_PER_READ = 4096  # groups one StoredGroups reply may carry (it is bounded in bytes too)
MAX_SEQ = 2**63 - 1  # ingest sequence numbers are 8-byte keys in the replay store
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def _check_id(value: str, name: str) -> None:
    if len(value.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        raise SchemaError("invalid", f"{name} longer than {MAX_ID_BYTES} bytes", name)


def _check_count(value: int, name: str, lo: int = 0, hi: int = MAX_VERSION) -> None:
    if not lo <= value <= hi:
        raise SchemaError("invalid", f"{name} must be in [{lo}, {hi}], got {value}", name)


def _check_seconds(value: float, name: str, hi: float = float("inf")) -> None:
    if not (math.isfinite(value) and 0.0 <= value <= hi):
        raise SchemaError("invalid", f"{name} must be a finite number in [0, {hi}], got {value}",
                          name)


def _check_sha256(value: str, name: str) -> None:
    if not _SHA256_HEX.fullmatch(value):
        raise SchemaError("invalid", f"{name} must be a SHA-256 digest: 64 lowercase hex digits",
                          name)


# --- tasks -------------------------------------------------------------------------------------


SPLITS = ("train", "validation", "test")  # a task's split; the last two are held out
HELD_OUT_SPLITS = ("validation", "test")
# Rewards closer than this count as equal (Group.outcomes_equal; the learner's advantages): env
# rewards are often computed in floating point, and "all scored the same" must not hinge on
# the last bit.
REWARD_ATOL = 1e-9


def rewards_equal(rewards) -> bool:
    """Fewer than two rewards, or all within ``REWARD_ATOL``: a group that carries no outcome
    signal (its outcome advantage is zero for every rollout)."""
    rewards = [float(r) for r in rewards]
    return len(rewards) < 2 or max(rewards) - min(rewards) <= REWARD_ATOL


@message("task")
class Task:
    task_id: str  # stable id; many groups may roll out the same task
    env: str  # environment registry name (environments), e.g. "files"
    query: str  # natural-language instruction shown to the agent
    seed: int  # world seed passed to env.reset: same seed, same initial state
    goal: dict = field(default_factory=dict)  # env-specific checkable condition on the state
    reference: list[str] = field(default_factory=list)  # verified reference actions, may be empty
    source: str = "original"  # "original" (the env's own) or "synthetic" (self-questioning)
    # one of SPLITS: "train" (trained on), "validation" (held out, for choosing settings) or
    # "test" (held out, looked at once); held-out splits are whole worlds unless an env says
    split: str = "train"
    difficulty: float = 0.0  # estimate: steps, entities, dependent operations
    meta: dict = field(default_factory=dict)  # free-form provenance (explorer id, template...)


# --- rollouts ----------------------------------------------------------------------------------


@message("step")
class Step:
    action: str  # decoded text of the model's action
    observation: str  # what the environment answered
    start: int  # index in Trajectory.tokens of the first token of the action
    end: int  # one past the last action token
    valid: bool = True  # the action parsed and named a declared tool with literal arguments
    info: dict = field(default_factory=dict)  # env-specific details (error kind, tool name...)
    thought: str = ""  # actor.think: the free text the model wrote before the call (v6)


@message("trajectory")
class Trajectory:
    traj_id: str  # unique within its group
    tokens: np.ndarray = array_field("int32")  # [T] prompt + actions + observations
    logprobs: np.ndarray = array_field("float32")  # [T] sampler log-prob; 0 where not generated
    versions: np.ndarray = array_field("int32")  # [T] policy version per token; -1 if not generated
    action_mask: np.ndarray = array_field("uint8")  # [T] 1 where the policy generated the token
    prompt_len: int = 0  # tokens before the first action
    steps: list[Step] = field(default_factory=list)  # one per action, in order
    reward: float = 0.0  # outcome reward from env.evaluate
    success: bool = False  # the task's goal holds at the end
    # [start, end) of the injected experience, markers included, or [] when none was injected;
    # removing exactly these tokens gives the prompt the policy would have seen without it
    experience_span: list[int] = field(default_factory=list)
    experience_ids: list[str] = field(default_factory=list)  # ids of the injected experiences
    info: dict = field(default_factory=dict)  # turns, truncation, timing...
    # Where the model's context was rebuilt (env.context window / summary): one entry per
    # later context, [start, experience start, experience end]. tokens[start:next start] is a
    # whole context the model saw on its own (its prompt, then actions and observations), its
    # prompt's experience block at [experience start, experience end) (equal: none); the first
    # context is tokens[0:first start], with prompt_len and experience_span. [] when the
    # context only grew: the tokens are one sequence, as before v6.
    contexts: list[list[int]] = field(default_factory=list)

    def validate(self):
        if self.tokens.ndim != 1:
            raise SchemaError("invalid", "tokens must be 1-D", "tokens")
        n = len(self.tokens)
        for name in ("tokens", "logprobs", "versions", "action_mask"):
            arr = getattr(self, name)
            if arr.ndim != 1 or len(arr) != n:
                raise SchemaError("invalid", f"{name} must be 1-D of length {n}", name)
        # What the learner indexes and weighs with: a bad value here would crash or poison it.
        if n and self.tokens.min() < 0:
            raise SchemaError("invalid", "token ids are >= 0", "tokens")
        if n and self.action_mask.max() > 1:
            raise SchemaError("invalid", "action_mask is 0 or 1", "action_mask")
        if n and self.versions.min() < -1:
            raise SchemaError("invalid", "versions are >= 0, or -1 where not generated",
                              "versions")
        if np.isnan(self.logprobs).any() or (self.logprobs == np.inf).any():
            raise SchemaError("invalid", "logprobs must not be NaN or +inf", "logprobs")
        if not math.isfinite(self.reward):
            raise SchemaError("invalid", "reward must be finite", "reward")
        if not 0 <= self.prompt_len <= n:
            raise SchemaError("invalid", "prompt_len outside the token range", "prompt_len")
        for i, s in enumerate(self.steps):
            if not 0 <= s.start <= s.end <= n:
                raise SchemaError("invalid", "step span outside the token range", f"steps[{i}]")
        if self.experience_span:
            if len(self.experience_span) != 2:
                raise SchemaError("invalid", "experience_span is [start, end] or []",
                                  "experience_span")
            start, end = self.experience_span
            if not 0 <= start <= end <= self.prompt_len:
                raise SchemaError("invalid", "experience_span must lie inside the prompt",
                                  "experience_span")
        self._validate_contexts(n)

    def _validate_contexts(self, n: int) -> None:
        previous = self.prompt_len
        for i, ctx in enumerate(self.contexts):
            where = f"contexts[{i}]"
            if len(ctx) != 3 or not previous < ctx[0] <= ctx[1] <= ctx[2] <= n:
                raise SchemaError("invalid", "a context is [start, experience start, experience "
                                  "end], in order, after the previous one", where)
            if self.action_mask[ctx[1]:ctx[2]].any():
                raise SchemaError("invalid", "a context's experience covers generated tokens",
                                  where)
            previous = ctx[0]
        for i, s in enumerate(self.steps):  # an action lies inside one context
            if any(s.start < ctx[0] < s.end for ctx in self.contexts):
                raise SchemaError("invalid", "a step's action crosses into another context",
                                  f"steps[{i}]")

    def context_bounds(self) -> list[tuple[int, int]]:
        """[start, end) of each context the model saw, in order (one when none was rebuilt)."""
        starts = [0, *(c[0] for c in self.contexts)]
        return list(zip(starts, [*starts[1:], len(self.tokens)]))

    def policy_versions(self) -> tuple[int, int]:
        """(min, max) version over generated tokens; (-1, -1) when nothing was generated."""
        gen = self.versions[self.action_mask.astype(bool)]
        return (int(gen.min()), int(gen.max())) if gen.size else (-1, -1)


@message("group")
class Group:
    group_id: str  # unique idempotency key: a retry re-sends the same id and is stored once
    task: Task  # the task all trajectories attempted
    trajectories: list[Trajectory]  # the n rollouts (the GRPO group)
    actor_id: str = ""  # which actor produced it
    created_at: float = 0.0  # unix time the group was finished

    def validate(self):
        if not self.group_id:
            raise SchemaError("invalid", "empty group_id", "group_id")
        if not self.trajectories:
            raise SchemaError("invalid", "a group has at least one trajectory", "trajectories")

    def outcomes_equal(self) -> bool:
        """Every rollout scored the same (:func:`rewards_equal`)."""
        return rewards_equal(t.reward for t in self.trajectories)

    def policy_versions(self) -> tuple[int, int]:
        spans = [t.policy_versions() for t in self.trajectories]
        spans = [s for s in spans if s[0] >= 0]
        if not spans:
            return (-1, -1)
        return (min(s[0] for s in spans), max(s[1] for s in spans))


# --- experiences (self-navigating) ------------------------------------------------------------


@message("experience")
class Experience:
    exp_id: str  # stable id: a hash of when_to_use and content, so re-extraction is idempotent
    when_to_use: str  # the situation it applies to; its embedding is the retrieval key
    content: str  # the advice itself, the text injected into prompts
    kind: str = "success"  # what made it: success | failure | contrast | exploration | llm
    tags: list[str] = field(default_factory=list)  # free labels (task family, error kind...)
    tools: list[str] = field(default_factory=list)  # tools the advice is about
    confidence: float = 0.5  # the extractor's confidence, in [0, 1]
    source_traj_ids: list[str] = field(default_factory=list)  # trajectories it was drawn from
    created_version: int = -1  # learner version when it was made; -1 = before training
    created_at: float = 0.0  # unix time it was stored
    uses: int = 0  # rollouts it was injected into (kept as a Redis counter; filled on read)
    successes: int = 0  # of those, how many succeeded (utility = successes / uses)

    def validate(self):
        if not self.exp_id:
            raise SchemaError("invalid", "empty exp_id", "exp_id")
        if not 0.0 <= self.confidence <= 1.0:
            raise SchemaError("invalid", "confidence outside [0, 1]", "confidence")


# --- judging -----------------------------------------------------------------------------------


@message("judge_pull")
class JudgePull:
    judge_id: str  # the worker asking
    max_groups: int = 1  # at most this many groups in the reply
    lease_s: float = 60.0  # the groups go back to the pool if no labels arrive in time

    def validate(self):
        _check_id(self.judge_id, "judge_id")
        _check_count(self.max_groups, "max_groups")
        _check_seconds(self.lease_s, "lease_s", MAX_LEASE_S)  # 0 = the server's default


@message("judge_work")
class JudgeWork:
    groups: list[Group]  # unjudged groups now leased to the asking judge (may be empty)


@message("labels")
class StepLabels:
    group_id: str  # the group these labels belong to
    labels: list[list[int]]  # per trajectory, per step: 1 = GOOD, 0 = BAD
    judge: str = ""  # "reference" or the LLM's name
    info: dict = field(default_factory=dict)  # parse failures, fallbacks, timing

    def validate(self):
        if any(v not in (0, 1) for row in self.labels for v in row):
            raise SchemaError("invalid", "labels are 0 (BAD) or 1 (GOOD)", "labels")

    def all_equal(self) -> bool:
        """Every step of every trajectory got the same label (or there are none): the step
        judge's signal is zero across the group, as the composite advantage z-scores it."""
        return len({v for row in self.labels for v in row}) <= 1


# --- learning ----------------------------------------------------------------------------------


@message("learner_hello")
class LearnerHello:
    learner_id: str  # the learner (re)starting
    version: int  # its current policy version
    # the ledger from its checkpoint: ids of the groups it has trained on
    consumed: list[str] = field(default_factory=list)

    def validate(self):
        _check_id(self.learner_id, "learner_id")
        _check_count(self.version, "version")


@message("batch_request")
class BatchRequest:
    learner_id: str
    num_groups: int  # at most this many groups
    version: int  # the learner's current policy version
    max_staleness: int = 4  # serve only groups with min token version >= version - max_staleness
    require_labels: bool = False  # serve only judged groups...
    # ...except those stored at least this long ago, served unjudged (0 = wait for labels)
    label_deadline_s: float = 0.0
    # Long-poll: when nothing can be served yet, the server holds the request up to this long
    # and answers as soon as a group (or a stale skip) is there; 0 = answer at once, maybe empty.
    # The client's own deadline for the answer must be longer.
    timeout_s: float = 0.0
    # Set aside, never to serve, groups that carry no signal: every rollout's reward equal
    # and, with require_labels, every step label equal (a group served unjudged past the
    # deadline: its rewards alone). Reported in Batch.uninformative_skipped (v7).
    skip_uninformative: bool = False

    def validate(self):
        # A bad bound here is not harmless: version and max_staleness move the server's stale
        # floor (what judges skip and eviction may delete), learner_id keys its retry record.
        _check_id(self.learner_id, "learner_id")
        _check_count(self.num_groups, "num_groups")
        _check_count(self.version, "version")
        _check_count(self.max_staleness, "max_staleness")
        _check_seconds(self.label_deadline_s, "label_deadline_s")
        _check_seconds(self.timeout_s, "timeout_s", MAX_BATCH_WAIT_S)


@message("batch")
class Batch:
    groups: list[Group]  # oldest first; each group is delivered to the learner once
    labels: list[StepLabels] = field(default_factory=list)  # labels of judged groups in `groups`
    stale_skipped: int = 0  # groups passed over as too stale since the last batch
    # groups set aside as carrying no signal (BatchRequest.skip_uninformative) in this answer;
    # their admission slots are free, as a stale group's (v7)
    uninformative_skipped: int = 0
    judge_timeouts: int = 0  # groups in `groups` served unjudged past label_deadline_s


@message("ledger_commit")
class LedgerCommit:
    learner_id: str
    group_ids: list[str]  # consumed groups now covered by a durable learner checkpoint
    version: int = 0  # the checkpoint's policy version

    def validate(self):
        _check_id(self.learner_id, "learner_id")
        _check_count(self.version, "version")


# --- reading what was stored (the experience role) ----------------------------------------------


@message("groups_since")
class GroupsSince:
    """Read-only: the groups stored at ingest sequence ``since_seq`` or later, oldest first.
    Delivery, leases and the ledger are untouched; evicted groups are simply not there."""

    since_seq: int  # first ingest sequence number wanted: 0, or a previous reply's next_seq
    max_groups: int = 256  # at most this many groups in the reply (the server may send fewer)

    def validate(self):
        _check_count(self.since_seq, "since_seq", hi=MAX_SEQ)
        _check_count(self.max_groups, "max_groups", lo=1, hi=MAX_GROUPS_PER_READ)


@message("stored_groups")
class StoredGroups:
    """The answer to GroupsSince."""

    groups: list[Group]  # in ingest order, byte-identical to what the actors pushed
    next_seq: int  # where the next read starts: one past the last sequence number read
    more: bool = False  # the reply stopped at max_groups or its byte bound: read again now
    malformed: int = 0  # stored groups read but left out: they no longer decode (older schema)

    def validate(self):
        _check_count(self.next_seq, "next_seq", hi=MAX_SEQ)
        _check_count(self.malformed, "malformed", hi=MAX_SEQ)


# --- weights -----------------------------------------------------------------------------------


@message("weights")
class WeightsAnnouncement:
    version: int  # the new policy version
    num_chunks: int  # WeightsChunk messages that make up the version
    total_bytes: int  # bytes of the serialized state (safetensors)
    sha256: str  # digest of the whole serialized state
    chunk_sha256: list[str] = field(default_factory=list)  # digest of each chunk, in order
    format: str = "safetensors"
    path: str = ""  # for actors on a shared disk: an atomically renamed file with the same bytes
    published_at: float = 0.0  # unix time


@message("weights_fetch")
class WeightsFetch:
    """An actor asking the learner's weight server for one chunk of an announced version."""

    version: int  # the announced version wanted (WeightsAnnouncement.version)
    index: int  # 0-based chunk of it, below WeightsAnnouncement.num_chunks
    # the announcement's whole-file digest: the server serves only those exact bytes, never
    # another build of the same version number (a resumed learner re-publishes its version)
    sha256: str

    def validate(self):
        _check_count(self.version, "version")
        _check_count(self.index, "index", hi=MAX_WEIGHTS_CHUNKS - 1)
        _check_sha256(self.sha256, "sha256")


@message("weights_chunk")
class WeightsChunk:
    """The weight server's answer to a WeightsFetch (refusals come back as Error)."""

    version: int  # the version asked for
    index: int  # 0-based position in the version's chunk list
    data: bytes  # WEIGHTS_CHUNK_BYTES, fewer in the last chunk; checked by the receiver
    sha256: str  # digest of `data` as the server read it (the announced digest is the reference)

    def validate(self):
        _check_count(self.version, "version")
        _check_count(self.index, "index", hi=MAX_WEIGHTS_CHUNKS - 1)
        if len(self.data) > WEIGHTS_CHUNK_BYTES:
            raise SchemaError("invalid", f"a chunk holds at most {WEIGHTS_CHUNK_BYTES} bytes",
                              "data")
        _check_sha256(self.sha256, "sha256")


# --- generic requests and replies --------------------------------------------------------------


@message("stats_request")
class StatsRequest:
    pass


@message("stats")
class Stats:
    values: dict  # counters and gauges, e.g. {"groups": 10, "rejected/not_msgpack": 2}


@message("ack")
class Ack:
    status: str = "ok"  # "stored", "duplicate", "ok"
    info: dict = field(default_factory=dict)


@message("error")
class Error:
    reason: str  # one of protocol.errors.REJECT_REASONS (or "internal")
    detail: str = ""




# --- who may send what to the replay server ----------------------------------------------------

# The roles a replay client can be (its token file is <run dir>/<role>.token, its CURVE pair
# <keys dir>/<role>.key; see protocol.run_dir.role_token and protocol.security).
REPLAY_ROLES = ("learner", "actor", "judge")
# The one role that may send each writing request. A request not named here only reads
# (StatsRequest, GroupsSince): any client the socket admits may send it.
REPLAY_SENDER = {
    Group: "actor",  # push a rollout group
    JudgePull: "judge",  # lease groups to label
    StepLabels: "judge",  # write labels back
    LearnerHello: "learner",  # announce a (re)start: moves the stale floor
    BatchRequest: "learner",  # take groups for training
    LedgerCommit: "learner",  # mark groups consumed
}
