"""The token constraints inside a vLLM engine: a per-request logits processor.

vLLM loads this module in its worker (``ACTION_PROCESSOR`` in :mod:`inference.backends.vllm`);
a request opts in through ``SamplingParams.extra_args[EXTRA_KEY]`` with its constraint's
``spec()`` (an action trie's token ids, a call grammar, a thought before either), so a
constrained turn is one engine call, not one per token. The worker makes the constraint again
from the spec over its own tokenizer (``constraint.TokenizerFacts.from_spec``).

Why a logits processor and not vLLM's structured outputs (a ``choice`` or grammar): vLLM
applies a grammar's bitmask to the logits *before* its sampler computes raw log-probs, so
every constrained token's "raw" log-prob comes back renormalised over the allowed ids, and the
learner (which recomputes the unmasked log-softmax) would see importance weights below 1 on
every constrained token. Custom logits processors run after the raw log-probs are taken
(``Sampler.forward`` in 0.32.0), exactly as the transformers backend reports them. A trie of
token ids is also exact for any tokenizer (the word-level tiny model's included), where a
grammar over text lets the model spell an action in a tokenization the actor never built.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from inference.backends.constraint import TokenizerFacts
from inference.backends.vllm import EXTRA_KEY


class ConstraintProcessor(AdapterLogitsProcessor):
    """Masks each opted-in request's logits to the ids its constraint allows next."""

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self._tokenizer_path = vllm_config.model_config.tokenizer
        self._facts: dict[int, TokenizerFacts] = {}  # by end id, made on a grammar's first use

    def is_argmax_invariant(self) -> bool:
        return False  # masking moves the argmax

    def _facts_for(self, end: int) -> TokenizerFacts:
        if end not in self._facts:
            from transformers import AutoTokenizer

            from inference.codecs import special_tokens

            tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
            self._facts[end] = TokenizerFacts(tokenizer, end,
                                              frozenset(special_tokens(tokenizer).values()))
        return self._facts[end]

    def new_req_logits_processor(self, params: Any):
        spec = (params.extra_args or {}).get(EXTRA_KEY)
        if not spec:
            return None
        end = int(spec["end"])
        if spec["kind"] == "actions":  # no tokenizer needed: the ids travel with the request
            constraint = TokenizerFacts(None, end, frozenset()).from_spec(spec)
        else:
            constraint = self._facts_for(end).from_spec(spec)

        ask = getattr(constraint, "allowed_bits", constraint.allowed)

        def mask(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            try:
                allowed = ask(list(output_ids))
            except ValueError:  # ids that left a trie: end the row (raising would kill the engine)
                allowed = []
            if allowed is None:
                return logits
            if isinstance(allowed, np.ndarray):  # a grammar's whole mask, one bool an id
                keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
                n = min(len(allowed), len(keep))
                keep[:n] = torch.from_numpy(allowed[:n])
                keep[end] |= not bool(keep.any())
                return logits.masked_fill_(~keep, float("-inf"))
            keep = torch.tensor(allowed or [end], device=logits.device)
            kept = logits[keep].clone()
            logits.fill_(float("-inf"))
            logits[keep] = kept
            return logits

        return mask
