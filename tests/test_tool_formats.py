"""actor.tool_format end to end: every built-in env stepped in every call format, rollouts of a
real model (SmolLM2) whose constrained replies all parse, chat templates that render tools,
and the replays (step judge, experience rules, warm-start scripts) of a trajectory written in
a format other than text. The parsers themselves are tested in test_call_formats.py."""

from __future__ import annotations

import ast
import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from environments.base import make_env
from environments.bfcl import BFCLEnv
from environments.call_formats import FORMATS, rewrite, tool_schema
from environments.files import FilesEnv
from environments.shop import ShopEnv
from episodes.rollout import RolloutSettings, rollout, scripted_episode, start_episodes
from inference.backends.base import SamplingParams
from inference.backends.hf import TransformersBackend
from inference.codecs import ChatCodec, make_codec
from inference.models import model_folder
from inference.tiny_model import CHATML_TEMPLATE, make_tiny_chat_model
from judge.step_judges import ReferenceJudge
from navigating.extraction import from_group
from protocol.messages import Group, Step, Trajectory

FORMAT_NAMES = sorted(FORMATS)


def _played(env, task, actions, fmt):
    """What ``env`` answers to ``actions`` (written in ``fmt``) from ``task``'s start."""
    out = [env.reset(task)]
    for action in actions:
        out.append(env.step(action, fmt))
    return out, env.state(), env.evaluate(task)


@pytest.mark.parametrize("env_cls", [FilesEnv, ShopEnv], ids=["files", "shop"])
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_every_reference_written_in_a_format_steps_the_env_as_its_text_does(env_cls, fmt):
    """The property the issue asks for, through the env's own step: each task's reference,
    rewritten in ``fmt``, gets the same observations, state and outcome as in text."""
    env, tasks = env_cls(), env_cls().tasks("train")[:40] + env_cls().tasks("validation")[:20]
    for task in tasks:
        env.reset(task)
        written = [rewrite(a, env.tools(), fmt) for a in task.reference]
        assert fmt == "text" or written != list(task.reference)
        assert _played(env, task, written, fmt) == _played(env, task, task.reference, "text")
        assert env.evaluate(task) == 1.0, (task.task_id, written)


BFCL_ARGS = {t.name: [a.name for a in t.args] for t in BFCLEnv().tools()}


def _as_json_calls(reference: str) -> list[dict]:
    """A BFCL reference turn (``[f(a=1), g('x')]``) as JSON call objects."""
    tree = ast.parse(reference, mode="eval").body
    return [{"name": call.func.id, "arguments": {
        **{name: ast.literal_eval(v) for name, v in zip(BFCL_ARGS[call.func.id], call.args)},
        **{k.arg: ast.literal_eval(k.value) for k in call.keywords}}} for call in tree.elts]


@pytest.mark.parametrize("fmt", ["json", "hermes"])
def test_bfcl_turns_written_as_json_calls_step_as_its_python_calls_do(fmt):
    """BFCL runs several calls a reply and ends a turn on a reply with none: a JSON list (or
    one hermes block per call) is the same turn as the package's Python call list."""
    tasks = BFCLEnv().tasks("train")[:4]
    for task in tasks:
        written = []
        for turn in task.reference:
            calls = _as_json_calls(turn) if turn else []
            written.append(json.dumps(calls) if fmt == "json" else
                           "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls))
        as_json, as_python = BFCLEnv(), BFCLEnv()
        assert _played(as_json, task, written, fmt) == _played(as_python, task, task.reference,
                                                                "pythonic")
        assert as_json.evaluate(task) == 1.0
        assert "reply without a call" in as_json.instructions(fmt)


@pytest.mark.parametrize("fmt, says", [("json", "not json"), ("hermes", "<tool_call>"),
                                       ("pythonic", "python call"), ("text", "unknown tool")])
def test_prose_is_refused_by_the_env_with_what_the_format_wanted(fmt, says):
    env = FilesEnv()
    env.reset(env.tasks("train")[0])
    obs, done, info = env.step("I would list the files first.", fmt)
    assert says in obs and info["valid"] is False and not done


def test_instructions_ask_for_the_format_and_show_the_example_in_it():
    env = FilesEnv()
    env.reset(env.tasks("train")[0])
    text, hermes = env.instructions("text"), env.instructions("hermes")
    assert "separated by spaces" in text and "- mv src dst" in text
    assert "<tool_call></tool_call>" in hermes and "- mv(src: str, dst: str)" in hermes
    assert '<tool_call>{"name": "ls", "arguments": {"folder": ' in hermes
    assert "Tools:" not in env.instructions("json", list_tools=False)


# --- rollouts ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    with TransformersBackend(model_folder("smollm2-135m"), device="cpu") as backend:
        yield backend


@pytest.mark.slow
def test_smollm2_constrained_replies_all_parse_in_every_format(smollm2):
    """The acceptance check on the transformers engine: every constrained reply of a real
    model is a well-formed call, in its episode's format, of a declared tool (vLLM:
    test_vllm_engine.py). The three formats' episodes share one rollout: the format is the
    episode's."""
    codec = make_codec(smollm2.tokenizer, "json")
    episodes = []
    for fmt in ("json", "hermes", "pythonic"):
        settings = RolloutSettings(max_turns=1, max_context=2048, max_action_tokens=40,
                                   constrained=True, tool_format=fmt)
        episodes += start_episodes(FilesEnv().tasks("validation")[:2], 2, FilesEnv, codec,
                                   settings=settings)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=(codec.eoa_id,),
                            seed=1)
    rollout(smollm2, episodes, codec, params, settings)
    tools = FilesEnv().tools()
    for ep in episodes:
        [step] = ep.steps
        assert step.info["valid"] and step.valid, step.action
        FORMATS[ep.call_format].parse(step.action, tools)  # raises on a malformed call
        assert ep.to_trajectory().info["call_format"] == ep.call_format
    assert sorted({ep.call_format for ep in episodes}) == ["hermes", "json", "pythonic"]


def test_a_marker_policy_cannot_be_asked_for_json(files_policy_path):
    tok = AutoTokenizer.from_pretrained(files_policy_path)
    with pytest.raises(ValueError, match="actor.tool_format=json needs a model with a chat"):
        make_codec(tok, "json")


# --- chat templates that render tools ------------------------------------------------------------

# A ChatML template that, like Qwen's and Hermes', renders a ``tools=`` list into the system
# message; SmolLM2's (CHATML_TEMPLATE here) ignores it.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}"
    "{{ messages[0].content }}\n\n{% endif %}# Tools\n<tools>\n{% for t in tools %}"
    "{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{%- for m in messages %}{% if m.role != 'system' %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- else %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{%- endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CORPUS = ['{"name": "mv", "arguments": {"src": "a.md", "dst": "docs"}} <tool_call> error : '
          "not json You operate the files environment tool user system assistant"] * 40


@pytest.fixture(scope="module")
def chat_path(tmp_path_factory) -> str:
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("chat") / "m", CORPUS))


def test_a_template_that_renders_tools_is_handed_their_schemas(chat_path):
    tok = AutoTokenizer.from_pretrained(chat_path)
    assert tok.chat_template == CHATML_TEMPLATE and not ChatCodec(tok).renders_tools
    tok.chat_template = TOOLS_TEMPLATE
    codec = ChatCodec(tok)
    assert codec.renders_tools
    [ep] = start_episodes(FilesEnv().tasks("train")[:1], 1, FilesEnv, codec,
                          settings=RolloutSettings(constrained=False, tool_format="hermes"))
    schemas = [tool_schema(t) for t in FilesEnv().tools()]
    prompt = tok.decode(ep.tokens)
    env = FilesEnv()
    first = env.reset(ep.task)
    expected = tok.apply_chat_template(
        [{"role": "system", "content": env.instructions("hermes", list_tools=False)},
         {"role": "user", "content": f"{ep.task.query}\n\n{first}"}],
        tools=schemas, tokenize=False, add_generation_prompt=True)
    assert prompt == expected
    assert '"name": "mv"' in prompt and "Tools:" not in prompt  # listed once, by the template


# --- replays of a trajectory written in a format -------------------------------------------------


def _trajectory(task, actions, fmt) -> Trajectory:
    """``actions`` (written in ``fmt``) played in a fresh env, recorded as a rollout would."""
    env = FilesEnv()
    env.reset(task)
    steps = []
    for action in actions:
        obs, _, info = env.step(action, fmt)
        steps.append(Step(action=action, observation=obs, start=0, end=0,
                          valid=info["valid"], info=info))
    reward = env.evaluate(task)
    empty = np.zeros(0)
    return Trajectory(traj_id=f"t-{fmt}", tokens=empty.astype(np.int32),
                      logprobs=empty.astype(np.float32), versions=empty.astype(np.int32),
                      action_mask=empty.astype(np.uint8), steps=steps, reward=reward,
                      success=reward >= 1.0, info={"call_format": fmt})


def _with_detours(task) -> list[str]:
    return ["ls", "cat nothing.md", *task.reference, "pwd"][:6]


@pytest.mark.parametrize("fmt", ["json", "pythonic"])
def test_judge_and_experience_rules_read_a_trajectory_in_its_format(fmt):
    """The reference judge labels, and the rule extractor learns, the same from a trajectory
    written in ``fmt`` as from the same calls in text; the lessons quote text-format calls."""
    task = FilesEnv().tasks("train")[3]
    tools = FilesEnv().tools()
    text_actions = _with_detours(task)
    written = [rewrite(a, tools, fmt) for a in text_actions]
    as_text, as_fmt = _trajectory(task, text_actions, "text"), _trajectory(task, written, fmt)
    assert as_fmt.success and [s.observation for s in as_fmt.steps] == \
        [s.observation for s in as_text.steps]
    judge = ReferenceJudge(FilesEnv)
    assert judge.judge(task, as_fmt).labels == judge.judge(task, as_text).labels
    assert 1 in judge.judge(task, as_fmt).labels

    def lessons(traj):
        return sorted(e.content for e in from_group(
            Group("g", task, [traj, _trajectory(task, ["ls"], "text")], "a", 0.0), 0))

    assert lessons(as_fmt) == lessons(as_text) and lessons(as_text)


def test_warm_start_scripts_write_the_reference_in_the_format(chat_path):
    codec = make_codec(AutoTokenizer.from_pretrained(chat_path), "json")
    task = next(t for t in FilesEnv().tasks("train") if len(t.reference) >= 2)
    settings = RolloutSettings(max_turns=10, max_context=8192, tool_format="json")
    ep = scripted_episode(task, make_env("files"), codec, settings)
    assert ep.reward == 1.0 and len(ep.steps) == len(task.reference)
    for step, reference in zip(ep.steps, task.reference):
        assert json.loads(step.action)["name"] == reference.split()[0]
        assert step.valid


def test_a_bfcl_entry_past_the_context_gets_a_first_action_in_pythonic(smollm2):
    """The package's prompt for this entry is longer than SmolLM2's 8,192 positions, so the
    text format ends it before a first action; the pythonic prompt (one line a function) with
    a window over the turns gives it one."""
    from episodes.context import ContextManager

    task = next(t for t in BFCLEnv().tasks("test") if t.task_id == "multi_turn_base_68")
    codec = make_codec(smollm2.tokenizer, "pythonic")
    params = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=(codec.eoa_id,),
                            seed=0)
    firsts = {}
    for fmt in ("text", "pythonic"):
        settings = RolloutSettings(max_turns=1, max_context=8192, max_action_tokens=8,
                                   constrained=False, tool_format=fmt,
                                   context=ContextManager("window", keep=4))
        [ep] = start_episodes([task], 1, BFCLEnv, codec, settings=settings)
        rollout(smollm2, [ep], codec, params, settings)
        firsts[fmt] = (len(ep.tokens), len(ep.steps), ep.truncated)
    assert firsts["text"][0] > 8192 - 8 and firsts["text"][1:] == (0, True)
    assert firsts["pythonic"][0] < 3000 and firsts["pythonic"][1] == 1


def test_smollm2_held_to_bfcls_call_grammar_writes_calls_that_parse(smollm2):
    """BFCL lists no candidates: constrained decoding holds the model to the grammar of the
    functions declared now (any string literal, several calls a reply), and closes the call
    within a tight budget of 40 tokens (the grammar's own admissions, every format: in
    test_call_grammar.py; a BFCL prompt costs seconds a rollout here, so one format)."""
    fmt = "pythonic"
    from episodes.context import ContextManager

    codec = make_codec(smollm2.tokenizer, fmt)
    settings = RolloutSettings(max_turns=1, max_context=8192, max_action_tokens=40,
                               constrained=True, tool_format=fmt,
                               context=ContextManager("window", keep=4))
    episodes = start_episodes(BFCLEnv().tasks("validation")[:1], 1, BFCLEnv, codec,
                              settings=settings)
    assert all(ep.next_call.free_form and ep.next_call.candidates == [] for ep in episodes)
    rollout(smollm2, episodes, codec, SamplingParams(
        temperature=1.0, max_new_tokens=40, stop_token_ids=(codec.eoa_id,), seed=5), settings)
    [step] = episodes[0].steps
    assert step.valid and step.info.get("calls"), step.action


def test_an_env_written_before_formats_is_called_in_every_format():
    """``def step(self, action_text)`` and ``def instructions(self)``, as envs were written
    before call formats: the call reaches the env as text, the instructions get the format's
    reply form."""

    class OldStyle(FilesEnv):
        def step(self, action_text):
            self.seen = action_text
            return super().step(action_text)

        def instructions(self):
            return "Move the files where the task says."

    env = OldStyle()
    task = env.tasks("train")[0]
    for fmt in FORMAT_NAMES:
        env.reset(task)
        written = rewrite(task.reference[0], env.tools(), fmt)
        assert env.step(written, fmt)[2]["valid"] and env.seen == task.reference[0]
        assert env.evaluate(task) == 1.0
    assert env.instructions() == "Move the files where the task says."
    hermes = env.instructions("hermes", False)
    assert hermes.startswith("Move the files") and "<tool_call></tool_call>" in hermes
