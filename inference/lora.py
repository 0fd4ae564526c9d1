"""Low-rank adapters (LoRA) on a Hugging Face causal LM, in a few dozen lines of our own.

A targeted ``nn.Linear`` keeps its class, its name and its frozen ``weight``; it gains two
parameters, ``lora_A`` ``[rank, in]`` and ``lora_B`` ``[out, rank]`` (zero at the start, so a
fresh adapter is the base model exactly), and a forward hook that adds
``scale · B(A(dropout(x)))`` to its output, ``scale = alpha / rank``. Because nothing is
renamed or wrapped, the base keeps its state-dict keys (a merged export is an ordinary
checkpoint of the base architecture), DDP and FSDP2 shard and sync the adapter with the rest of
the block, and the adapter's own keys are the base module's name plus ``.lora_A``/``.lora_B``.

Why not ``peft``: it wraps every targeted module in a new class (renaming the base's keys to
``base_layer.weight``), pulls in ``accelerate``, and would still need our own code for the
parts that matter here: an adapter-only wire format with the base's digest, merging into an
engine's live weights and hot-swapping per version.

What crosses the weight channel is :func:`adapter_state` (plain tensors) with an
:class:`protocol.weights.AdapterMeta` in the file's metadata; an engine applies it with
:func:`merged_weights` (merge into its own copy of the base) or :func:`attach` +
:func:`load_adapter` (adapter layers).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import hashlib
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from protocol.weights import AdapterMeta

SUFFIXES = (".lora_A", ".lora_B")


def is_adapter_key(name: str) -> bool:
    return name.endswith(SUFFIXES)


def matches(module_name: str, targets: tuple[str, ...]) -> bool:
    """A target is a module's last name (``q_proj``) or a glob over its full name
    (``model.layers.*.mlp.*``)."""
    last = module_name.rsplit(".", 1)[-1]
    return any(last == t or fnmatch.fnmatchcase(module_name, t) for t in targets)


def adaptable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The linear layers an adapter may target, in model order (the output head never: tied
    to the embeddings in small models, and an adapter there buys little)."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name and not name.endswith("lm_head")]


def linear_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of every adaptable linear layer, by module name."""
    return {name: (m.out_features, m.in_features) for name, m in adaptable(model)}


def _no_match(targets: tuple[str, ...], names) -> ValueError:
    last = sorted({n.rsplit(".", 1)[-1] for n in names})
    return ValueError(f"learner.lora_targets {list(targets)} match no linear layer of the "
                      f"model; its linear layers are named {last}")


def targeted(model: torch.nn.Module, targets: tuple[str, ...]) -> list[tuple[str, torch.nn.Linear]]:
    """The adaptable linear layers ``targets`` names, in model order."""
    layers = adaptable(model)
    out = [(name, m) for name, m in layers if matches(name, targets)]
    if not out:
        raise _no_match(targets, [name for name, _ in layers])
    return out


def adapter_shapes(linears: dict[str, tuple[int, int]],
                   meta: AdapterMeta) -> dict[str, tuple[int, int]]:
    """The tensors (key -> shape) an adapter of ``meta``'s rank and targets must hold, for a
    model whose adaptable linear layers are ``linears`` (:func:`linear_shapes`)."""
    names = [n for n in linears if matches(n, meta.target_tuple)]
    if not names:
        raise _no_match(meta.target_tuple, linears)
    shapes = {}
    for name in names:
        out, inp = linears[name]
        shapes[f"{name}.lora_A"] = (meta.rank, inp)
        shapes[f"{name}.lora_B"] = (out, meta.rank)
    return shapes


def _hook(module: torch.nn.Linear, args, output: torch.Tensor) -> torch.Tensor:
    if not module.lora_enabled:
        return output
    x = args[0]
    if module.lora_dropout and module.training:
        x = F.dropout(x, module.lora_dropout)
    # In the input's dtype: under autocast the adapter runs in bf16 like the base matmul.
    a, b = module.lora_A.to(x.dtype), module.lora_B.to(x.dtype)
    # In place: the base output is not saved for backward, and an out-of-place sum would
    # allocate two more activations of the output's size per adapted layer and token.
    return output.add_(F.linear(F.linear(x, a), b), alpha=module.lora_scale)


def attach(model: torch.nn.Module, meta: AdapterMeta, dropout: float = 0.0,
           init_seed: int | None = None) -> list[str]:
    """Give every targeted linear layer of ``model`` a zero adapter (A random as in the LoRA
    paper, B zero) and freeze everything else; returns the adapter's keys. Attaching twice is
    refused (the hooks would add twice)."""
    if any(is_adapter_key(n) for n, _ in model.named_parameters()):
        raise ValueError("the model already has adapters attached")
    generator = torch.Generator().manual_seed(init_seed) if init_seed is not None else None
    model.requires_grad_(False)
    keys = []
    for name, linear in targeted(model, meta.target_tuple):
        weight = linear.weight
        a = torch.empty(meta.rank, linear.in_features)
        bound = 1.0 / math.sqrt(linear.in_features)  # kaiming_uniform(a=sqrt(5)), as nn.Linear
        a.uniform_(-bound, bound, generator=generator)
        linear.lora_A = torch.nn.Parameter(a.to(weight.device, weight.dtype))
        linear.lora_B = torch.nn.Parameter(torch.zeros(linear.out_features, meta.rank,
                                                       device=weight.device, dtype=weight.dtype))
        linear.lora_scale = meta.scale
        linear.lora_dropout = float(dropout)
        linear.lora_enabled = True
        linear.register_forward_hook(_hook)
        keys += [f"{name}.lora_A", f"{name}.lora_B"]
    return keys


def adapter_state(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a (full) state dict."""
    return {k: v for k, v in state_dict.items() if is_adapter_key(k)}


def check_adapter(tensors: dict[str, torch.Tensor], meta: AdapterMeta,
                  expected: dict[str, tuple[int, ...]]) -> None:
    """Refuse an adapter whose keys or shapes are not the ones ``expected`` (key -> shape),
    before anything is copied: one line naming the first difference."""
    missing, unknown = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise ValueError(f"adapter (rank {meta.rank}, targets {meta.targets}) does not fit this "
                         f"model: missing {missing[:3]}, unknown {unknown[:3]}")
    for key, value in tensors.items():
        if tuple(value.shape) != tuple(expected[key]):
            raise ValueError(f"adapter tensor {key}: shape {tuple(value.shape)}, the model "
                             f"needs {tuple(expected[key])}")


def load_adapter(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy an adapter into ``model``'s attached adapter in place (all keys checked first)."""
    params = {k: p for k, p in model.named_parameters() if is_adapter_key(k)}
    for key, value in tensors.items():
        if key not in params or params[key].shape != value.shape:
            raise ValueError(f"adapter tensor {key} does not fit the attached adapter")
    if set(params) != set(tensors):
        raise ValueError(f"adapter has {len(tensors)} tensors, the model {len(params)}")
    with torch.no_grad():
        for key, value in tensors.items():
            params[key].copy_(value)


def delta(tensors: dict[str, torch.Tensor], module: str, scale: float,
          device: torch.device | str) -> torch.Tensor:
    """``scale · B A`` of one module on ``device``: what the adapter adds to its weight."""
    a, b = (tensors[f"{module}.lora_{x}"].to(device, torch.float32) for x in "AB")
    return (b @ a) * scale


def adapted_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted({k.rsplit(".", 1)[0] for k in tensors if is_adapter_key(k)})


def merged_weights(base: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                   meta: AdapterMeta) -> dict[str, torch.Tensor]:
    """The targeted modules' weights with the adapter merged in (``W + scale · B A``), in the
    base's dtype and on its device (an engine on a GPU gets the adapter as read from a file, on
    the CPU); ``base`` holds at least those weights (``<module>.weight``), pristine."""
    out = {}
    for module in adapted_modules(tensors):
        weight = base[f"{module}.weight"]
        out[f"{module}.weight"] = (weight.float() + delta(tensors, module, meta.scale,
                                                          weight.device)).to(weight.dtype)
    return out


def merge_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor],
               meta: AdapterMeta) -> None:
    """Merge an adapter into a plain model's weights in place (an export: the result is an
    ordinary checkpoint of the base architecture)."""
    params = dict(model.named_parameters())
    wanted = [f"{m}.weight" for m in adapted_modules(tensors)]
    unknown = [w for w in wanted if w not in params]
    if unknown:
        raise ValueError(f"the adapter names modules this model lacks: {unknown[:3]}")
    merged = merged_weights({w: params[w].detach() for w in wanted}, tensors, meta)
    with torch.no_grad():
        for name, value in merged.items():
            params[name].copy_(value)


@contextlib.contextmanager
def disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model, for as long as the block runs: the KL reference with no second copy."""
    linears = [m for m in model.modules() if getattr(m, "lora_enabled", False)]
    for m in linears:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in linears:
            m.lora_enabled = True


def to_peft_folder(tensors: dict[str, torch.Tensor], meta: AdapterMeta,
                   folder: str | os.PathLike) -> Path:
    """Write the adapter as a PEFT LoRA folder (``adapter_config.json`` +
    ``adapter_model.safetensors``), the format vLLM's ``LoRARequest`` and ``peft`` read."""
    import json

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    peft = {f"base_model.model.{k}.weight": v.contiguous() for k, v in tensors.items()}
    save_file(peft, str(folder / "adapter_model.safetensors"))
    names = sorted({m.rsplit(".", 1)[-1] for m in adapted_modules(tensors)})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": meta.rank,
        "lora_alpha": meta.alpha, "target_modules": names, "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
        "base_model_name_or_path": meta.base_id}))
    return folder


@functools.lru_cache(maxsize=8)
def _digest_of(files: tuple[tuple[str, int, int], ...]) -> str:
    sha = hashlib.sha256()
    for path, _, _ in files:
        sha.update(Path(path).name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                sha.update(chunk)
    return sha.hexdigest()


def base_digest(folder: str | os.PathLike) -> str:
    """SHA-256 of a model folder's weight files (``*.safetensors``, by name): the identity an
    adapter is checked against. Cached per process while the files are unchanged."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}: an adapter needs its "
                                f"base model's weight files to check it against")
    return _digest_of(tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))
