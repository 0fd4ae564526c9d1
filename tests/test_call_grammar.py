"""environments/call_grammar.py and GrammarConstraint: the grammar of an env's calls admits
every reference call in every format and nothing malformed, and the constraint that holds a
model to it answers as a pure function of the ids so far. Real SmolLM2 tokenizer; the
rollouts of a model held to a grammar are in test_tool_formats.py."""

from __future__ import annotations

import ast
import json

import llguidance
import numpy as np
import pytest
from transformers import AutoTokenizer

from environments.bfcl import BFCLEnv
from environments.call_formats import FORMATS, rewrite
from environments.call_grammar import call_grammar
from environments.files import FilesEnv
from environments.shop import ShopEnv
from inference.backends.constraint import GrammarConstraint, TokenizerFacts
from inference.models import model_folder

FORMAT_NAMES = sorted(FORMATS)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(model_folder("smollm2-135m"))


@pytest.fixture(scope="module")
def ll(tok):
    return TokenizerFacts(tok, tok.eos_token_id, frozenset()).ll_tokenizer


def admits(ll, tok, grammar: str, text: str) -> bool:
    """Whether ``text`` then the end token is a string of ``grammar``."""
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    ids = tok.encode(text, add_special_tokens=False)
    return (matcher.try_consume_tokens(ids) == len(ids)
            and matcher.consume_token(tok.eos_token_id) and matcher.is_accepting())


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_every_files_reference_is_in_its_grammar_and_prose_is_not(ll, tok, fmt):
    env = FilesEnv()
    grammar = call_grammar(env.tools(), fmt)
    references = {a for t in env.tasks("train") + env.tasks("validation") for a in t.reference}
    for action in sorted(references)[:120]:
        assert admits(ll, tok, grammar, rewrite(action, env.tools(), fmt)), action
    malformed = {"text": ["mv ideas.md", "frobnicate x", "ls docs extra", "cat a.md -1x"],
                 "json": ['{"name": "mv", "arguments": {"src": "a"}}', '{"name": "ls"}',
                          '{"name": "ls", "arguments": {"folder": "a b"}}'],
                 "hermes": ['{"name": "pwd", "arguments": {}}', "<tool_call>ls</tool_call>"],
                 "pythonic": ["[cat(start=3)]", "[mv(dst='a', src='b')]", "[ls(os.sep)]",
                              "mv(src='a', dst='b')"]}
    for text in ["I would list the files.", "", *malformed[fmt]]:
        assert not admits(ll, tok, grammar, text), text


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_shop_arguments_keep_to_their_choices_and_bounds(ll, tok, fmt):
    """``reserve``'s qty is declared 1..9 (an exploration bound: the shop itself takes up to
    20, so three training references lie outside it and are held out here)."""
    env = ShopEnv()
    tools = {t.name: t for t in env.tools()}
    grammar = call_grammar(env.tools(), fmt)
    inside = [a for t in env.tasks("train") for a in t.reference
              if not (a.startswith(("reserve", "restock")) and int(a.split()[-1]) > 9)]
    for action in inside:
        assert admits(ll, tok, grammar, rewrite(action, tools.values(), fmt)), action
    for action in ["reserve o4 nut 12", "stock marble", "reserve o4 nut 0"]:
        call = FORMATS["text"].parse(action, tools)
        assert not admits(ll, tok, grammar, FORMATS[fmt].write(call, tools[call.tool])), action


def _bfcl_turns(task, env) -> list[list[dict]]:
    """Each reference turn's calls, canonical (keywords in declared order), as JSON calls."""
    env.reset(task)
    turns = []
    for turn in task.reference:
        calls = []
        for text in env._decode(turn) if turn else []:
            tree = ast.parse(text, mode="eval").body
            calls.append({"name": tree.func.id, "arguments": {
                k.arg: ast.literal_eval(k.value) for k in tree.keywords}})
        turns.append(calls)
    return turns


def _written(calls: list[dict], fmt: str) -> str:
    if fmt in ("text", "pythonic"):
        inner = ", ".join(
            f"{c['name']}({', '.join(f'{k}={v!r}' for k, v in c['arguments'].items())})"
            for c in calls)
        return f"[{inner}]" if calls else ""
    if fmt == "json":
        return json.dumps(calls) if calls else ""
    return "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_bfcl_turns_are_in_its_grammar_several_calls_and_the_empty_reply_included(ll, tok, fmt):
    env = BFCLEnv()
    for task in env.tasks("train")[:6]:
        turns = _bfcl_turns(task, env)
        env.reset(task)
        grammar = env.call_grammar(fmt)
        for calls in turns[:1]:  # the first turn's functions are the ones declared now
            text = _written(calls, fmt)
            assert admits(ll, tok, grammar, text), text
        assert admits(ll, tok, grammar, "")  # a reply with no call ends the turn
        assert not admits(ll, tok, grammar, "[os.system('x')]")


def test_the_constraint_answers_as_a_function_of_the_ids_so_far(ll, tok):
    grammar = call_grammar(FilesEnv().tools(), "pythonic")
    ids = tok.encode("[mv(src='a.md', dst='docs')]", add_special_tokens=False)
    constraint = GrammarConstraint(grammar, ll, tok.eos_token_id)
    fresh = [GrammarConstraint(grammar, ll, tok.eos_token_id).allowed(ids[:k])
             for k in range(len(ids) + 1)]
    order = [5, 2, len(ids), 0, 3, len(ids), 1]  # forwards, backwards, again
    for k in order:
        assert constraint.allowed(ids[:k]) == fresh[k]
    assert all(ids[k] in fresh[k] for k in range(len(ids)))
    assert fresh[-1] == [tok.eos_token_id]  # complete: only the end
    assert constraint.allowed(ids + [tok.eos_token_id]) == []  # ended
    hello = tok.encode("[hello", add_special_tokens=False)
    assert hello[0] == ids[0] and hello[1] not in fresh[1]  # no tool is called hello
    assert constraint.allowed(hello) == []  # ids that left the grammar end the sequence
    assert constraint.allowed(ids[:3]) == fresh[3]  # and comes back on a shorter prefix
    with pytest.raises(ValueError, match="does not compile"):
        GrammarConstraint("start: nothing_defined", ll, tok.eos_token_id)


def test_a_constraint_made_again_from_its_spec_answers_as_it_does(tok):
    """What an engine worker makes of a request's spec (vllm_actions) is the same constraint:
    a trie, a grammar, a thought before either; answers compared along a path of each."""
    from inference.codecs import ChatCodec

    codec = ChatCodec(tok)
    env = FilesEnv()
    env.reset(env.tasks("train")[0])
    trie = codec.constraint(env.candidate_actions())
    grammar = codec.grammar(env.call_grammar("json"), budget=40)
    worker = TokenizerFacts(tok, codec.eoa_id, frozenset(codec._structural))
    for made in (trie, grammar, codec.think(trie, 6), codec.think(grammar, 6),
                 codec.think(None, 6)):
        again = worker.from_spec(made.spec())
        assert type(again) is type(made)
        path = []
        for _ in range(30):
            allowed = made.allowed(path)
            assert again.allowed(path) == allowed
            if hasattr(made, "allowed_bits"):  # the vLLM processor's form: the same ids
                bits = again.allowed_bits(path)
                assert (np.flatnonzero(bits).tolist() if isinstance(bits, np.ndarray)
                        else bits) == allowed
            if not allowed:
                break
            path.append(allowed[len(path) * 7919 % len(allowed)])
    with pytest.raises(ValueError, match="unknown constraint kind"):
        worker.from_spec({"kind": "regex"})


def test_near_its_budget_the_constraint_closes_the_string_the_reply_is_in(ll, tok):
    """In its last 24 tokens a reply is steered to closing tokens, the tightest first: inside
    a single-quoted string that is a single quote (a double quote there is only text)."""
    from environments.tools import ArgSpec, ToolSpec

    say = ToolSpec("say", "", (ArgSpec("text"), ArgSpec("times", "int", required=False)))
    grammar = call_grammar([say], "pythonic", strings="any")
    facts = TokenizerFacts(tok, tok.eos_token_id, frozenset())
    ids = tok.encode("[say(text='hello world", add_special_tokens=False)
    roomy = facts.grammar(grammar, budget=200).allowed(ids)
    tight = facts.grammar(grammar, budget=len(ids) + 10)
    closing = tight.allowed(ids)
    assert len(roomy) > 1000 and 0 < len(closing) < 10
    assert all("')" in tok.decode([t]) for t in closing)  # each ends the string and the call
    path = list(ids)
    while (allowed := tight.allowed(path)):  # greedy on what it allows: a complete call
        path.append(allowed[0])
    text = tok.decode(path[:-1])
    assert path[-1] == tok.eos_token_id and len(path) <= len(ids) + 10
    assert text.startswith("[say(text='hello world") and text.endswith(")]")


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_context_calls_beside_a_free_form_envs_calls_in_one_grammar(ll, tok, fmt):
    """env.context=self where the env lists no candidates: the constraint is the env's grammar
    or a context call (either()), so the agent can still forget a turn or write a note."""
    from environments.call_grammar import either
    from episodes.context import CONTEXT_TOOLS, context_call_grammar

    env = FilesEnv()
    combined = either(call_grammar(env.tools(), fmt), context_call_grammar(fmt))
    end = tok.eos_token_id

    def admitted(text: str) -> bool:
        constraint = GrammarConstraint(combined, ll, end)
        ids = [*tok.encode(text, add_special_tokens=False), end]
        return all(i in constraint.allowed(ids[:n]) for n, i in enumerate(ids))

    reference = env.tasks("validation")[0].reference[0]
    for call in (reference, "forget 2", 'note 1 3 "found the report in /docs"'):
        tools = CONTEXT_TOOLS if call.split()[0] in ("forget", "note") else env.tools()
        assert admitted(rewrite(call, tools, fmt)), (fmt, call)
    assert not admitted("I would list the files.")
    with pytest.raises(ValueError, match="Lark"):
        either(combined, call_grammar(env.tools(), fmt))


def test_under_self_a_free_form_envs_next_reply_may_be_a_context_call(tok):
    """The rollout's wiring of the above: once a turn is past, the constraint of an episode
    whose env lists no candidates takes a forget call as well as the env's calls."""
    from episodes.context import ContextManager
    from episodes.rollout import RolloutSettings, _context_grammar, apply_action, start_episodes
    from inference.codecs import make_codec

    class FreeFormFiles(FilesEnv):
        def candidate_actions(self):
            return []

    codec = make_codec(tok, "pythonic")
    settings = RolloutSettings(max_context=4096, constrained=True, tool_format="pythonic",
                               context=ContextManager("self"))
    [ep] = start_episodes(FilesEnv().tasks("validation")[:1], 1, FreeFormFiles, codec,
                          settings=settings)
    assert _context_grammar(ep, settings) is None  # nothing to forget yet
    first = codec.action("[ls()]")
    apply_action(ep, codec, first, [0.0] * len(first), 0, settings)
    ep.next_call.take("call_grammar", ep.env.call_grammar("pythonic"))
    constraint = ep.next_call.constraint(codec, 64, own_grammar=_context_grammar(ep, settings))
    for text in ("[forget(turn=1)]", "[pwd()]"):
        ids = [*tok.encode(text, add_special_tokens=False), codec.eoa_id]
        assert all(i in constraint.allowed(ids[:n]) for n, i in enumerate(ids)), text
