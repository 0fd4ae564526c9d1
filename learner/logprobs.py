"""Per-token log-probabilities of a sequence under a causal LM."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    chunk_tokens: int = 0,
    needed: torch.Tensor | None = None,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``out[b, t] = log p(x_t | x_<t)`` for every position, aligned with ``input_ids``.

    Position 0 has no context and is 0, as is every padding position (``attention_mask == 0``).
    Works with any Hugging Face causal LM (``model(input_ids=..., attention_mask=...).logits``);
    rows must be right-padded, since positions are counted from the start of the row.
    Returns float32 ``[B, L]``; differentiable when the model is.

    Memory: with ``chunk_tokens == 0`` the model's own forward makes the whole ``[B, L, V]``
    logits, and autograd keeps their float32 log-softmax too. At a real vocabulary (49,152 for
    SmolLM2) that is most of a step's memory and time. With ``chunk_tokens > 0`` only the
    decoder runs whole; the output head, log-softmax and gather run ``chunk_tokens`` positions
    at a time, each under activation checkpointing, so at most one chunk's logits exist at
    once, forward or backward (the head is recomputed per chunk in the backward pass).
    Chunking needs the usual layout ``logits = lm_head(decoder(x))`` (Llama, Qwen2, Mistral,
    SmolLM2); :func:`check_chunked_head` tells whether a model has it.

    ``needed`` (``[B, L]``, with ``chunk_tokens > 0``): only these positions are scored, the
    rest are 0. The loss reads only the generated tokens, a few percent of a multi-turn
    trajectory; the output head and log-softmax at every other position are pure waste.

    ``entropy``: also return ``H[b, t]``, the entropy (nats) of the distribution ``x_t`` was
    scored under, ``[B, L]`` float32, 0 wherever ``out`` is 0 for want of scoring (position 0,
    padding, and with the chunked head positions not ``needed``). It is read off the same
    logits, detached: nothing of it is kept for the backward pass, and its float32
    probabilities exist for :data:`ENTROPY_SLICE` positions (or one chunk) at a time.

    ``entropy_grad`` (implies ``entropy``): the entropy carries gradient, for a loss term
    (``learner.entropy_coef``). Its values are the same, but only at ``needed`` positions
    when ``needed`` is given (0 elsewhere, whole logits too). Memory: with the chunked head
    nothing more is kept (each chunk's entropy is recomputed in the backward pass with its
    log-probs); with whole logits the logits of the scored positions are kept, and the
    softmax is recomputed from them :data:`ENTROPY_SLICE` positions at a time.
    """
    entropy = entropy or entropy_grad
    targets = input_ids[:, 1:]
    if chunk_tokens <= 0:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        # logits[:, t] predicts x_{t+1}: pair logits[:, :-1] with targets input_ids[:, 1:].
        picked = _pick(logits[:, :-1], targets)
        spread = None
        if entropy_grad:
            where = attention_mask[:, 1:].bool()
            spread = _entropy_grad(logits[:, :-1], where if needed is None
                                   else where & needed[:, 1:].bool())
        elif entropy:
            spread = _entropy(logits[:, :-1])
    else:
        hidden = model.get_decoder()(input_ids=input_ids,
                                     attention_mask=attention_mask).last_hidden_state
        head = model.get_output_embeddings()
        if needed is None:
            picked, spread = _chunked_head(head, hidden[:, :-1], targets, chunk_tokens, entropy,
                                           entropy_grad)
        else:
            where = needed[:, 1:].bool() & attention_mask[:, 1:].bool()
            scored, scored_h = _chunked_head(head, hidden[:, :-1][where][None],
                                             targets[where][None], chunk_tokens, entropy,
                                             entropy_grad)
            picked = _scatter(where, scored[0])
            spread = _scatter(where, scored_h[0]) if entropy else None
    out = _aligned(picked, attention_mask)
    return (out, _aligned(spread, attention_mask)) if entropy else out


def _aligned(picked: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L-1]`` values of positions 1.. as ``[B, L]``: 0 at position 0 and on padding."""
    zero = torch.zeros_like(attention_mask[:, :1], dtype=torch.float32)
    out = torch.cat([zero, picked], dim=1)
    # where, not multiply: a -inf log-prob at a padding position must not turn into NaN.
    return torch.where(attention_mask.bool(), out, torch.zeros_like(out))


def _scatter(where: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` (one per true entry of ``where``) at their places in zeros shaped ``where``."""
    out = torch.zeros(where.shape, dtype=torch.float32, device=values.device)
    return out.masked_scatter(where, values.float())


# Positions whose float32 probabilities the entropy holds at once when the logits are whole
# (chunk_tokens=0): at SmolLM2's 49,152 words, 256 positions are 50 MB per temporary.
ENTROPY_SLICE = 256


def _pick(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log-softmax of ``logits [..., V]`` (float32) at ``targets [...]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of ``softmax(logits)`` over the last axis, float32, shaped ``logits[..., 0]``;
    detached, and ``ENTROPY_SLICE`` positions at a time, so it adds no ``[.., V]`` tensor of
    the size of the logits, and none that autograd keeps."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    return _sliced_entropy(flat, checkpointed=False).reshape(logits.shape[:-1])


def _entropy_grad(logits: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`_entropy` with gradient, at the positions ``where`` (``logits.shape[:-1]``, 0
    elsewhere), or everywhere. Each slice runs under activation checkpointing: autograd
    keeps the slice of logits it reads, never its float32 softmax."""
    if where is None:
        flat = logits.reshape(-1, logits.shape[-1])
        return _sliced_entropy(flat, checkpointed=True).reshape(logits.shape[:-1])
    # Only the positions asked for: the rows autograd keeps are these, not all the logits.
    return _scatter(where, _sliced_entropy(logits[where], checkpointed=True))


def _sliced_entropy(flat: torch.Tensor, checkpointed: bool) -> torch.Tensor:
    """The entropy of each row of ``flat [N, V]``, ``ENTROPY_SLICE`` rows at a time."""
    grad = checkpointed and torch.is_grad_enabled() and flat.requires_grad
    parts = [checkpoint(_softmax_entropy, flat[s:s + ENTROPY_SLICE], use_reentrant=False)
             if grad else _softmax_entropy(flat[s:s + ENTROPY_SLICE])
             for s in range(0, flat.shape[0], ENTROPY_SLICE)]
    return torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)


def _softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _head_pick(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _pick(head(hidden), targets)


def _head_pick_entropy(head, hidden: torch.Tensor,
                       targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden)
    return _pick(logits, targets), _entropy(logits)


def _head_pick_entropy_grad(head, hidden: torch.Tensor,
                            targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_head_pick_entropy` with the entropy's gradient: run under the chunk's own
    checkpoint, which already bounds what it keeps to one chunk."""
    logits = head(hidden)
    return _pick(logits, targets), _sliced_entropy(logits, checkpointed=False)


def _chunked_head(head, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                  entropy: bool = False, entropy_grad: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_pick(head(hidden), targets)`` over rows of ``[B, T]`` positions, ``chunk_tokens``
    positions at a time (flattened over the batch, so short rows do not waste a chunk), and
    with ``entropy`` each position's entropy from the same chunk's logits (detached, or with
    ``entropy_grad`` with gradient), else None."""
    b, t, h = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(b * t, h), targets.reshape(b * t)
    grad = torch.is_grad_enabled() and flat_hidden.requires_grad
    entropy = entropy or entropy_grad
    work = _head_pick_entropy_grad if entropy_grad else \
        _head_pick_entropy if entropy else _head_pick
    parts = []
    for s in range(0, b * t, chunk_tokens):
        piece = (flat_hidden[s:s + chunk_tokens], flat_targets[s:s + chunk_tokens])
        done = checkpoint(work, head, *piece, use_reentrant=False) if grad \
            else work(head, *piece)
        parts.append(done if entropy else (done,))
    columns = list(zip(*parts)) or [()] * (2 if entropy else 1)
    joined = [torch.cat(c).reshape(b, t) if c else
              flat_hidden.new_zeros((b, t), dtype=torch.float32) for c in columns]
    return joined[0], (joined[1] if entropy else None)


@torch.no_grad()
def check_chunked_head(model, vocab_size: int | None = None, atol: float = 1e-4) -> None:
    """Raise ValueError unless chunked log-probs equal the model's own on a short random
    sequence (a model whose logits are more than ``lm_head(decoder(x))``, e.g. soft-capped or
    scaled, cannot be chunked this way)."""
    vocab = vocab_size or model.get_output_embeddings().weight.shape[0]
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 9), generator=gen).to(device)
    mask = torch.ones_like(ids)
    whole = token_logprobs(model, ids, mask)
    chunked = token_logprobs(model, ids, mask, chunk_tokens=5)
    if not torch.allclose(whole, chunked, atol=atol, rtol=0):
        raise ValueError(f"{type(model).__name__}: log-probs through its decoder and output "
                         f"head differ from its logits by {float((whole - chunked).abs().max())}"
                         f"; set learner.logit_chunk_tokens=0 for this model")


def prepare_for_training(model, logit_chunk_tokens: int, gradient_checkpointing: bool):
    """The learner's memory settings on a freshly loaded model (before any wrapping):
    activation checkpointing of the decoder, and a check that its head can be chunked."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if logit_chunk_tokens:
        check_chunked_head(model)
    return model
