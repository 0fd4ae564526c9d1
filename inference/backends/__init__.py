"""Inference backends: the engines that turn prompts (token ids) into sampled actions.

``InferenceBackend`` is the contract; ``TransformersBackend`` runs anywhere (the CPU
default); a vLLM engine implements the same interface on GPU. ``ActionTrie`` constrains
generation to a fixed set of action strings.
"""

from inference.backends.base import FinishReason, Generation, InferenceBackend, SamplingParams
from inference.backends.constraint import ActionTrie, TokenConstraint


def __getattr__(name: str):
    # Imported lazily: transformers takes seconds to import and a vLLM actor never needs it.
    if name == "TransformersBackend":
        from inference.backends.hf import TransformersBackend

        return TransformersBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ActionTrie",
    "FinishReason",
    "Generation",
    "InferenceBackend",
    "SamplingParams",
    "TokenConstraint",
    "TransformersBackend",
]
