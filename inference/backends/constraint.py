"""Grammar-constrained decoding: restrict which token ids may be sampled next.

A constraint is consulted once per generated token with the ids generated so far and answers
with the ids allowed next. The backends turn that answer into a logit mask, so the policy can
only emit well-formed output and the reported log-probs are those of the masked distribution
(see :class:`inference.backends.base.Generation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class TokenConstraint(Protocol):
    """Decides which token ids may come next.

    ``allowed(generated_ids)`` receives the ids generated so far for one sequence (prompt
    excluded) and returns:

    * ``None``: no restriction at this step;
    * a non-empty list of ids: only these may be sampled;
    * an empty list: the constrained output is complete and the sequence must end now
      (the backend finishes it with ``finish_reason="stop"``).

    It must be a pure function of ``generated_ids`` (backends may call it more than once per
    step and on several sequences in any order).
    """

    def allowed(self, generated_ids: list[int]) -> list[int] | None: ...


class _Node:
    """One trie node: children by token id, plus the child ids as a ready-made list.

    Built lazily: a node keeps the sequences that pass through it (with how far along they
    are) until it is first asked for its children. A rollout asks a trie about the one path it
    generates, so a turn's trie of hundreds of candidate calls costs a pass over their first
    ids, not over every id of every call (building it eagerly was a tenth of an actor's CPU)."""

    __slots__ = ("_children", "_choices", "_pending")

    def __init__(self) -> None:
        self._children: dict[int, _Node] | None = None
        self._choices: list[int] = []
        self._pending: list[tuple[tuple[int, ...], int]] = []  # (sequence, next position)

    def add(self, ids: tuple[int, ...], at: int = 0) -> None:
        if self._children is None:
            self._pending.append((ids, at))
        elif at < len(ids):
            self._child(ids[at]).add(ids, at + 1)

    def _child(self, tok: int) -> _Node:
        child = self._children.get(tok)
        if child is None:
            child = self._children[tok] = _Node()
            self._choices.append(tok)
        return child

    @property
    def children(self) -> dict[int, _Node]:
        if self._children is None:
            self._children = {}
            for ids, at in self._pending:
                if at < len(ids):
                    self._child(ids[at]).add(ids, at + 1)
            self._pending = []
        return self._children

    @property
    def choices(self) -> list[int]:
        self.children  # noqa: B018 - expands this node
        return self._choices


class ActionTrie:
    """Forces generation to be exactly one of ``actions`` followed by ``end_token_id``.

    Each action string is tokenized once, up front (standalone, without special tokens), and
    its ids plus the end id are inserted into a prefix trie. ``allowed`` then only walks the
    trie, so a step costs O(tokens generated) dict look-ups and never re-tokenizes. Actions that
    are prefixes of one another work: after the shorter one, both the end id and the longer
    action's next id are allowed.

    The end id should be a stop token of the sampling params (the tokenizer's EOS by default),
    so the sequence ends as soon as an action is complete; if it is not, ``allowed`` returns
    ``[]`` after it, which ends the sequence anyway.
    """

    def __init__(
        self,
        actions: Sequence[str],
        tokenizer: Any,
        end_token_id: int | None = None,
    ) -> None:
        if not actions:
            raise ValueError("ActionTrie needs at least one action")
        end = tokenizer.eos_token_id if end_token_id is None else end_token_id
        if end is None:
            raise ValueError("tokenizer has no EOS token; pass end_token_id")
        self.end_token_id = int(end)
        self._root = _Node()
        self._by_ids: dict[tuple[int, ...], str] = {}
        self.sequences: list[tuple[int, ...]] = []
        for action in actions:
            ids = tuple(tokenizer.encode(action, add_special_tokens=False))
            if not ids:
                raise ValueError(f"action {action!r} tokenizes to nothing")
            if self.end_token_id in ids:
                raise ValueError(f"action {action!r} contains the end token")
            self._by_ids.setdefault(ids, action)
            self.sequences.append(ids)
            self._insert(ids + (self.end_token_id,))

    @classmethod
    def from_token_ids(cls, sequences: Sequence[Sequence[int]], end_token_id: int) -> ActionTrie:
        """Build from already tokenized actions (for callers that tokenize in context)."""
        trie = cls.__new__(cls)
        trie.end_token_id = int(end_token_id)
        trie._root = _Node()
        trie._by_ids = {}
        trie.sequences = []
        for seq in sequences:
            ids = tuple(map(int, seq))
            if not ids or trie.end_token_id in ids:
                raise ValueError(f"bad action ids {ids}: empty or containing the end token")
            trie.sequences.append(ids)
            trie._insert(ids + (trie.end_token_id,))
        return trie

    def spec(self) -> dict:
        """This trie as JSON-able data (:func:`from_spec` makes it again, in an engine)."""
        return {"kind": "actions", "actions": [list(ids) for ids in self.sequences],
                "end": self.end_token_id}

    def _insert(self, ids: tuple[int, ...]) -> None:
        self._root.add(ids)

    def allowed(self, generated_ids: list[int]) -> list[int]:
        """Ids that keep ``generated_ids`` on the way to a complete action; ``[]`` once done."""
        node = self._node(generated_ids)
        if node is None:
            raise ValueError(f"generated ids {generated_ids} left the action trie")
        return node.choices

    def allowed_or_end(self, generated_ids: Sequence[int]) -> list[int]:
        """Like :meth:`allowed`, but ids that left the trie get ``[]`` instead of an error:
        for code running inside an engine, where raising would take the engine down."""
        node = self._node(generated_ids)
        return [] if node is None else node.choices

    def _node(self, generated_ids: Sequence[int]) -> _Node | None:
        """The trie node ``generated_ids`` lead to, or None once they leave the trie."""
        node = self._root
        for tok in generated_ids:
            node = node.children.get(tok)
            if node is None:
                return None
        return node

    def match(self, generated_ids: Sequence[int]) -> str | None:
        """The action that ``generated_ids`` spells (end id optional), or ``None``."""
        ids = tuple(generated_ids)
        if ids and ids[-1] == self.end_token_id:
            ids = ids[:-1]
        return self._by_ids.get(ids)


class GrammarConstraint:
    """Forces generation to be a string of a grammar (llguidance's Lark dialect; an env's
    :meth:`~environments.base.Environment.call_grammar`), then ``end_token_id``.

    One per sequence: it keeps an llguidance matcher advanced over the ids generated so far
    (rolled back when asked about a shorter prefix, so it still answers as a pure function of
    ``generated_ids``). Ids the grammar would not take (the backend sampled outside the mask)
    end the sequence (``[]``) rather than raise.

    A grammar with free text (a string argument) has no length bound, and a reply cut by the
    token budget is no call. With ``budget`` (the most tokens of a reply), the last
    ``CLOSE_WITHIN`` tokens are held to ``closing_ids`` wherever the grammar allows one of
    them (a quote, a bracket: what ends a string, a call, a list): the call is closed in time,
    and only what the grammar requires next (a required argument) goes on in full.
    """

    CLOSE_WITHIN = 24

    def __init__(self, grammar: str, ll_tokenizer: Any, end_token_id: int,
                 budget: int | None = None, closing_ids: frozenset[int] = frozenset()) -> None:
        import llguidance

        # Lark, or llguidance's top-level JSON form (environments.call_grammar.either)
        compiled = grammar if grammar.lstrip().startswith("{") \
            else llguidance.LLMatcher.grammar_from_lark(grammar)
        self._matcher = llguidance.LLMatcher(ll_tokenizer, compiled)
        if self._matcher.is_error():
            raise ValueError(f"the call grammar does not compile: {self._matcher.get_error()}")
        self.grammar, self.end_token_id = grammar, int(end_token_id)
        self.budget, self.closing_ids = budget, closing_ids | {self.end_token_id}
        self._consumed: list[int] = []  # the ids the matcher has taken, in order
        self._refused: int | None = None  # the id after them the grammar would not take

    def spec(self) -> dict:
        return {"kind": "grammar", "grammar": self.grammar, "end": self.end_token_id,
                "budget": self.budget}

    def allowed(self, generated_ids: list[int], as_list: bool = True) -> list[int]:
        ids = list(generated_ids)
        common = 0
        while common < min(len(ids), len(self._consumed)) and ids[common] == self._consumed[common]:
            common += 1
        if common < len(self._consumed):  # asked about another prefix: go back to the shared
            self._matcher.rollback(len(self._consumed) - common)
            self._consumed, self._refused = self._consumed[:common], None
        if len(ids) > common and self._refused is not None and ids[common] != self._refused:
            self._refused = None
        new = ids[common:]
        if new and self._refused is None:
            taken = self._matcher.try_consume_tokens(new)
            self._consumed += new[:taken]
            self._refused = new[taken] if taken < len(new) else None
        if len(ids) > len(self._consumed) or ids[-1:] == [self.end_token_id]:
            return []  # the ids left the grammar, or ended
        if self._matcher.is_stopped():  # complete, nothing can follow: only the end may
            return [self.end_token_id]
        bits = _bits(self._matcher.compute_bitmask())
        if self.budget is not None and len(ids) >= self.budget - self.CLOSE_WITHIN:
            closing = sorted(i for i in self.closing_ids if i < len(bits) and bits[i])
            if closing:
                return self._tightest(closing)
        return np.flatnonzero(bits).tolist() if as_list else bits

    def allowed_bits(self, generated_ids: list[int]) -> list[int] | np.ndarray:
        """:meth:`allowed`, but where the answer is the grammar's whole mask, that mask as a
        bool array over the token ids (no list of tens of thousands of ids to build and
        read back: a fifth of an engine's time on BFCL)."""
        return self.allowed(generated_ids, as_list=False)

    def _tightest(self, closing: list[int]) -> list[int]:
        """Of the closing ids the grammar allows now, those after which it allows the fewest
        ids: a quote that ends the string the reply is in leaves a handful, one that is
        only text inside it leaves the whole vocabulary; the end itself, where allowed,
        leaves nothing."""
        if self.end_token_id in closing:
            return [self.end_token_id]
        sizes = {}
        for token in closing:
            if self._matcher.try_consume_tokens([token]) == 1:
                sizes[token] = int(np.unpackbits(np.frombuffer(
                    self._matcher.compute_bitmask(), dtype=np.uint8)).sum())
                self._matcher.rollback(1)
        fewest = min(sizes.values(), default=None)
        return [t for t, n in sizes.items() if n == fewest] or closing


def _bits(bitmask: bytes) -> np.ndarray:
    """llguidance's little-endian bitmask as one bool a token id."""
    return np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little").view(bool)


class ThinkThen:
    """A thought, then a call: ``open_ids``; at most ``max_thought`` ids of ``free_ids`` (none
    spells a tag or ends the reply); ``close_ids`` (forced once its first id is drawn, or when
    the thought is full); then ``inner``, the call's constraint, asked about the ids after the
    close (None: the call runs free)."""

    def __init__(self, open_ids: Sequence[int], close_ids: Sequence[int],
                 free_ids: list[int], max_thought: int, inner: TokenConstraint | None,
                 end_token_id: int) -> None:
        self.open_ids, self.close_ids = list(open_ids), list(close_ids)
        self.free_ids, self.max_thought, self.inner = free_ids, max_thought, inner
        self.end_token_id = int(end_token_id)

    def spec(self) -> dict:
        return {"kind": "think", "open": self.open_ids, "close": self.close_ids,
                "max": self.max_thought, "end": self.end_token_id,
                "inner": None if self.inner is None else self.inner.spec()}

    def allowed(self, generated_ids: list[int], as_list: bool = True) -> list[int] | None:
        ids, opening = list(generated_ids), len(self.open_ids)
        if ids[:opening] != self.open_ids[:len(ids)]:
            return []
        if len(ids) < opening:
            return [self.open_ids[len(ids)]]
        thought = ids[opening:]
        if self.close_ids[0] not in thought:
            return [self.close_ids[0]] if len(thought) >= self.max_thought else self.free_ids
        closing = thought[thought.index(self.close_ids[0]):]
        if closing[:len(self.close_ids)] != self.close_ids[:len(closing)]:
            return []
        if len(closing) < len(self.close_ids):
            return [self.close_ids[len(closing)]]
        call = closing[len(self.close_ids):]
        if self.inner is None:
            return None
        if as_list or not hasattr(self.inner, "allowed_bits"):
            return self.inner.allowed(call)
        return self.inner.allowed_bits(call)

    def allowed_bits(self, generated_ids: list[int]) -> list[int] | np.ndarray | None:
        """:meth:`allowed`, with the call's answer as its constraint's ``allowed_bits``."""
        return self.allowed(generated_ids, as_list=False)


CLOSERS = frozenset("\"')]}>")  # characters that close a string, a call, a list, a tag


class TokenizerFacts:
    """What the grammar and thought constraints need of one tokenizer, each made on first
    use (reading a 49k vocabulary takes a fraction of a second, llguidance's a second):
    the tokenizer as llguidance reads it, ending on ``end_token_id``; the ids that only close
    things (their text, spaces aside, is made of :data:`CLOSERS`); the ids a thought may use
    (none spells a tag, ends the reply or is one of ``structural``)."""

    def __init__(self, tokenizer: Any, end_token_id: int, structural: frozenset[int]) -> None:
        self.tokenizer, self.end_token_id = tokenizer, int(end_token_id)
        self.structural = structural
        self._ll = self._closing = self._untagged = None

    @property
    def ll_tokenizer(self) -> Any:
        if self._ll is None:
            import llguidance.hf

            self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=len(self.tokenizer),
                                                    eos_token=self.end_token_id)
        return self._ll

    @property
    def closing_ids(self) -> frozenset[int]:
        if self._closing is None:
            self._closing = frozenset(i for i, text in enumerate(self._texts())
                                      if text.strip() and set(text.strip()) <= CLOSERS)
        return self._closing

    def untagged_ids(self, close_first: int) -> list[int]:
        if self._untagged is None:
            self._untagged = [i for i, text in enumerate(self._texts())
                              if i not in self.structural and i != self.end_token_id
                              and "<" not in text]
        return [*self._untagged, close_first]

    def _texts(self) -> list[str]:
        return [self.tokenizer.decode([i]) for i in range(len(self.tokenizer))]

    def grammar(self, grammar: str, budget: int | None = None) -> GrammarConstraint:
        return GrammarConstraint(grammar, self.ll_tokenizer, self.end_token_id, budget,
                                 self.closing_ids)

    def think(self, open_ids, close_ids, max_thought: int,
              inner: TokenConstraint | None) -> ThinkThen:
        return ThinkThen(open_ids, close_ids, self.untagged_ids(close_ids[0]), max_thought,
                         inner, self.end_token_id)

    def from_spec(self, spec: dict | None) -> TokenConstraint | None:
        """The constraint ``spec`` (a constraint's ``spec()``) describes, over this tokenizer:
        how an engine worker makes again what the actor built."""
        if spec is None:
            return None
        if spec["kind"] == "actions":
            return ActionTrie.from_token_ids(spec["actions"], spec["end"])
        if spec["kind"] == "grammar":
            return self.grammar(spec["grammar"], spec["budget"])
        if spec["kind"] == "think":
            return self.think(spec["open"], spec["close"], spec["max"],
                              self.from_spec(spec["inner"]))
        raise ValueError(f"unknown constraint kind {spec['kind']!r}")
