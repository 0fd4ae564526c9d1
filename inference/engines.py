"""Which generation engine a run's config names, built behind :class:`InferenceBackend`."""

from __future__ import annotations

from inference.backends.base import InferenceBackend
from inference.models import model_folder
from protocol.config import RunConfig


def make_backend(cfg: RunConfig, model_path: str | None = None) -> InferenceBackend:
    """The engine ``actor.backend`` names; both sit behind the same interface."""
    path = model_folder(model_path or cfg.model.path)  # a named model: its converted folder
    if cfg.actor.backend == "vllm":
        from inference.backends.vllm import VLLMBackend

        return VLLMBackend(path, gpu_memory_utilization=cfg.actor.gpu_memory_utilization,
                           enable_prefix_caching=cfg.actor.prefix_caching, seed=cfg.seed)
    from inference.backends.hf import TransformersBackend

    return TransformersBackend(path, device=cfg.actor.device)
