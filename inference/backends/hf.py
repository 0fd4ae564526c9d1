"""Generation with plain Hugging Face transformers: runs anywhere, the CPU default.

The decoding loop is written by hand rather than calling ``model.generate`` because the actor
needs things ``generate`` does not give together: per-sequence grammar masks, the exact
log-prob of every sampled token under the documented distribution, per-sequence stopping, and
in-place weight updates between calls.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference import lora
from inference.backends.base import (
    FinishReason,
    Generation,
    InferenceBackend,
    SamplingParams,
    check_prompts,
    safetensors_files,
)
from inference.backends.constraint import TokenConstraint
from protocol.weights import AdapterMeta

StateDictOrPath = dict[str, torch.Tensor] | str | os.PathLike
ADAPTER_MODES = ("merge", "layers")  # how a LoRA version is applied (TransformersBackend)


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """``None`` means float32 on every device: the actors' log-probs then match the learner's
    fp32 recompute (on-policy importance weights of 1). On an H100, bf16 gave mismatches up
    to 0.05 nats and was slower for small models (docs/results/gpu_check.md); pass a dtype for
    big ones.
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        return resolved
    return dtype


def _read_state_dict(source: StateDictOrPath) -> dict[str, torch.Tensor]:
    """A state dict as given, or read from a safetensors file or a folder of shards."""
    if isinstance(source, dict):
        return source
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(source):
        state.update(load_file(str(file), device="cpu"))
    return state


@dataclass
class _Batch:
    """Decoding state that lives on the device for the whole loop."""

    tokens: torch.Tensor  # [B, max_new] sampled ids
    logprobs: torch.Tensor  # [B, max_new] float32
    lengths: torch.Tensor  # [B] tokens kept per sequence
    stopped: torch.Tensor  # [B] True once a sequence ended by a stop (not by length)
    finished: torch.Tensor  # [B] True once a sequence needs no more tokens


def _kv_cache(out) -> dict:
    """The forward's KV cache as the keyword the next forward takes, named as the output names
    it: ``cache`` in newer transformers (5.24 in .venv: ``past_key_values=`` still works there
    but prints a FutureWarning into every run), ``past_key_values`` in older ones (5.19 in
    .venv-vllm, whose forward would swallow an unknown ``cache=`` in ``**kwargs`` and run
    without the cache)."""
    name = "cache" if "cache" in out.keys() else "past_key_values"
    return {name: out[name]}


class TransformersBackend(InferenceBackend):
    """An :class:`InferenceBackend` over a local Hugging Face causal LM.

    Prompts are left-padded into one batch; the loop feeds one token per sequence per step
    through the KV cache, with explicit position ids so padding does not shift positions.
    Log-probs are those documented on :attr:`Generation.logprobs`.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        version: int = 0,
        adapter_mode: str = "merge",
    ) -> None:
        if adapter_mode not in ADAPTER_MODES:
            raise ValueError(f"adapter_mode must be one of {ADAPTER_MODES}, got {adapter_mode!r}")
        self._adapter_mode = adapter_mode
        self._pristine: dict[str, torch.Tensor] | None = None  # base weights an adapter merges into
        self._attached: AdapterMeta | None = None  # the adapter layers' shape (mode "layers")
        self._model_path = str(model_path)
        self._device = torch.device(device)
        self._dtype = _resolve_dtype(dtype, self._device)
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        model = AutoModelForCausalLM.from_pretrained(str(model_path))
        self._model = model.to(device=self._device, dtype=self._dtype).eval()
        self._version = int(version)
        self._vocab = self._model.get_input_embeddings().num_embeddings
        # Any valid id works as filler: padded positions are masked out of attention.
        pad = self._tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else (self._tokenizer.eos_token_id or 0))
        self._logits_kwarg = self._find_logits_kwarg()

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
    def model(self) -> torch.nn.Module:
        """The underlying module (read-only use: tests, parameter counts)."""
        return self._live_model()

    @property
    def device(self) -> torch.device:
        return self._device

    # -- generation -----------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        constraints: list[TokenConstraint | None] | None = None,
    ) -> list[Generation]:
        model = self._live_model()
        constraints = check_prompts(prompts, constraints, self._vocab)
        if not prompts:
            return []
        rng = torch.Generator(device=self._device)
        if params.seed is None:
            rng.seed()
        else:
            rng.manual_seed(params.seed)
        stop_ids = self._stop_ids(params)

        input_ids, attention = self._left_pad(prompts)
        positions = (attention.cumsum(-1) - 1).clamp_(min=0)
        out = model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            **self._logits_kwarg,
        )
        batch = self._empty_batch(len(prompts), params.max_new_tokens)
        # Only constrained sequences need their ids on the host, to ask their constraint.
        history = {i: [] for i, c in enumerate(constraints) if c is not None}
        next_pos = positions[:, -1:] + 1
        for step in range(params.max_new_tokens):
            allow = self._constraint_mask(constraints, history, batch, step)
            token, logprob = self._sample(out.logits[:, -1, :], params, allow, rng)
            self._record(batch, step, token, logprob, stop_ids)
            if history:
                self._extend_history(history, token, stop_ids)
            if step + 1 == params.max_new_tokens or bool(batch.finished.all()):
                break
            attention = torch.cat([attention, attention.new_ones(len(prompts), 1)], dim=1)
            out = model(
                input_ids=token.unsqueeze(1),
                attention_mask=attention,
                position_ids=next_pos,
                **_kv_cache(out),
                use_cache=True,
                **self._logits_kwarg,
            )
            next_pos = next_pos + 1
        return self._collect(batch)

    def _sample(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        allow: torch.Tensor | None,
        rng: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row; return it with its log-prob (see ``Generation.logprobs``)."""
        logits = logits.float()
        raw = logits
        if allow is not None:
            logits = logits.masked_fill(~allow, float("-inf"))
        greedy = params.temperature == 0
        scaled = logits if greedy else logits / params.temperature
        logp = torch.log_softmax(raw if params.logprobs_mode == "raw" else scaled, dim=-1)
        if greedy:
            token = scaled.argmax(dim=-1)
        else:
            # Truncation shapes what can be drawn but not the reported log-prob.
            probs = torch.softmax(self._truncate(scaled, params), dim=-1)
            token = torch.multinomial(probs, 1, generator=rng).squeeze(1)
        return token, logp.gather(1, token.unsqueeze(1)).squeeze(1)

    @staticmethod
    def _truncate(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Apply top-k then top-p by setting excluded logits to -inf (whole-batch tensor ops)."""
        if 0 < params.top_k < scaled.shape[-1]:
            kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            # Drop a token once the mass before it already reaches top_p; the first never drops.
            drop = (probs.cumsum(dim=-1) - probs) >= params.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
        return scaled

    def _constraint_mask(
        self,
        constraints: list[TokenConstraint | None],
        history: dict[int, list[int]],
        batch: _Batch,
        step: int,
    ) -> torch.Tensor | None:
        """A [B, V] bool mask of allowed ids, or None when no live sequence is constrained.

        A constraint that allows nothing ends its sequence here, before sampling.
        """
        rows: list[int] = []
        cols: list[int] = []
        constrained: list[int] = []
        for i, ids in list(history.items()):
            allowed = constraints[i].allowed(ids)
            if allowed is None:
                continue
            if not allowed:
                self._end_by_constraint(batch, i, step)
                del history[i]
                continue
            constrained.append(i)
            rows.extend([i] * len(allowed))
            cols.extend(allowed)
        if not constrained:
            return None
        allow = torch.ones(len(constraints), self._vocab, dtype=torch.bool, device=self._device)
        allow[constrained] = False
        index = torch.tensor([rows, cols], device=self._device)
        allow[index[0], index[1]] = True
        return allow

    @staticmethod
    def _end_by_constraint(batch: _Batch, row: int, step: int) -> None:
        batch.lengths[row] = step
        batch.stopped[row] = True
        batch.finished[row] = True

    @staticmethod
    def _record(
        batch: _Batch, step: int, token: torch.Tensor, logprob: torch.Tensor, stop_ids: torch.Tensor
    ) -> None:
        """Store this step's samples; finished rows keep their earlier length and reason."""
        live = ~batch.finished
        batch.tokens[:, step] = token
        batch.logprobs[:, step] = logprob
        batch.lengths += live.long()
        hit_stop = live & torch.isin(token, stop_ids)
        batch.stopped |= hit_stop
        batch.finished |= hit_stop

    @staticmethod
    def _extend_history(
        history: dict[int, list[int]], token: torch.Tensor, stop_ids: torch.Tensor
    ) -> None:
        """Append sampled ids to constrained sequences; drop those that just stopped."""
        tokens = token.tolist()
        stops = set(stop_ids.tolist())
        for i in list(history):
            history[i].append(tokens[i])
            if tokens[i] in stops:
                del history[i]

    def _collect(self, batch: _Batch) -> list[Generation]:
        """Move results to the host once and cut each row to its length."""
        tokens = batch.tokens.tolist()
        logprobs = batch.logprobs.tolist()
        lengths = batch.lengths.tolist()
        stopped = batch.stopped.tolist()
        results = []
        for row, n in enumerate(lengths):
            reason: FinishReason = "stop" if stopped[row] else "length"
            results.append(Generation(tokens[row][:n], logprobs[row][:n], reason, self._version))
        return results

    # -- weights --------------------------------------------------------------------------

    def load_weights(
        self, state_dict_or_path: StateDictOrPath, version: int, strict: bool = True
    ) -> None:
        """Copy weights into the existing tensors in place and set ``version``.

        Accepts a state dict of tensors (any device/dtype; cast on copy) or a path to a
        safetensors file or to a folder of ``*.safetensors`` shards (a ``save_pretrained``
        checkpoint). Tied weights may appear under either or both names (holding the same
        values, as in any state dict of a tied model). Every key and shape is
        checked before anything is copied, so a bad update leaves the old weights intact.
        With ``strict`` (default) every parameter must be provided.
        """
        model = self._live_model()
        incoming = _read_state_dict(state_dict_or_path)
        targets = dict(model.named_parameters(remove_duplicate=False))
        targets.update(model.named_buffers(remove_duplicate=False))
        unknown = sorted(set(incoming) - set(targets))
        if unknown:
            raise KeyError(
                f"weights not in the model: {unknown[:5]}{'...' if len(unknown) > 5 else ''}"
            )
        for name, value in incoming.items():
            if tuple(value.shape) != tuple(targets[name].shape):
                raise ValueError(
                    f"{name}: shape {tuple(value.shape)} != {tuple(targets[name].shape)}"
                )
        if strict:
            given = {id(targets[name]) for name in incoming}
            missing = [n for n, p in model.named_parameters() if id(p) not in given]
            if missing:
                raise KeyError(f"weights missing from the update: {missing[:5]}")
        copied: set[int] = set()
        with torch.no_grad():
            for name, value in incoming.items():
                # Tied weights appear under two names with the same values; copy them once.
                if id(targets[name]) not in copied:
                    targets[name].copy_(value)
                    copied.add(id(targets[name]))
        self._pristine = None  # whole weights replace the base an adapter would merge into
        self._version = int(version)

    def load_adapter(self, tensors: dict[str, torch.Tensor], adapter: AdapterMeta,
                     version: int) -> None:
        """Apply a LoRA adapter in place of the previous one and set ``version``.

        ``merge`` (default) keeps a pristine copy of the targeted weights and writes
        ``W0 + scale · B A`` into the live ones: generation costs what the base costs.
        ``layers`` attaches adapter layers once and copies A and B into them: a load copies
        only the adapter, every generated token pays the extra low-rank matmuls.
        ``bench/lora_sync.py`` measures both."""
        model = self._live_model()
        lora.check_adapter(tensors, adapter,
                           lora.adapter_shapes(lora.linear_shapes(model), adapter))
        if self._adapter_mode == "layers":
            self._load_adapter_layers(model, tensors, adapter)
        else:
            self._merge_adapter(model, tensors, adapter)
        self._version = int(version)

    def _merge_adapter(self, model, tensors, adapter: AdapterMeta) -> None:
        """Merge from pristine copies, taken the first time a weight is targeted; weights the
        previous adapter changed and this one does not (other targets) go back to pristine."""
        params = dict(model.named_parameters())
        if self._pristine is None:
            self._pristine = {}
        for module, _ in lora.targeted(model, adapter.target_tuple):
            name = f"{module}.weight"
            if name not in self._pristine:
                self._pristine[name] = params[name].detach().clone()
        merged = lora.merged_weights(self._pristine, tensors, adapter)
        with torch.no_grad():
            for name, value in self._pristine.items():
                params[name].copy_(merged.get(name, value))

    def _load_adapter_layers(self, model, tensors, adapter: AdapterMeta) -> None:
        if self._attached is None:
            lora.attach(model, adapter)
            self._attached = adapter
        elif (self._attached.rank, self._attached.targets) != (adapter.rank, adapter.targets):
            raise ValueError(f"adapter rank {adapter.rank} targets {adapter.targets} differ from "
                             f"the attached layers' (rank {self._attached.rank}, targets "
                             f"{self._attached.targets}): restart the engine")
        for module in model.modules():  # alpha may differ per version; rank and targets not
            if getattr(module, "lora_enabled", False):
                module.lora_scale = adapter.scale
        lora.load_adapter(model, {k: v.to(self._device, self._dtype) for k, v in tensors.items()})

    def close(self) -> None:
        """Drop the model; on GPU also return cached memory to the driver."""
        self._model = None
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    # -- helpers --------------------------------------------------------------------------

    def _live_model(self) -> torch.nn.Module:
        if self._model is None:
            raise RuntimeError("backend is closed")
        return self._model

    def _find_logits_kwarg(self) -> dict[str, int]:
        """Ask the model for last-position logits only (the name changed across versions)."""
        accepted = inspect.signature(self._model.forward).parameters
        for name in ("logits_to_keep", "num_logits_to_keep"):
            if name in accepted:
                return {name: 1}
        return {}

    def _stop_ids(self, params: SamplingParams) -> torch.Tensor:
        ids = set(params.stop_token_ids)
        eos = self._tokenizer.eos_token_id
        if eos is not None and not params.ignore_eos:
            ids.add(int(eos))
        return torch.tensor(sorted(ids), dtype=torch.long, device=self._device)

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-align prompts so every sequence's next token sits in the last column."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        return ids.to(self._device), mask.to(self._device)

    def _empty_batch(self, size: int, max_new: int) -> _Batch:
        dev = self._device
        return _Batch(
            tokens=torch.full((size, max_new), self._pad_id, dtype=torch.long, device=dev),
            logprobs=torch.zeros((size, max_new), dtype=torch.float32, device=dev),
            lengths=torch.zeros(size, dtype=torch.long, device=dev),
            stopped=torch.zeros(size, dtype=torch.bool, device=dev),
            finished=torch.zeros(size, dtype=torch.bool, device=dev),
        )
