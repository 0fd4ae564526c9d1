"""Per-token log-probabilities of a sequence under a causal LM."""

from __future__ import annotations

import torch


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``out[b, t] = log p(x_t | x_<t)`` for every position, aligned with ``input_ids``.

    Position 0 has no context and is 0, as is every padding position (``attention_mask == 0``).
    Works with any Hugging Face causal LM (``model(input_ids=..., attention_mask=...).logits``);
    rows must be right-padded, since positions are counted from the start of the row.

    Memory: the logits ``[B, L, V]`` are the one full-vocabulary tensor; the log-softmax is done
    ``chunk_size`` positions at a time (all at once when ``None``), in float32, and reduced to
    the ``[B, chunk]`` log-probs of the actual next tokens by ``gather`` before the next chunk.
    (Under autograd each chunk's log-softmax is kept for the backward pass; that is inherent.)
    Returns float32 ``[B, L]``; differentiable when the model is.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    # logits[:, t] predicts x_{t+1}: pair logits[:, :-1] with targets input_ids[:, 1:].
    targets = input_ids[:, 1:]
    steps = targets.shape[1]
    chunk = steps if chunk_size is None else max(1, int(chunk_size))
    parts = []
    for s in range(0, steps, chunk):
        e = min(s + chunk, steps)
        logp = torch.log_softmax(logits[:, s:e].float(), dim=-1)
        parts.append(logp.gather(-1, targets[:, s:e].unsqueeze(-1)).squeeze(-1))
    zero = torch.zeros_like(input_ids[:, :1], dtype=torch.float32)
    out = torch.cat([zero, *parts], dim=1)
    # where, not multiply: a -inf log-prob at a padding position must not turn into NaN.
    return torch.where(attention_mask.bool(), out, torch.zeros_like(out))
