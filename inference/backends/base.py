"""The contract every generation engine implements.

The actor talks to an engine only through :class:`InferenceBackend`, so the transformers engine
used on CPU and a vLLM engine used on GPU are interchangeable. The interface is token-level
(prompts and outputs are token ids, never text) and batch-first (one call generates for many
prompts), because that is what both the rollout loop and the learner need: the learner trains
on exactly the ids that were sampled, with the log-probs the sampler saw.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # imported only for annotations; constraint.py does not import us back
    from inference.backends.constraint import TokenConstraint
    from protocol.weights import AdapterMeta

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample, shared by every prompt in one ``generate`` call.

    Field names and meanings follow vLLM's so a vLLM engine can map them one to one.

    temperature: softmax temperature; ``0`` means greedy decoding.
    top_p: nucleus sampling mass in ``(0, 1]``; ``1`` disables it.
    top_k: keep only the ``k`` most likely tokens; ``0`` (or ``-1``) disables it.
    max_new_tokens: most tokens generated per prompt (stop token included).
    stop_token_ids: extra ids that end a sequence, in addition to the tokenizer's EOS.
    seed: seeds the sampler; the same seed, prompts, params and weights give the same output.
        ``None`` draws a fresh seed per call.
    ignore_eos: do not stop at the tokenizer's EOS (``stop_token_ids`` still stop).
    logprobs_mode: ``"processed"`` reports log-probs as documented on
        :attr:`Generation.logprobs` (temperature and constraint applied); ``"raw"`` reports the
        model's own log-softmax at temperature 1 with no constraint, which is exactly what a
        learner recomputes by teacher forcing, so on-policy importance weights are 1 (the
        actors use it; vLLM's ``logprobs_mode="raw_logprobs"`` is the same notion).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs_mode: str = "processed"

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= -1, got {self.top_k}")
        if self.logprobs_mode not in ("processed", "raw"):
            raise ValueError(f"logprobs_mode must be processed or raw, got {self.logprobs_mode!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        # Accept any iterable (a list from a config file) but store a hashable tuple.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def fork(self, key: int | str) -> SamplingParams:
        """These params with a seed of their own for ``key`` (a rollout's turn, the first task
        of an evaluation's batch). A backend seeds each call's rows alike, so reusing one seed
        across turns would draw every turn from the same random numbers; forked seeds differ
        and still reproduce. No seed stays no seed."""
        if self.seed is None:
            return self
        digest = hashlib.blake2b(f"{self.seed}/{key}".encode(), digest_size=8).digest()
        return dataclasses.replace(self, seed=int.from_bytes(digest, "little") & (2**63 - 1))


@dataclass
class Generation:
    """One sampled continuation of one prompt.

    token_ids: the generated ids only (the prompt is not repeated). A stop token that ended the
        sequence is included as the last id, because the policy chose it and the learner must
        train on that choice too.
    logprobs: one float per id in ``token_ids``: ``log p(token)`` under the distribution
        ``softmax(logits / T)`` restricted to the constraint's allowed ids (disallowed ids set to
        ``-inf`` before the softmax, so the allowed ones renormalise), where ``T`` is the
        sampling temperature. Top-k and top-p truncation are *not* reflected: they only shape
        which tokens may be drawn, and leaving them out keeps the value a smooth function of the
        logits that the learner can recompute. With ``T = 0`` (greedy) the limit distribution is
        degenerate, so the value is reported at ``T = 1`` (constraint still applied).
        Consequently, at ``T = 1`` with no constraint it equals the teacher-forced log-prob of
        the model on prompt + generated ids. The learner uses it as the behaviour log-prob.
    finish_reason: ``"stop"`` if a stop token (or a completed constraint) ended the sequence,
        ``"length"`` if ``max_new_tokens`` did.
    version: the policy version of the weights that produced every token of this generation.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    version: int
    # Engine-specific extras (timings, ...); never needed by the learner.
    info: dict[str, Any] = field(default_factory=dict)


def check_prompts(prompts: list[list[int]], constraints: list | None, vocab: int | None) -> list:
    """Refuse what no backend can generate from: a constraint count that does not match, an
    empty prompt, ids outside ``[0, vocab)`` (``vocab`` None: only negatives are refused).
    Returns one constraint per prompt (``constraints`` None: all unconstrained)."""
    if constraints is not None and len(constraints) != len(prompts):
        raise ValueError(f"{len(constraints)} constraints for {len(prompts)} prompts")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        if min(prompt) < 0 or (vocab is not None and max(prompt) >= vocab):
            raise ValueError(f"prompt {i} has ids outside [0, {vocab})")
    return list(constraints) if constraints is not None else [None] * len(prompts)


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """A safetensors file, or the ``*.safetensors`` shards of a folder (sorted)."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors weights at {path}")
    return files


class InferenceBackend(abc.ABC):
    """A generation engine that the actor can drive and the learner can update in place.

    Contract:

    * ``generate(prompts, params, constraints)`` returns one :class:`Generation` per prompt,
      in order. Prompts are non-empty lists of token ids and may differ in length.
      ``constraints``, if given, has one entry per prompt; ``None`` entries are unconstrained.
      A constraint is consulted before every sampled token and only its allowed ids may be
      sampled; when it allows nothing more (``[]``) the sequence ends with ``"stop"``.
      Each sequence stops independently at EOS (unless ``ignore_eos``), at any of
      ``params.stop_token_ids``, or after ``params.max_new_tokens`` tokens.
    * Log-probs are defined exactly as documented on :attr:`Generation.logprobs`.
    * Generation is deterministic given ``params.seed`` on the same engine, device and weights.
    * ``load_weights(state_dict_or_path, version)`` replaces the weights in place, without
      restarting the engine or changing the architecture; every generation that starts after
      it returns carries ``version``. It never runs concurrently with ``generate``: callers
      update weights between turns. ``load_adapter(tensors, adapter, version)`` does the same
      for a LoRA version: the base stays loaded and only the adapter changes.
    * ``version`` is the policy version of the current weights; ``tokenizer`` is the Hugging
      Face tokenizer matching the model (used to build prompts and decode actions).
    * ``close()`` releases the engine's memory; the backend is unusable afterwards. Backends are
      also context managers that close on exit.
    """

    @abc.abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        constraints: list[TokenConstraint | None] | None = None,
    ) -> list[Generation]:
        """Sample one continuation per prompt; see the class docstring for the contract."""

    @abc.abstractmethod
    def load_weights(self, state_dict_or_path: Any, version: int) -> None:
        """Copy new weights (a state dict of tensors or a safetensors path) in place."""

    @abc.abstractmethod
    def load_adapter(self, tensors: dict[str, Any], adapter: AdapterMeta, version: int) -> None:
        """Apply a LoRA adapter (``inference.lora`` keys: ``<module>.lora_A``/``lora_B``) to
        the base weights this engine started from and set ``version``; the adapter replaces
        the previous one (it is never stacked on it). Keys and shapes are checked first, so a
        bad adapter raises and the previous version keeps generating."""

    @property
    def base_sha256(self) -> str:
        """SHA-256 of the weight files this engine started from: what an adapter is checked
        against (``AdapterMeta.base_sha256``)."""
        from inference.lora import base_digest

        return base_digest(self.model_path)

    @property
    @abc.abstractmethod
    def model_path(self) -> str:
        """The local model folder this engine started from."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Policy version of the weights currently loaded."""

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer that matches the model."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine; the backend must not be used afterwards."""

    def __enter__(self) -> InferenceBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
