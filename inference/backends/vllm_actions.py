"""The action constraint inside a vLLM engine: a per-request logits processor.

vLLM loads this module in its worker (``ACTION_PROCESSOR`` in :mod:`inference.backends.vllm`); a
request opts in through ``SamplingParams.extra_args[EXTRA_KEY]``
with its action token ids, so a constrained turn is one engine call, not one per token.

Why a logits processor and not vLLM's structured outputs (a ``choice`` or regex grammar): vLLM
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

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from inference.backends.constraint import ActionTrie
from inference.backends.vllm import EXTRA_KEY


class ActionTrieProcessor(AdapterLogitsProcessor):
    """Masks each opted-in request's logits to the ids its action trie allows next."""

    def is_argmax_invariant(self) -> bool:
        return False  # masking moves the argmax

    def new_req_logits_processor(self, params: Any):
        spec = (params.extra_args or {}).get(EXTRA_KEY)
        if not spec:
            return None
        trie = ActionTrie.from_token_ids(spec["actions"], int(spec["end"]))
        end = trie.end_token_id

        def mask(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            allowed = trie.allowed_or_end(output_ids)
            keep = torch.tensor(allowed or [end], device=logits.device)
            kept = logits[keep].clone()
            logits.fill_(float("-inf"))
            logits[keep] = kept
            return logits

        return mask
