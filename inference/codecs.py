"""How a rollout's text becomes tokens: the marker format of word-level policies, and chat
templates for real instruction-tuned models.

Both lay a trajectory out piece by piece (prompt, action, observation, action, ...) and encode
every piece on its own, so the token ids of a trajectory are exactly the concatenation of its
pieces. That is what lets the learner cut the experience block out of a prompt (its span is
recorded) and still see the tokens of the unguided prompt.

Marker format (``MarkerCodec``, the tiny policy)::

    [BOS] <exp> advice </exp> <task> query <obs> observation <act> action <eoa> <obs> ...

Chat format (``ChatCodec``, any tokenizer with a ``chat_template``): the system message holds
the environment's instructions (tool documentation), the first user message the query and
first observation, each action is an assistant message ending with the template's end-of-turn
token, and each observation a tool (or, for a new user turn, user) message.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from inference.backends.constraint import (
    ActionTrie,
    GrammarConstraint,
    ThinkThen,
    TokenConstraint,
    TokenizerFacts,
)

MARKERS = ("<task>", "<obs>", "<act>", "<eoa>")
THINK_TAGS = ("<think>", "</think>")  # a thought's tags (episodes/thinking.py)
TRIE_CACHE_SIZE = 1024  # action sets whose trie is kept (see Codec.constraint)
EXPERIENCE_MARKERS = ("<exp>", "</exp>")  # optional: needed only to inject experience
_SENTINEL = "\u2063AUTODIDACT-EXPERIENCE\u2063"  # where the experience block goes in a template
_CONTENT = "\u2063AUTODIDACT-CONTENT\u2063"  # where untrusted text goes in a template


def special_tokens(tokenizer) -> dict[str, int]:
    """Every special token of ``tokenizer`` -> its id: the named ones (bos, eos, ...) and every
    added token flagged special. The named ones alone are not enough: a tokenizer whose eos was
    set wrongly still has ``<|im_end|>`` as an added special token, and it still ends turns."""
    tokens = dict(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if added.special:
            tokens[added.content] = token_id
    return tokens


class Codec(abc.ABC):
    """Text pieces of a rollout -> token ids; ``eoa_id`` ends every action."""

    shows_instructions = True  # whether start() puts the env's instructions in the prompt
    renders_tools = False  # whether start() hands the tools' JSON schemas to a chat template

    eoa_id: int

    def __init__(self, tokenizer, cache_size: int = 50_000):
        self.tokenizer = tokenizer
        self._cache: dict[str, list[int]] = {}
        self._cache_size = cache_size
        # The rollouts of a group start from one state and often meet the same action set
        # again: a trie is built once per set (building one per episode and turn was a fifth
        # of a tiny-model actor's time). Tries are read-only once built, so they are shared.
        self._tries: dict[tuple[str, ...], ActionTrie | None] = {}
        vocab = tokenizer.get_vocab()
        self.special = special_tokens(tokenizer)
        # Ids that structure a conversation; text from outside (queries, observations, advice)
        # must never produce them, or a tool result could end a turn or open a new one.
        self._structural = set(self.special.values()) | {
            vocab[m] for m in (*MARKERS, *EXPERIENCE_MARKERS) if m in vocab}
        self._unk = tokenizer.unk_token_id
        self._facts: TokenizerFacts | None = None

    def encode(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(self._cache) >= self._cache_size:
                self._cache.clear()
            self._cache[text] = ids
        return ids

    def content(self, text: str) -> list[int]:
        """Tokens of untrusted text: special-token strings in it are spelled out as plain text,
        and any structural id a vocabulary still maps them to is replaced (or dropped)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        if not self._structural.intersection(ids):
            return ids
        return [self._unk if i in self._structural else i for i in ids
                if self._unk is not None or i not in self._structural]

    @abc.abstractmethod
    def start(self, query: str, observation: str, experience: str | None = None,
              instructions: str | None = None,
              tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        """The prompt's tokens and the [start, end) span of the experience block ([] if none).
        An empty ``query`` is left out (the observation already carries the request);
        ``tools`` (JSON schemas) is used only where :attr:`renders_tools`."""

    @abc.abstractmethod
    def observation(self, observation: str, role: str = "tool",
                    limit: int | None = None) -> list[int]:
        """Tokens that follow an action: the observation (cut to ``limit`` tokens with a
        marker, ``env.context=truncate``) and whatever cues the next action."""

    def limited(self, text: str, limit: int | None) -> list[int]:
        """:meth:`content` of ``text``, cut to ``limit`` tokens and a marker saying how many
        were left out."""
        ids = self.content(text)
        if limit is None or len(ids) <= limit:
            return ids
        return [*ids[:limit], *self.content(f" ... [{len(ids) - limit} tokens cut]")]

    def action(self, action: str) -> list[int]:
        return [*self.encode(action), self.eoa_id]

    def decode_action(self, ids: Sequence[int]) -> str:
        ids = [i for i in ids if i != self.eoa_id]
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def grammar(self, grammar: str, budget: int | None = None) -> GrammarConstraint:
        """One sequence's constraint to ``grammar`` (an env's call grammar), ending on
        :attr:`eoa_id`, its call closed within ``budget`` tokens."""
        return self.facts.grammar(grammar, budget)

    def think(self, inner: TokenConstraint | None, max_thought: int) -> ThinkThen:
        """``<think>``, a thought of at most ``max_thought`` tokens that spell no tag and do
        not end the reply, ``</think>``, then the call held to ``inner``."""
        return self.facts.think(self.encode(THINK_TAGS[0]), self.encode(THINK_TAGS[1]),
                                max_thought, inner)

    @property
    def facts(self) -> TokenizerFacts:
        """What grammar and thought constraints need of the tokenizer (made once)."""
        if self._facts is None:
            self._facts = TokenizerFacts(self.tokenizer, self.eoa_id,
                                         frozenset(self._structural))
        return self._facts

    def constraint(self, actions: Sequence[str]) -> ActionTrie | None:
        key = tuple(actions)
        if key in self._tries:
            return self._tries[key]
        seqs = [ids for ids in (self.encode(a) for a in actions) if ids and self.eoa_id not in ids]
        trie = ActionTrie.from_token_ids(seqs, self.eoa_id) if seqs else None
        if len(self._tries) >= TRIE_CACHE_SIZE:
            self._tries.clear()
        self._tries[key] = trie
        return trie


class MarkerCodec(Codec):
    """The word-level marker format; instructions are left out (see the module docstring)."""

    shows_instructions = False

    def __init__(self, tokenizer, cache_size: int = 50_000):
        super().__init__(tokenizer, cache_size)
        vocab = tokenizer.get_vocab()
        missing = [m for m in MARKERS if m not in vocab]
        if missing:
            raise ValueError(f"tokenizer lacks the marker tokens {missing}")
        self.task_id, self.obs_id, self.act_id, self.eoa_id = (vocab[m] for m in MARKERS)
        self.exp_open, self.exp_close = (vocab.get(m) for m in EXPERIENCE_MARKERS)
        self.bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []

    def start(self, query, observation, experience=None, instructions=None, tools=None):
        block = self.experience(experience) if experience else []
        span = [len(self.bos), len(self.bos) + len(block)] if block else []
        request = self.content(query) if query else []
        return [*self.bos, *block, self.task_id, *request, *self.observation(observation)], span

    def experience(self, text: str) -> list[int]:
        if self.exp_open is None or self.exp_close is None:
            raise ValueError(f"tokenizer lacks the experience markers {EXPERIENCE_MARKERS}; "
                             "add them as special tokens or set experience.enabled=false")
        return [self.exp_open, *self.content(text), self.exp_close]

    def observation(self, observation, role="tool", limit=None):
        return [self.obs_id, *self.limited(observation, limit), self.act_id]


PromptCodec = MarkerCodec  # the name the rest of the code grew up with


class ChatCodec(Codec):
    """Rollouts in the tokenizer's own chat template.

    Each observation is rendered as the template would render it after an assistant turn, by
    diffing two renders of a small fixed conversation; the text between the end-of-turn token
    and the next message (a newline in ChatML) goes in front of the observation's tokens.
    Templates without a ``tool`` role get tool results as user messages.
    """

    def __init__(self, tokenizer, cache_size: int = 50_000):
        super().__init__(tokenizer, cache_size)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tokenizer has neither the marker tokens nor a chat_template")
        self._tool_role = True
        self._frames: dict[str, tuple[list[int], list[int]]] = {}  # role -> tokens around it
        # Every observation is diffed against this render; it never changes, so render it once.
        self._probe_text = self._render(self._PROBE, False)
        self.eoa_text, self.after_eoa = self._end_of_turn()
        ids = tokenizer.encode(self.eoa_text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"chat template's end of turn {self.eoa_text!r} is not one token")
        self.eoa_id = ids[0]
        self.renders_tools = self._renders_tools()

    def _render(self, messages: list[dict], generation: bool,
                tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, tools=tools,
                                                  add_generation_prompt=generation)

    _PROBE_TOOL = {"type": "function", "function": {
        "name": "probe_tool_\u2063", "description": "", "parameters": {
            "type": "object", "properties": {}, "required": []}}}

    def _renders_tools(self) -> bool:
        """Whether the template shows a ``tools=`` list (its name appears in the render):
        SmolLM2's ignores it, Qwen's and Hermes' render it into the system message."""
        try:
            return "probe_tool_\u2063" in self._render(self._PROBE[:2], True, [self._PROBE_TOOL])
        except Exception:  # jinja raises where a template cannot take the argument
            return False

    _PROBE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
              {"role": "assistant", "content": "A\u2063"}]

    def _end_of_turn(self) -> tuple[str, str]:
        """The template's end-of-turn token text, and the text it puts after it."""
        text = self._probe_text
        tail = text[text.rindex("A\u2063") + 2:]
        for token in sorted(self.special, key=len, reverse=True):
            if token and tail.startswith(token):
                return token, tail[len(token):]
        raise ValueError(f"cannot find the end-of-turn token after an assistant message in "
                         f"the chat template (it renders {tail!r})")

    def start(self, query, observation, experience=None, instructions=None, tools=None):
        user = "\n\n".join(t for t in (query, observation) if t)
        messages = [{"role": "user", "content": _SENTINEL + _CONTENT}]
        if instructions:
            messages.insert(0, {"role": "system", "content": instructions})
        shown = tools if self.renders_tools and tools else None
        head, rest = self._render(messages, True, shown).split(_SENTINEL, 1)
        between, tail = rest.split(_CONTENT, 1)
        block = self.experience(experience) if experience else []
        prefix = self.encode(head)
        span = [len(prefix), len(prefix) + len(block)] if block else []
        return [*prefix, *block, *self.encode(between), *self.content(user),
                *self.encode(tail)], span

    def experience(self, text: str) -> list[int]:
        return [*self.encode("Experience from earlier attempts:\n"), *self.content(text),
                *self.encode("\n\n")]

    def observation(self, observation, role="tool", limit=None):
        if role == "tool" and not self._tool_role:
            role, observation = "user", f"Tool results:\n{observation}"
        frame = self._frames.get(role)
        if frame is None:  # the template around a message of this role; rendered once
            text = self._observation_text(_CONTENT, role)
            if role == "tool" and not self._tool_role:  # the render found no tool role
                return self.observation(observation, role, limit)
            head, tail = text.split(_CONTENT, 1)
            frame = self._frames[role] = (self.encode(head), self.encode(tail))
        return [*frame[0], *self.limited(observation, limit), *frame[1]]

    def _observation_text(self, observation: str, role: str) -> str:
        if role == "tool" and not self._tool_role:
            role, observation = "user", f"Tool results:\n{observation}"
        base = self._probe_text
        try:
            full = self._render([*self._PROBE, {"role": role, "content": observation}], True)
        except Exception:  # jinja raises for roles the template does not know
            if role != "tool":
                raise
            self._tool_role = False
            return self._observation_text(observation, role)
        if not full.startswith(base):
            raise ValueError("chat template re-renders earlier turns differently once a new "
                             "message follows; incremental rollouts need a prefix-stable template")
        return self.after_eoa + full[len(base):]


def make_codec(tokenizer, tool_format: str = "text") -> Codec:
    """The marker format where the tokenizer has the markers (the tiny policy), else its chat
    template; ``tool_format`` (``actor.tool_format``) is checked against it."""
    vocab = tokenizer.get_vocab()
    if all(m in vocab for m in MARKERS):
        if tool_format != "text":
            raise ValueError(f"actor.tool_format={tool_format} needs a model with a chat "
                             "template: this one is a word-level marker policy, whose "
                             "vocabulary spells text-format calls only; set "
                             "actor.tool_format=text or use a real model")
        return MarkerCodec(tokenizer)
    return ChatCodec(tokenizer)
