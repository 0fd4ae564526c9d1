"""The learner's rows without padding, and a group's shared prompt computed once
(``learner.layout``).

``padded`` (the default) runs a micro-batch as ``[rows, longest row]``: every rollout of a
GRPO group recomputes the prompt it shares with the other seven (system prompt, task, first
observation), forward and backward, and short rows pay for the longest one's padding.

``packed`` lays the micro-batch's rows end to end in one sequence ``[1, T]``, each row's
positions counted from 0, and each row attends only to itself. ``shared_prefix`` also puts
the tokens that rows have in common at the same positions once: the rows of a micro-batch
form a prefix tree over their tokens (:func:`pack_rows`; a group's rollouts share their
prompt, experience-guided rows whose prompt differs branch off where it differs, rows of
other groups share the system prompt), each node of the tree is laid out once, and each
node's tokens attend to their ancestors' tokens and causally to their own, never to a
sibling's. Positions continue from where the node starts in its rows. The gradient of a
shared node is the sum of what its descendants send back, which is what the unshared rows'
gradients add up to: the step is the same up to float rounding (tests/test_packed_learner.py).

The log-prob of a row's token ``t`` comes from the hidden state at the row's token ``t - 1``,
wherever that lies: the first token after a shared prompt is predicted from the prompt's last
position, which every continuation gathers (and sends its gradient back to) for itself.
:func:`layout_logprobs` returns the ``[rows, L]`` log-probs :func:`learner.logprobs.
token_logprobs` returns, so the loss, the token log and everything after them are unchanged.

The attention: transformers (5.19 and 5.24, both virtualenvs) takes a custom 4D mask as it is,
but a dense ``[T, T]`` mask costs attention over every pair of a packed sequence, masked or
not, and ``position_ids`` that restart are not honoured by sdpa on its own (the second row
reads the first). So the model's attention function is one registered here
(:func:`enable_packing`): given the layout (passed through the forward's keyword arguments,
which reach every attention call, also when activation checkpointing recomputes a layer), each
tree node's queries are gathered with exactly the keys they may see and run through
``scaled_dot_product_attention`` in a few batches of similar size; without a layout it is
transformers' own sdpa. A model whose attention does not go through transformers' attention
interface is refused at load (:func:`check_packing`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F

from learner.logprobs import _chunked_head, _entropy, _entropy_grad, _pick, token_logprobs

LAYOUTS = ("padded", "packed", "shared_prefix")
ATTENTION = "autodidact_packed"  # the name the attention function is registered under
LAYOUT_KWARG = "autodidact_layout"  # the forward's keyword argument that carries the layout
# A node batch may pad its queries × keys to this many times what its nodes need before a
# new batch is started: fewer kernel calls against less wasted attention.
BUCKET_SLACK = 1.3


@dataclass
class Attention:
    """Which packed positions each query block attends to: one entry per batch of tree nodes.

    * ``queries[b]`` long ``[S, Q]`` — the packed positions of each node's tokens (padded
      with 0);
    * ``keys[b]`` long ``[S, K]`` — the packed positions of the tokens they may see: their
      row's tokens from 0 to the node's end (padded with 0);
    * ``masks[b]`` bool ``[S, 1, Q, K]`` — query ``i`` of a node starting at row position
      ``lo`` sees key ``j`` iff ``j <= lo + i`` (a padding query sees key 0, so no row of the
      softmax is empty);
    * ``kept[b]`` long — where the real queries lie in the flattened ``[S * Q]`` output;
    * ``order`` long ``[T]`` — for each packed position, where its output lies in the
      concatenation of every batch's kept outputs.
    """

    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    masks: list[torch.Tensor]
    kept: list[torch.Tensor]
    order: torch.Tensor

    def to(self, device) -> Attention:
        def move(xs):
            return [x.to(device, non_blocking=True) for x in xs]
        return Attention(move(self.queries), move(self.keys), move(self.masks), move(self.kept),
                         self.order.to(device, non_blocking=True))


@dataclass
class PackedRows:
    """A micro-batch's rows as one packed sequence.

    * ``input_ids``, ``position_ids`` long ``[1, T]`` — each tree node's tokens once, at their
      positions in their rows;
    * ``index`` long ``[B, L]`` — the packed position of each row token, -1 on padding;
    * ``attention`` — :class:`Attention`;
    * ``row_tokens`` — the rows' real tokens (sum of lengths), what ``padded`` would have
      run without padding; ``T`` is what runs.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    index: torch.Tensor
    attention: Attention
    row_tokens: int

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device) -> PackedRows:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("input_ids", "position_ids", "index"):
            moved[name] = moved[name].to(device, non_blocking=True)
        moved["attention"] = self.attention.to(device)
        return PackedRows(**moved)


@dataclass(frozen=True)
class _Node:
    row: int  # a row that holds the node's tokens (every row below it holds the same)
    lo: int  # [lo, hi): the node's tokens in that row
    hi: int


def prefix_tree(rows: list[np.ndarray], share: bool = True) -> tuple[list[_Node], list[list[int]]]:
    """The nodes of the rows' prefix tree (each after its parent) and each row's path of nodes
    from the root. A node is the longest run of tokens all rows below it have in common;
    every row keeps at least its last token as a node of its own (so a row equal to, or a
    prefix of, another still ends in its own node). Without ``share``, each row is one node."""
    if not share:
        nodes = [_Node(r, 0, len(t)) for r, t in enumerate(rows) if len(t)]
        paths = [[] for _ in rows]
        for k, n in enumerate(nodes):
            paths[n.row].append(k)
        return nodes, paths
    nodes: list[_Node] = []
    paths: list[list[int]] = [[] for _ in rows]
    live = [r for r, t in enumerate(rows) if len(t)]  # an empty row has no node

    def add(row: int, lo: int, hi: int, members) -> None:
        nodes.append(_Node(row, lo, hi))
        for m in members:
            paths[m].append(len(nodes) - 1)

    stack = [(live, 0)] if live else []
    while stack:
        members, start = stack.pop()
        if len(members) == 1:
            add(members[0], start, len(rows[members[0]]), members)
            continue
        first = rows[members[0]]
        end = min(len(rows[m]) for m in members) - 1  # each keeps a token of its own
        common = end
        for m in members[1:]:
            differ = np.flatnonzero(first[start:common] != rows[m][start:common])
            if differ.size:
                common = start + int(differ[0])
        if common > start:
            add(members[0], start, common, members)
        by_token: dict[int, list[int]] = {}
        for m in members:
            by_token.setdefault(int(rows[m][common]), []).append(m)
        if len(by_token) == 1 and common == end:
            # The shortest rows end one token on: that token is their own; the others go on
            # sharing from here.
            short = [m for m in members if len(rows[m]) == end + 1]
            for m in short:
                add(m, common, len(rows[m]), [m])
            rest = [m for m in members if len(rows[m]) > end + 1]
            if rest:
                stack.append((rest, common))
            continue
        # Reversed, so the stack takes the branches in the order rows came.
        stack.extend((branch, common) for branch in reversed(list(by_token.values())))
    return nodes, paths


def pack_rows(input_ids: np.ndarray, lengths: np.ndarray, share: bool) -> PackedRows:
    """The rows ``input_ids[b, :lengths[b]]`` (a right-padded ``[B, L]`` batch, on the host)
    packed into one sequence, shared prefixes once with ``share``."""
    input_ids = np.asarray(input_ids)
    rows = [input_ids[b, :int(n)] for b, n in enumerate(lengths)]
    nodes, paths = prefix_tree(rows, share)
    starts = np.cumsum([0] + [n.hi - n.lo for n in nodes])
    total = int(starts[-1])
    ids = np.concatenate([rows[n.row][n.lo:n.hi] for n in nodes]) if nodes else \
        np.zeros(0, dtype=np.int64)
    positions = np.concatenate([np.arange(n.lo, n.hi) for n in nodes]) if nodes else \
        np.zeros(0, dtype=np.int64)
    index = np.full(input_ids.shape, -1, dtype=np.int64)
    for b, path in enumerate(paths):
        for k in path:
            n = nodes[k]
            index[b, n.lo:n.hi] = np.arange(starts[k], starts[k + 1])
    attention = _attention(nodes, index, total)
    return PackedRows(input_ids=torch.from_numpy(ids.astype(np.int64))[None],
                      position_ids=torch.from_numpy(positions.astype(np.int64))[None],
                      index=torch.from_numpy(index), attention=attention,
                      row_tokens=int(sum(len(r) for r in rows)))


def _attention(nodes: list[_Node], index: np.ndarray, total: int) -> Attention:
    """Batches of nodes of similar size (longest key run first), each padded to its largest
    node, and the masks that keep each query to its ancestors and the causal part of its own
    node."""
    order = sorted(range(len(nodes)), key=lambda k: (-nodes[k].hi, -(nodes[k].hi - nodes[k].lo)))
    batches: list[list[int]] = []
    for k in order:
        if batches:
            trial = batches[-1] + [k]
            q = max(nodes[j].hi - nodes[j].lo for j in trial)
            kk = max(nodes[j].hi for j in trial)
            need = sum((nodes[j].hi - nodes[j].lo) * nodes[j].hi for j in trial)
            if len(trial) * q * kk <= BUCKET_SLACK * need:
                batches[-1] = trial
                continue
        batches.append([k])
    queries, keys, masks, kept, where = [], [], [], [], []
    done = 0
    for batch in batches:
        q = max(nodes[j].hi - nodes[j].lo for j in batch)
        kk = max(nodes[j].hi for j in batch)
        qi = np.zeros((len(batch), q), dtype=np.int64)
        ki = np.zeros((len(batch), kk), dtype=np.int64)
        mask = np.zeros((len(batch), 1, q, kk), dtype=bool)
        mask[:, 0, :, 0] = True  # padding queries see key 0 (their output is dropped)
        keep = []
        for s, j in enumerate(batch):
            n = nodes[j]
            width = n.hi - n.lo
            qi[s, :width] = index[n.row, n.lo:n.hi]
            ki[s, :n.hi] = index[n.row, :n.hi]
            mask[s, 0, :width, :n.hi] = np.tri(width, n.hi, n.lo, dtype=bool)
            keep.append(s * q + np.arange(width))
            where.append(qi[s, :width])
        keep = np.concatenate(keep)
        done += len(keep)
        queries.append(torch.from_numpy(qi))
        keys.append(torch.from_numpy(ki))
        masks.append(torch.from_numpy(mask))
        kept.append(torch.from_numpy(keep))
    placed = np.concatenate(where) if where else np.zeros(0, dtype=np.int64)
    assert done == total and len(placed) == total
    order_of = np.empty(total, dtype=np.int64)
    order_of[placed] = np.arange(total)
    return Attention(queries, keys, masks, kept, torch.from_numpy(order_of))


# --- the model's side -------------------------------------------------------------------------


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                     scaling: float | None = None, **kwargs):
    """transformers' attention interface: with a layout (``LAYOUT_KWARG``), each node's
    queries against the keys it may see; without one, transformers' own sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout: Attention | None = kwargs.pop(LAYOUT_KWARG, None)
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"a packed layout is one sequence, got a batch of {query.shape[0]}")
    q, k, v = query[0], key[0], value[0]  # [heads, T, dim]
    groups = q.shape[0] // k.shape[0]
    outs = []
    # index_select rather than indexing: its backward is an index_add, several times
    # faster on CPU than the accumulating index_put that indexing's backward is.
    for qi, ki, mask, keep in zip(layout.queries, layout.keys, layout.masks, layout.kept):
        qb = _gather(q, qi)  # [S, heads, Q, dim]
        kb = _repeat(_gather(k, ki), groups)
        vb = _repeat(_gather(v, ki), groups)
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask,
                                             dropout_p=dropout if module.training else 0.0,
                                             scale=scaling)
        s, h, width, d = out.shape
        outs.append(out.transpose(1, 2).reshape(s * width, h, d).index_select(0, keep))
    joined = torch.cat(outs) if len(outs) > 1 else outs[0]
    # [1, T, heads, dim], as transformers' sdpa returns it
    return joined.index_select(0, layout.order)[None], None


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [heads, T, dim]`` at the positions ``index [S, N]``: ``[S, heads, N, dim]``."""
    heads, _, dim = x.shape
    picked = x.index_select(1, index.reshape(-1)).view(heads, *index.shape, dim)
    return picked.transpose(0, 1)


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head once per query head that reads it."""
    if groups == 1:
        return x
    s, heads, n, d = x.shape
    return x[:, :, None].expand(s, heads, groups, n, d).reshape(s, heads * groups, n, d)


def enable_packing(model) -> None:
    """Give ``model`` (a transformers model using the attention interface: Llama, Qwen2,
    Mistral, SmolLM2...) the attention function that reads a packed layout; every forward
    without a layout stays transformers' sdpa. Call before wrapping or copying the model."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)


def layout_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    chunk_tokens: int = 0, needed: torch.Tensor | None = None,
                    layout: str = "padded", entropy: bool = False, entropy_grad: bool = False):
    """:func:`learner.logprobs.token_logprobs` of the right-padded rows ``input_ids``, run
    in ``layout``: the same ``[B, L]`` values (up to float rounding) and gradients; with
    ``entropy`` (or ``entropy_grad``), (log-probs, entropies) as it returns them."""
    if layout == "padded":
        return token_logprobs(model, input_ids, attention_mask, chunk_tokens, needed, entropy,
                              entropy_grad)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    lengths = _lengths(attention_mask).cpu().numpy()
    packed = pack_rows(input_ids.cpu().numpy(), lengths, share=layout == "shared_prefix")
    return packed_logprobs(model, packed.to(input_ids.device), input_ids, attention_mask,
                           chunk_tokens, needed, entropy, entropy_grad)


def packed_logprobs(model, packed: PackedRows, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor, chunk_tokens: int = 0,
                    needed: torch.Tensor | None = None, entropy: bool = False,
                    entropy_grad: bool = False):
    """``out[b, t] = log p(x_t | x_<t)`` of the rows ``input_ids`` (``[B, L]``, right-padded),
    through one forward of their ``packed`` layout; 0 at position 0, on padding and, with
    ``chunk_tokens > 0`` and ``needed``, wherever ``needed`` is 0. With ``entropy``, also each
    scored position's entropy, placed alike (:func:`learner.logprobs.token_logprobs`; with
    ``entropy_grad``, with gradient, and at ``needed`` positions only)."""
    entropy = entropy or entropy_grad
    device = input_ids.device
    real = attention_mask[:, 1:].bool()
    if chunk_tokens > 0 and needed is not None:
        real = real & needed[:, 1:].bool()
    rows, cols = torch.nonzero(real, as_tuple=True)
    cols = cols + 1  # the scored token; its logit sits at the row's previous token
    source = packed.index[rows, cols - 1]
    targets = input_ids[rows, cols]
    kwargs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids,
              # 4D: transformers passes it on as it is instead of building a [T, T] mask;
              # the layout decides what each position sees.
              "attention_mask": torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device),
              LAYOUT_KWARG: packed.attention}
    if chunk_tokens <= 0:
        logits = model(**kwargs).logits[0].index_select(0, source)
        scored = _pick(logits, targets)
        spread = None
        if entropy_grad:
            spread = _entropy_grad(logits, None if needed is None else needed[rows, cols].bool())
        elif entropy:
            spread = _entropy(logits)
    else:
        hidden = model.get_decoder()(**kwargs).last_hidden_state[0]
        scored, spread = _chunked_head(model.get_output_embeddings(),
                                       hidden.index_select(0, source)[None], targets[None],
                                       chunk_tokens, entropy, entropy_grad)
        scored, spread = scored[0], (spread[0] if entropy else None)
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=device)
    out = out.index_put((rows, cols), scored.float())
    if not entropy:
        return out
    return out, torch.zeros_like(out).index_put((rows, cols), spread.float())


def _lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(1, attention_mask.shape[1] + 1, device=attention_mask.device)
    return (attention_mask.bool() * positions).amax(dim=1)


@torch.no_grad()
def check_packing(model, vocab_size: int | None = None, atol: float = 1e-4) -> None:
    """Raise ValueError unless packed and shared-prefix log-probs equal the padded ones on a
    few short random rows that share a prefix (a model whose attention does not go through
    transformers' attention interface would ignore the layout)."""
    vocab = vocab_size or model.get_output_embeddings().weight.shape[0]
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 11), generator=gen)
    ids[1, :6] = ids[0, :6]
    ids[2, :4] = ids[0, :4]
    mask = torch.ones_like(ids)
    mask[2, 8:] = 0
    ids, mask = ids.to(device), mask.to(device)
    padded = token_logprobs(model, ids, mask)
    for layout in LAYOUTS[1:]:
        got = layout_logprobs(model, ids, mask, layout=layout)
        if not torch.allclose(padded, got, atol=atol, rtol=0):
            raise ValueError(f"{type(model).__name__}: log-probs in the {layout} layout differ "
                             f"from the padded ones by {float((padded - got).abs().max())}; "
                             f"set learner.layout=padded for this model")


# --- micro-batches ----------------------------------------------------------------------------


def packed_budget_parts(rows: torch.Tensor, lengths: torch.Tensor, input_ids: torch.Tensor,
                        budget: int, share: bool) -> list[torch.Tensor]:
    """``rows`` in micro-batches of at most ``budget`` packed tokens: the tokens a packed
    micro-batch runs (each row's own, with ``share`` the prefix it has in common with rows
    before it in the part counted once). Rows are taken in token order (rows that share a
    prefix are neighbours) and each part filled while it fits; a row longer than ``budget``
    is a part of its own."""
    ids = input_ids.cpu().numpy()
    tokens = {r: ids[r, :int(lengths[r])] for r in rows.tolist()}
    order = sorted(tokens, key=lambda r: tuple(tokens[r].tolist())) if share else \
        sorted(tokens, key=lambda r: -len(tokens[r]))
    parts, current, used = [], [], 0
    for r in order:
        cost = len(tokens[r])
        if share and current:
            cost -= _common(tokens[current[-1]], tokens[r])
        if current and used + cost > budget:
            parts.append(current)
            current, used, cost = [], 0, len(tokens[r])
        current.append(r)
        used += cost
    if current:
        parts.append(current)
    return [torch.tensor(p, dtype=torch.long) for p in parts]


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix of ``a`` and ``b``, short of the end of
    either (every row keeps a token of its own in the tree)."""
    n = min(len(a), len(b)) - 1
    if n <= 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
