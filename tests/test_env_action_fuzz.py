"""Arbitrary model text through every registered environment, along the actor's own path.

Each example goes through ``episodes.rollout.apply_action`` (the codec's decoded action, then
``env.step``, then the Step the actor records and pushes) in a fresh episode, while a
process-wide audit hook watches what runs. For every input, however hostile (huge, binary,
NUL bytes, lone surrogates, 10k-deep brackets, ``__import__('os').system(...)``, dunder
chains, lambdas, f-strings, ``10**10**10``, JSON bombs, valid calls with absurd literals):

* no exception escapes the step: an invalid action is an observation with ``valid=False``;
* the step returns in bounded time;
* nothing is executed but the environment's own declared tools: no ``os``/``subprocess``/
  ``socket``/``open`` audit event fires, the only code ``exec``-ed (BFCL's executor evaluates
  the canonical call text it is given) names this episode's API instances and declared tools,
  no module is imported, no file appears in the working directory;
* the Step the actor built encodes, and a replay server would accept the group it is in.

Random token ids go through the real codecs too (a word-level marker tokenizer and a
byte-level BPE with a chat template), since that is how generated text reaches ``step``.
"""

from __future__ import annotations

import os
import re
import sys
import time
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from environments import env_class, env_names
from episodes.rollout import Episode, RolloutSettings, apply_action
from protocol import codec
from protocol.messages import Group, Task

pytest.importorskip("bfcl_eval")  # every registered env must be exercised, bfcl included

CANARY = "pwned_canary"
STEP_LIMIT_S = 5.0  # a step is milliseconds; this only catches runaway work
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])

# --- what runs during a step: an audit hook, armed only around env.step ------------------------

_AUDIT: dict = {"armed": False, "events": []}
# Audit events no step may raise: processes, files, sockets, native code, imports, debuggers.
FORBIDDEN = ("os.", "subprocess.", "shutil.", "socket.", "ctypes.", "open", "import",
             "builtins.input", "urllib.", "http.", "ftplib.", "smtplib.", "webbrowser.",
             "pty.", "fcntl.", "marshal.", "pickle.", "code.__new__", "function.__new__",
             "sys.settrace", "sys.setprofile", "sys.addaudithook", "cpython.run_")


def _hook(event, args):
    if _AUDIT["armed"]:
        _AUDIT["events"].append((event, args))


if not getattr(sys, "_autodidact_env_fuzz_hook", False):  # hooks cannot be removed: add once
    sys.addaudithook(_hook)
    sys._autodidact_env_fuzz_hook = True


def _check_events(env, events) -> None:
    names = {t.name for t in env.tools()}
    prefix = (getattr(env, "model_name", None) or "\0") + "_"
    for event, args in events:
        assert not event.startswith(FORBIDDEN), (event, args)
        if event == "compile":
            source, filename = args
            # ast.parse (the env's parser: parsing is not running) uses '<unknown>'
            assert filename == "<unknown>" or (
                isinstance(source, (str, bytes))
                and (source.decode() if isinstance(source, bytes) else source).startswith(
                    prefix)), (event, args)
        elif event == "exec":
            code = args[0]
            assert isinstance(code, types.CodeType), args
            # BFCL's executor evaluates ``<instance>.<tool>(<literals>)`` and nothing else:
            # no other global, no nested code (lambda, comprehension)
            assert code.co_names and code.co_names[0].startswith(prefix), code.co_names
            assert set(code.co_names[1:]) <= names, code.co_names
            assert not any(isinstance(c, types.CodeType) for c in code.co_consts), code


# --- the envs ---------------------------------------------------------------------------------


def _tasks(name: str) -> list[Task]:
    env = env_class(name)()
    tasks = env.tasks("train")[:1]
    if name == "bfcl":
        # A synthetic task (one user turn, state usable after errors) on an entry with the
        # file system and the math API: the tools with the most to abuse.
        from environments.bfcl import _data

        data = _data()
        seed = next(i for i, eid in enumerate(data.order)
                    if {"GorillaFileSystem", "MathAPI"} <= set(data.entries[eid]
                                                               ["involved_classes"]))
        tasks.append(Task(task_id="fuzz-synthetic", env="bfcl", query="do it", seed=seed))
    return tasks


@pytest.fixture(scope="module", params=env_names())
def world(request):
    """(env, tasks, tool names) for one registered env, warmed up: lazy imports done before
    the checks."""
    env = env_class(request.param)()
    tasks = _tasks(request.param)
    tools = set()
    for task in tasks:
        env.reset(task)
        tools |= {t.name for t in env.tools()}
        for action in (task.reference or [])[:3] + ["ls", "[ls()]", "", "???"]:
            env.step(action)
        env.evaluate(task)
    return env, tasks, sorted(tools)


class _TextCodec:
    """The codec seam of apply_action: decodes to the text under test."""

    text = ""

    def decode_action(self, ids):
        return self.text

    def observation(self, observation, role="tool", limit=None):
        return [1] * min(len(observation), 64)


def _act(env, task: Task, text, sandbox) -> None:
    """One fresh episode, one action along the actor's path, every check."""
    env.reset(task)
    ep = Episode(task=task, env=env, traj_id="fuzz")
    ep.extend([1, 2, 3])
    ep.prompt_len = 3
    codec_ = _TextCodec()
    codec_.text = text
    _step_checked(env, lambda: apply_action(ep, codec_, [5, 6], [-0.5, -0.1], 0,
                                            RolloutSettings(max_turns=64, max_context=10**9)),
                  sandbox)
    _check_step(ep)


def _step_checked(env, step, sandbox) -> None:
    modules = set(sys.modules)
    _AUDIT["events"] = []
    _AUDIT["armed"] = True
    t0 = time.monotonic()
    try:
        step()
    finally:
        _AUDIT["armed"] = False
    took = time.monotonic() - t0
    assert took < STEP_LIMIT_S, f"step took {took:.1f}s"
    assert set(sys.modules) == modules, set(sys.modules) - modules
    _check_events(env, _AUDIT["events"])
    assert os.listdir(sandbox) == [], os.listdir(sandbox)
    assert not os.path.exists(os.path.join(sandbox, CANARY))


def _check_step(ep: Episode) -> None:
    (step,) = ep.steps
    assert isinstance(step.observation, str)
    assert isinstance(step.valid, bool)
    if not step.valid:
        assert isinstance(step.info.get("error"), str), step.info
    # What the actor pushes must encode, and the replay server must accept it.
    ep.reward = 0.0
    group = Group(group_id="g", task=ep.task, trajectories=[ep.to_trajectory()])
    _, back = codec.decode(codec.encode(group, "m"))
    assert back.trajectories[0].steps[0].action == step.action


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return str(tmp_path)


# --- hostile text -----------------------------------------------------------------------------

_CMD = f"touch {CANARY}"
INJECTIONS = [
    f"__import__('os').system('{_CMD}')",
    f"open('{CANARY}', 'w').write('x')",
    f"[touch(file_name=__import__('os').system('{_CMD}'))]",
    f"[ls(a=open('{CANARY}','w'))]",
    "[cd(folder=().__class__.__bases__[0].__subclasses__())]",
    "().__class__.__mro__[1].__subclasses__()[0].__init__.__globals__['sys']",
    "[x.__class__ for x in ()]",
    f"(lambda: __import__('os').system('{_CMD}'))()",
    f"[cd(folder=(lambda: __import__('os').system('{_CMD}'))())]",
    f"[cd(folder=f\"{{__import__('os').system('{_CMD}')}}\")]",
    f"eval(\"__import__('os').system('{_CMD}')\")",
    f"exec(\"open('{CANARY}','w')\")",
    "[cd(**{'folder': 'x'})]", "[cd(*['x'])]", "[cd(folder='docs')][0]",
    "[ls()] if __import__('os') else []", "breakpoint()", "globals()", "vars()",
    "[getattr(ls, '__globals__')]", "[ls.__globals__]", "[__builtins__]",
    "import os", "from os import system", "@decorator\ndef f(): pass",
    f"ls; {_CMD}", f"ls && {_CMD}", "ls | sh", f"$({_CMD})", f"`{_CMD}`", f"!{_CMD}",
    f"cd $(touch {CANARY})", "cd ${HOME}", "cat ../../../../etc/passwd", "cat /etc/passwd",
    "ls \\\n-la", "cd 'unterminated", 'cd "unterminated', "cd \\",
    f"[touch(file_name='{CANARY}')]",  # a real tool of BFCL's *fake* file system
    f"[echo(content='x', file_name='../../{CANARY}')]",
    "[power(base=10, exponent=10**10**10)]", "[power(base=10, exponent=9999999999999)]",
    "[round_number(number=1, decimal_places=-999999999999)]",
    "[square_root(number=2, precision=999999999)]", "[logarithm(value=2, base=3, precision=10**9)]",
    "[logarithm(value=2, base=3, precision=999999999)]", "[add(a=1e999999, b=1)]",
    "[add(a=10**10**10, b=1)]", "[add(a=" + "9" * 5000 + ", b=1)]", "1e999999", "10**10**10",
    "[mean(numbers=" + "[" * 100 + "]" * 100 + ")]", "[ls(" + "(" * 300 + ")" * 300 + ")]",
    '{"a": ' * 3000 + "1" + "}" * 3000, "[" * 10_000, "(" * 10_000, "{" * 10_000,
    "[" * 199 + "]" * 199, "[" * 5000 + "]" * 5000, "[[" * 4000,
    "\x00", "ls\x00", "cd \x00docs", "[ls()]\x00", "\ud800", "cd \udcff", "[cd(folder='\ud83d')]",
    # escapes in the source text: lone surrogates inside a valid literal
    "[cd(folder='\\ud800')]", "[touch(file_name='\\udcff')]",
    "[echo(content='\\ud800', file_name='a')]", "[mean(numbers={'\\ud800': 1})]",
    "\u202e[ls()]", "ｌｓ", "ls\u200b", "\ufeff[ls()]", "ls\r\n", "\t\n\x0b\x0c",
    "x" * 2**20, "[ls()]" * 50_000, "'" * 10_000, '"""' + "a" * 10_000,
]


@pytest.mark.parametrize("text", INJECTIONS, ids=range(len(INJECTIONS)))
def test_hostile_text_is_an_observation_not_a_crash(world, sandbox, text):
    env, tasks, _ = world
    for task in tasks:
        _act(env, task, text, sandbox)


def _literals(depth: int = 3):
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30),
                     st.sampled_from([CANARY, "..", "/", "../" * 20, "\x00", "~", "*", "-rf"]))
    return st.recursive(leaf, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
        max_leaves=12)


@st.composite
def _calls(draw, tool_names):
    """Well-formed calls of declared tools with arbitrary literal arguments, in both syntaxes
    (BFCL's Python list of calls and the shell-style ``tool arg ...``)."""
    name = draw(st.sampled_from(tool_names))
    args = draw(st.lists(st.tuples(st.sampled_from(["folder", "file_name", "a", "b", "number",
                                                     "numbers", "content", "precision",
                                                     "exponent", "base", "start", "name"]),
                                   _literals()), max_size=3, unique_by=lambda a: a[0]))
    if draw(st.booleans()):
        return "[" + name + "(" + ", ".join(f"{k}={v!r}" for k, v in args) + ")]"
    return " ".join([name] + [str(v) for _, v in args])


_surrogates = st.lists(st.integers(0xD800, 0xDFFF), min_size=1, max_size=4).map(
    lambda cs: "".join(map(chr, cs)))
_model_text = st.one_of(
    st.text(max_size=300),
    st.text(st.characters(codec=None, exclude_categories=()), max_size=300),
    st.binary(max_size=300).map(lambda b: b.decode("utf-8", "surrogateescape")),
    st.binary(max_size=300).map(lambda b: b.decode("latin-1")),
    st.tuples(st.sampled_from(INJECTIONS[:40]), _surrogates, st.text(max_size=20)).map(
        lambda t: t[0][:200] + t[1] + t[2]),
    st.tuples(st.sampled_from("[({'\""), st.integers(1, 12_000)).map(lambda t: t[0] * t[1]),
    st.tuples(st.integers(1, 2000), st.sampled_from(["[", "[1,", "{'a':", "f(", "-", "~"])).map(
        lambda t: t[1] * t[0]),
)


@given(data=st.data())
@SETTINGS
def test_arbitrary_text_never_crashes_or_executes(world, sandbox, data):
    env, tasks, tools = world
    task = data.draw(st.sampled_from(tasks))
    text = data.draw(st.one_of(_model_text, _calls(tools)))
    _act(env, task, text, sandbox)


@pytest.mark.parametrize("call", [
    "power(base=10, exponent=10**12)", "power(base=10, exponent=1000000000000)",
    "power(base=7, exponent=-100000)", "round_number(number=1, decimal_places=-1000000000)",
    "square_root(number=2, precision=1000000000)", "logarithm(value=2, base=3, precision=100000)",
])
def test_runaway_math_is_refused_before_it_runs(call):
    """One call that would compute for hours (an exact int power with a 13-digit exponent,
    a billion digits of precision) would hang the actor: such arguments are refused by the
    parser, so nothing runs. Checked on the decoder alone, so a regression fails fast instead
    of hanging the test run."""
    from environments.base import ActionError
    from environments.bfcl import BFCLEnv

    env = BFCLEnv()
    with pytest.raises(ActionError) as err:
        env._decode(f"[{call}]")
    assert err.value.kind in ("bad_argument", "syntax")
    assert env._decode("[power(base=2, exponent=10)]") == ["power(base=2, exponent=10)"]


def test_non_text_actions_are_refused(world, sandbox):
    env, tasks, _ = world
    for value in (None, b"ls", 3, ["ls"], {"tool": "ls"}, 1.5):
        env.reset(tasks[0])
        out: dict = {}
        _step_checked(env, lambda v=value, o=out: o.update(r=env.step(v)), sandbox)
        obs, _, info = out["r"]
        assert isinstance(obs, str) and info["valid"] is False


# --- generated tokens through the real codecs -----------------------------------------------------


@pytest.fixture(scope="module")
def codecs():
    """The marker codec (word-level tokenizer of the tiny policy) and the chat codec (byte-level
    BPE with a ChatML template), built without any model weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from autodidact.base_model import policy_vocabulary
    from environments.files import FilesEnv
    from inference.codecs import ChatCodec, MarkerCodec
    from inference.tiny_model import (
        CHAT_SPECIALS,
        CHATML_TEMPLATE,
        SPECIAL_TOKENS,
        _make_tokenizer,
        _vocabulary,
    )

    words, special = policy_vocabulary(FilesEnv)
    marker = MarkerCodec(_make_tokenizer(_vocabulary(words, special),
                                         len(SPECIAL_TOKENS) + len(special)))
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(
        ["[cd(folder='docs'), ls(a=True)] mv report.txt work", "cat plan.md 3", *INJECTIONS[:30]],
        trainers.BpeTrainer(vocab_size=600, special_tokens=list(CHAT_SPECIALS),
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"],
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = CHATML_TEMPLATE
    return {"marker": marker, "chat": ChatCodec(tok)}


@given(data=st.data())
@settings(SETTINGS, max_examples=150)
def test_random_generated_tokens_through_the_codecs(world, codecs, sandbox, data):
    env, tasks, _ = world
    task = data.draw(st.sampled_from(tasks))
    name = data.draw(st.sampled_from(sorted(codecs)))
    codec_ = codecs[name]
    size = len(codec_.tokenizer)
    # Ids past the tokenizer (a model's padded embedding rows) included; eoa wherever.
    ids = data.draw(st.lists(st.integers(0, size + 50), max_size=300))
    env.reset(task)
    ep = Episode(task=task, env=env, traj_id="fuzz")
    ep.extend([1, 2, 3])
    ep.prompt_len = 3
    logprobs = list(-np.linspace(0.1, 5.0, len(ids)))
    _step_checked(env, lambda: apply_action(ep, codec_, ids, logprobs, 0,
                                            RolloutSettings(max_turns=64, max_context=10**9)),
                  sandbox)
    _check_step(ep)


def test_canary_check_is_live(sandbox):
    """The sandbox check would notice a file: guard against a vacuous pass."""
    with open(CANARY, "w"):
        pass
    with pytest.raises(AssertionError):
        assert os.listdir(sandbox) == []
    os.remove(CANARY)


def test_audit_check_is_live(world):
    """The audit check would notice code running: guard against a vacuous pass."""
    env, _, _ = world
    _AUDIT["events"] = []
    _AUDIT["armed"] = True
    try:
        exec(compile("len('x')", "<string>", "eval"))
        os.listdir(".")
    finally:
        _AUDIT["armed"] = False
    with pytest.raises(AssertionError):
        _check_events(env, _AUDIT["events"])
    assert re.search("os.listdir", repr(_AUDIT["events"]))
