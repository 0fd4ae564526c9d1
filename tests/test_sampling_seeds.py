"""Seeds: every turn of a rollout draws its own random numbers, the same seed reproduces the
rollout, and an evaluation's batches are seeded by their tasks, so a resumed evaluation draws
what an unbroken one would."""

from __future__ import annotations

import pytest

from environments.files import FilesEnv
from episodes.evaluate import evaluate
from episodes.rollout import RolloutSettings, make_codec, rollout, start_episodes
from inference.backends.base import SamplingParams
from inference.backends.hf import TransformersBackend


def test_a_fork_is_its_own_seed_and_reproduces():
    params = SamplingParams(temperature=0.7, max_new_tokens=5, seed=3)
    seeds = {params.fork(key).seed for key in (0, 1, 2, "files-test-7")}
    assert len(seeds) == 4 and params.seed not in seeds
    assert params.fork(1) == params.fork(1) and params.fork(1).temperature == 0.7
    assert SamplingParams(seed=4).fork(1).seed != params.fork(1).seed
    unseeded = SamplingParams()
    assert unseeded.fork(5) is unseeded  # a fresh draw each call, as before


class SeedLog:
    """The real engine, with the seed of each generate call written down."""

    def __init__(self, backend):
        self.backend, self.seeds = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def generate(self, prompts, params, constraints=None):
        self.seeds.append(params.seed)
        return self.backend.generate(prompts, params, constraints)


@pytest.fixture(scope="module")
def engine(files_policy_path):
    with TransformersBackend(files_policy_path, device="cpu") as backend:
        yield backend


SETTINGS = RolloutSettings(max_turns=5, max_context=2048, max_action_tokens=6,
                           constrained=False)


def _roll(engine, seed):
    log = SeedLog(engine)
    codec = make_codec(engine.tokenizer)
    episodes = start_episodes(FilesEnv().tasks("train")[:2], 2, FilesEnv, codec)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed,
                            stop_token_ids=(codec.eoa_id,))
    rollout(log, episodes, codec, params, SETTINGS)
    return log.seeds, [list(ep.to_trajectory().tokens) for ep in episodes]


def test_each_turn_samples_with_a_seed_of_its_own(engine):
    seeds, tokens = _roll(engine, seed=11)
    assert len(seeds) >= 2 and len(set(seeds)) == len(seeds)
    again_seeds, again_tokens = _roll(engine, seed=11)
    assert again_seeds == seeds and again_tokens == tokens
    assert _roll(engine, seed=12)[0][0] != seeds[0]


def test_a_resumed_evaluation_draws_what_an_unbroken_one_would(engine):
    tasks = FilesEnv().tasks("validation")[:6]
    run = dict(make_env=FilesEnv, settings=SETTINGS, temperature=1.0, k=2, batch_tasks=3,
               seed=5)
    log = SeedLog(engine)
    unbroken = evaluate(log, tasks, **run)["per_task"]
    resumed_log = SeedLog(engine)
    resumed = evaluate(resumed_log, tasks[3:], **run)["per_task"]  # first batch kept before
    assert resumed == unbroken[3:]
    assert resumed_log.seeds == log.seeds[-len(resumed_log.seeds):]
    assert resumed_log.seeds[0] != log.seeds[0]  # the second batch is not the first's draw
    assert evaluate(engine, tasks[:3], **run)["per_task"] == unbroken[:3]
