"""LoRA end to end on a real tiny model: adapter-only training, adapter-only weight sync over
files and ZeroMQ, engines that apply it (merged or as layers) generating exactly what the
merged model generates, refusals of a wrong base and a torn file, checkpoints and resume, and
``autodidact export --merged`` loading in plain transformers."""

from __future__ import annotations

import shutil

import pytest
import torch
from click.testing import CliRunner
from test_ddp import learner_config, shares, state_of, tiny_model, update_rows
from transformers import AutoModelForCausalLM

from autodidact.wiring import build_learner
from inference import lora
from inference.backends.base import SamplingParams
from inference.backends.hf import TransformersBackend
from learner.checkpoint import CheckpointError
from learner.learner import Learner
from protocol.config import RunConfig
from protocol.errors import ConfigError
from protocol.weights import AdapterMeta, WeightSubscriber, file_metadata, weights_path

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lr": 0.05}
PROMPTS = [[5, 9, 11, 14], [7, 7, 30], [12, 40, 41, 42, 43, 20]]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def lora_learner(model, run_dir, control, **sets) -> Learner:
    return build_learner(learner_config(model, **{**LORA, **sets}), run_dir, control, None)


def trained(model, run_dir, control, updates: int = 2, **sets) -> Learner:
    learner = lora_learner(model, run_dir, control, **sets)
    for u in range(updates):
        learner.update([g for share in shares(u) for g in share], 0.0)
    learner.publisher.wait()
    return learner


def logits(module, ids) -> torch.Tensor:
    with torch.no_grad():
        return module(torch.tensor([ids])).logits


def generations(backend, seed: int = 3):
    sampled = backend.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=12,
                                                       seed=seed, logprobs_mode="raw"))
    greedy = backend.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12))
    return sampled + greedy


def merged_backend(model, learner, tmp_path) -> TransformersBackend:
    """An engine holding the merged weights of ``learner``'s adapter, loaded whole."""
    out = tmp_path / "merged"
    shutil.copytree(model, out)
    merged = AutoModelForCausalLM.from_pretrained(model)
    lora.merge_into(merged, lora.adapter_state(learner.step.model.state_dict()),
                    learner.step.adapter)
    backend = TransformersBackend(out)
    backend.load_weights(merged.state_dict(), version=learner.version)
    return backend


def test_a_fresh_adapter_is_the_base_and_only_the_adapter_trains(model, tmp_path, control):
    base = AutoModelForCausalLM.from_pretrained(model)
    learner = lora_learner(model, tmp_path, control)
    step = learner.step
    torch.testing.assert_close(logits(step.model, PROMPTS[0]), logits(base, PROMPTS[0]),
                               rtol=0, atol=0)  # B starts at zero
    trainable = {n for n, p in step.model.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter_key(n) for n in trainable)
    assert sum(len(g["params"]) for g in step.optimizer.param_groups) == len(trainable)
    for u in range(2):
        learner.update([g for share in shares(u) for g in share], 0.0)
    learner.close()
    state = step.model.state_dict()
    for name, value in base.state_dict().items():
        assert torch.equal(state[name], value), f"{name} of the frozen base moved"
    assert all(state[n].abs().sum() > 0 for n in trainable if n.endswith("lora_B"))
    assert not torch.allclose(logits(step.model, PROMPTS[0]), logits(base, PROMPTS[0]))


@pytest.mark.parametrize("mode", ["merge", "layers"])
def test_an_actor_after_loading_an_adapter_generates_what_the_merged_model_does(
        model, tmp_path, control, mode):
    learner = trained(model, tmp_path / "run", control)
    data = weights_path(tmp_path / "run", learner.version).read_bytes()
    adapter = AdapterMeta.from_metadata(file_metadata(data))
    assert adapter == learner.step.adapter and adapter.base_sha256 == lora.base_digest(model)
    full = sum(p.numel() for p in learner.step.model.parameters()) * 4
    assert len(data) < full / 5  # only the adapter travelled (a tiny model's share is big)
    actor = TransformersBackend(model, adapter_mode=mode)
    subscriber = WeightSubscriber(control, "actor-0")
    assert subscriber.follow(actor) == learner.version == 2
    want = merged_backend(model, learner, tmp_path)
    got, expected = generations(actor), generations(want)
    for g, w in zip(got, expected):
        assert g.token_ids == w.token_ids and g.version == 2
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    learner.close()


def test_a_new_adapter_replaces_the_old_one_in_a_merging_engine(model, tmp_path, control):
    learner = trained(model, tmp_path / "run", control, updates=1)
    actor = TransformersBackend(model)
    subscriber = WeightSubscriber(control, "actor-0")
    assert subscriber.follow(actor) == 1
    learner.update([g for share in shares(1) for g in share], 0.0)
    learner.publisher.wait()
    assert subscriber.follow(actor) == 2
    want = merged_backend(model, learner, tmp_path)  # version 2 on the base, not on version 1
    for g, w in zip(generations(actor), generations(want)):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    learner.close()


def test_an_adapter_over_zeromq_loads_like_one_from_the_file(model, tmp_path, control):
    from protocol.weights import WeightClient, WeightServer

    server = WeightServer("tcp://127.0.0.1:*")
    learner = lora_learner(model, tmp_path / "run", control)
    learner.publisher.server = server
    for u in range(2):
        learner.update([g for share in shares(u) for g in share], 0.0)
    learner.publisher.wait()
    client = WeightClient(server.address, timeout_s=10)
    try:
        remote = TransformersBackend(model)
        assert WeightSubscriber(control, "node-actor", source=client).follow(remote) == 2
        local = TransformersBackend(model)
        assert WeightSubscriber(control, "actor-0").follow(local) == 2
        for g, w in zip(generations(remote), generations(local)):
            assert g.token_ids == w.token_ids and g.logprobs == w.logprobs
        assert 0 < server.stats()["bytes"] < 200_000
    finally:
        client.close()
        learner.close()
        server.close()


def test_an_adapter_for_another_base_is_refused_and_the_old_version_kept(model, tmp_path,
                                                                           control):
    learner = trained(model, tmp_path / "run", control, updates=1)
    other = AutoModelForCausalLM.from_pretrained(model)  # same shapes, one weight nudged
    with torch.no_grad():
        other.model.norm.weight.add_(0.01)
    shutil.copytree(model, tmp_path / "other")
    other.save_pretrained(tmp_path / "other")
    actor = TransformersBackend(tmp_path / "other")
    before = generations(actor)
    subscriber = WeightSubscriber(control, "actor-0")
    assert subscriber.follow(actor) is None
    assert subscriber.rejected == 1 and actor.version == 0
    assert [g.token_ids for g in generations(actor)] == [g.token_ids for g in before]
    learner.close()


def test_a_torn_adapter_file_is_refused(model, tmp_path, control):
    learner = trained(model, tmp_path / "run", control, updates=1)
    path = weights_path(tmp_path / "run", 1)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one byte of a tensor: the size still matches, the digest does not
    path.write_bytes(bytes(data))
    actor = TransformersBackend(model)
    subscriber = WeightSubscriber(control, "actor-0")
    assert subscriber.follow(actor) is None
    assert subscriber.rejected == 1 and actor.version == 0
    learner.close()


def test_a_malformed_adapter_is_refused_before_anything_changes(model):
    actor = TransformersBackend(model)
    meta = AdapterMeta(rank=4, alpha=8.0, targets="q_proj", base_id=model,
                       base_sha256=lora.base_digest(model))
    before = generations(actor)
    bad = {"model.layers.0.self_attn.q_proj.lora_A": torch.ones(4, 7),
           "model.layers.0.self_attn.q_proj.lora_B": torch.ones(32, 4)}
    with pytest.raises(ValueError, match="does not fit|shape"):
        actor.load_adapter(bad, meta, version=5)
    assert actor.version == 0
    assert [g.token_ids for g in generations(actor)] == [g.token_ids for g in before]


def test_checkpoint_holds_the_adapter_and_resume_continues_exactly(model, tmp_path, control):
    first = trained(model, tmp_path, control)
    first._uncommitted = []  # no replay server to commit the ledger to
    first.checkpoint()
    from learner.checkpoint import read_checkpoint

    state, _ = read_checkpoint(tmp_path)
    assert state["model"] and all(lora.is_adapter_key(k) for k in state["model"])
    resumed = lora_learner(model, tmp_path, control)
    assert resumed.resume() and resumed.updates == 2
    for each in (first, resumed):
        each.update([g for share in shares(0) for g in share], 0.0)
    a, b = first.step.model.state_dict(), resumed.step.model.state_dict()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6, msg=key)
    first.close()
    resumed.close()
    with pytest.raises(CheckpointError, match="rank"):
        lora_learner(model, tmp_path, control, lora_rank=8).resume()
    with pytest.raises(CheckpointError, match="full fine-tuning"):
        build_learner(learner_config(model), tmp_path, control, None).resume()


def test_export_merged_loads_in_plain_transformers(model, tmp_path, control):
    from autodidact.cli import main
    from autodidact.roles import write_resolved_config

    cfg = learner_config(model, **LORA)
    write_resolved_config(cfg, tmp_path)
    learner = trained(model, tmp_path, control)
    learner._uncommitted = []
    learner.checkpoint()
    learner.close()
    out = tmp_path / "export"
    result = CliRunner().invoke(main, ["export", "--run-dir", str(tmp_path), "--out", str(out),
                                       "--merged"])
    assert result.exit_code == 0, result.output
    plain = AutoModelForCausalLM.from_pretrained(out)
    assert not any(lora.is_adapter_key(k) for k in plain.state_dict())
    for ids in PROMPTS:
        torch.testing.assert_close(logits(plain, ids), logits(learner.step.model, ids),
                                   rtol=0, atol=1e-5)
    adapter_out = tmp_path / "adapter"
    result = CliRunner().invoke(main, ["export", "--run-dir", str(tmp_path), "--out",
                                       str(adapter_out)])
    assert result.exit_code == 0, result.output
    assert (adapter_out / "adapter_config.json").is_file()


def test_final_policy_merges_a_published_adapter(model, tmp_path, control):
    from autodidact.stages import final_policy

    learner = trained(model, tmp_path, control)
    learner.close()
    plain = AutoModelForCausalLM.from_pretrained(final_policy(tmp_path, model))
    torch.testing.assert_close(logits(plain, PROMPTS[1]),
                               logits(learner.step.model, PROMPTS[1]), rtol=0, atol=1e-5)


def test_kl_to_the_base_needs_no_reference_copy(model, tmp_path, control):
    learner = lora_learner(model, tmp_path, control, kl_coef=0.1)
    assert learner.step.reference is None
    learner.update([g for share in shares(0) for g in share], 0.0)
    learner.update([g for share in shares(1) for g in share], 0.0)
    learner.close()
    from metrics.jsonl import read_metrics

    rows = [r for r in read_metrics(tmp_path, "learner") if "learner/kl_ref" in r]
    assert rows and rows[0]["learner/kl_ref"] == pytest.approx(0.0, abs=1e-7)  # adapter at zero
    assert rows[-1]["learner/kl_ref"] != 0.0  # the adapter moved away from the base


@pytest.mark.parametrize("sets, message", [
    (["learner.lora_rank=-1"], "lora_rank"),
    (["learner.lora_rank=4", "learner.lora_targets=[]"], "lora_targets"),
    (["learner.lora_rank=4", "learner.lora_alpha=0"], "lora_alpha"),
    (["learner.lora_dropout=1.0"], "lora_dropout"),
    (["actor.lora_apply=fused"], "lora_apply"),
])
def test_bad_lora_settings_are_refused_naming_the_key(sets, message):
    from protocol.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, sets)


def test_targets_that_match_no_layer_are_refused_with_the_layer_names(model, tmp_path, control):
    with pytest.raises(ValueError, match="q_proj"):
        lora_learner(model, tmp_path, control, lora_targets=["attention"])


def test_dropout_only_while_training(model):
    net = AutoModelForCausalLM.from_pretrained(model)
    meta = AdapterMeta(rank=2, alpha=4.0, targets="q_proj,v_proj", base_id="x", base_sha256="y")
    lora.attach(net, meta, dropout=0.5, init_seed=0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("lora_B"):
                p.normal_()
    net.eval()
    assert torch.equal(logits(net, PROMPTS[0]), logits(net, PROMPTS[0]))
    net.train()
    torch.manual_seed(0)
    assert not torch.equal(logits(net, PROMPTS[0]), logits(net, PROMPTS[0]))


def test_config_defaults_train_the_whole_model():
    assert RunConfig().learner.lora_rank == 0


def test_the_policy_judge_and_proposer_use_the_current_adapter(model, tmp_path, control):
    from autodidact.wiring import make_judges
    from questioning.factory import make_chat

    learner = trained(model, tmp_path, control)
    want = [g.token_ids for g in generations(merged_backend(model, learner, tmp_path))]
    cfg = learner_config(model, **LORA)
    cfg.judge.backend, cfg.explore.proposer = "policy", "policy"
    judge, _, follow = make_judges(cfg, control, "judge-0", tmp_path)
    assert follow() == 2  # the hook the judge worker calls between pulls
    proposer = make_chat(cfg, model, tmp_path)  # started mid-run: the newest version on disk
    for chat in (judge.chat, proposer):
        assert chat.backend.version == 2
        assert [g.token_ids for g in generations(chat.backend)] == want
    learner.close()


def test_a_merging_engine_undoes_an_adapter_whose_targets_the_next_one_drops(model):
    """v1 adapts q and v, v2 only v: q must be the base's again, not v1's merge."""
    def adapter(targets: str, seed: int):
        net = AutoModelForCausalLM.from_pretrained(model)
        meta = AdapterMeta(rank=2, alpha=4.0, targets=targets, base_id=model,
                           base_sha256=lora.base_digest(model))
        lora.attach(net, meta, init_seed=seed)
        with torch.no_grad():
            for name, p in net.named_parameters():
                if name.endswith("lora_B"):
                    p.normal_(generator=torch.Generator().manual_seed(seed))
        return net, lora.adapter_state(net.state_dict()), meta

    actor = TransformersBackend(model)
    _, first, first_meta = adapter("q_proj,v_proj", 1)
    actor.load_adapter(first, first_meta, version=1)
    want, second, second_meta = adapter("v_proj", 2)
    actor.load_adapter(second, second_meta, version=2)
    for ids in PROMPTS:
        torch.testing.assert_close(logits(actor.model, ids), logits(want, ids), rtol=0,
                                   atol=1e-5)


def test_merged_weights_stay_on_the_engines_device(model, tmp_path, control):
    """An engine on a GPU merges an adapter read from a file (so on the CPU) into its own
    weights: the merge happens on the weights' device. ``meta`` stands in for a GPU here; the
    CUDA test below is the real thing where a GPU is."""
    learner = trained(model, tmp_path / "run", control, updates=1)
    state = learner.step.model.state_dict()
    tensors = lora.adapter_state(state)
    base = {f"{m}.weight": torch.empty(state[f"{m}.weight"].shape, device="meta")
            for m in lora.adapted_modules(tensors)}
    merged = lora.merged_weights(base, tensors, learner.step.adapter)
    assert merged.keys() == base.keys()
    assert all(w.device.type == "meta" and w.shape == base[n].shape for n, w in merged.items())
    learner.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["merge", "layers"])
def test_an_engine_on_cuda_follows_an_adapter(model, tmp_path, control, mode):
    learner = trained(model, tmp_path / "run", control)
    actor = TransformersBackend(model, device="cuda", adapter_mode=mode)
    assert WeightSubscriber(control, "actor-0").follow(actor) == learner.version
    want = merged_backend(model, learner, tmp_path)
    for ids in PROMPTS:
        with torch.no_grad():
            got = actor.model(torch.tensor([ids], device="cuda")).logits.cpu()
        assert torch.allclose(got, logits(want.model, ids), atol=1e-4)
    learner.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rank", [0, 4])
def test_a_learner_on_cuda_takes_the_step_the_cpu_takes(model, tmp_path, control, rank):
    """Full and adapter training on CUDA, rows split into length-packed micro-batches (whose
    positions were once built on the CPU), in fp32 so the two devices' losses compare."""
    sets = {**(LORA if rank else {}), "lora_rank": rank, "micro_batch_tokens": 64,
            "autocast": "none"}
    losses = {}
    for device in ("cpu", "cuda"):
        run_dir = tmp_path / device
        learner = build_learner(learner_config(model, device=device, **sets), run_dir, control,
                                None)
        before = state_of(learner)
        learner.update([g for share in shares(0) for g in share], 0.0)
        after = state_of(learner)
        assert any(not torch.equal(before[k], after[k]) for k in before)
        learner.close()
        losses[device] = update_rows(run_dir)[-1]["learner/loss"]
    assert losses["cuda"] == pytest.approx(losses["cpu"], abs=1e-4, rel=1e-3)
