"""Experience-guided rollouts: injection layout, group split, metrics, against a real pool."""

from __future__ import annotations

import random
import uuid

import numpy as np
import pytest
import redis

from environments.files import FilesEnv
from episodes.rollout import (
    Guidance,
    PromptCodec,
    RolloutSettings,
    rollout,
    start_episodes,
    to_groups,
)
from inference.backends.base import SamplingParams
from inference.backends.hf import TransformersBackend
from learner.batching import strip_experience
from navigating.navigator import Navigator, guided_slots
from navigating.pool import ExperiencePool, experience_id
from protocol.config import ExperienceConfig
from protocol.messages import Experience


@pytest.fixture(scope="module")
def backend(files_policy_path):
    b = TransformersBackend(files_policy_path, device="cpu")
    yield b
    b.close()


@pytest.fixture
def pool(redis_url, embedder):
    client = redis.Redis.from_url(redis_url)
    yield ExperiencePool(client, f"test:{uuid.uuid4().hex[:8]}", embedder)
    client.close()


def _exp(when: str, content: str) -> Experience:
    return Experience(exp_id=experience_id(when, content), when_to_use=when, content=content)


def test_guided_slots_are_the_rounded_share_at_random_positions():
    rng = random.Random(0)
    assert len(guided_slots(8, 0.5, rng)) == 4
    assert len(guided_slots(5, 0.5, rng)) == 2  # round-half-even; never all, never none
    assert guided_slots(8, 0.0, rng) == set()
    assert guided_slots(8, 1.0, rng) == set(range(8))
    seen = set().union(*(guided_slots(8, 0.5, rng) for _ in range(50)))
    assert seen == set(range(8))  # positions vary


def test_injected_prompt_strips_to_the_plain_prompt(backend):
    codec = PromptCodec(backend.tokenizer)
    plain, no_span = codec.start("move notes.txt into docs", "ok")
    guided, span = codec.start("move notes.txt into docs", "ok", "worked : cd docs")
    assert no_span == [] and span[0] == len(codec.bos)
    assert guided[span[0]] == codec.exp_open and guided[span[1] - 1] == codec.exp_close
    assert guided[:span[0]] + guided[span[1]:] == plain


def test_guided_group_records_span_and_ids_and_strips_exactly(backend):
    env = FilesEnv()
    task = env.tasks("train")[0]
    codec = PromptCodec(backend.tokenizer)
    guide = Guidance(text=f"worked : {' ; '.join(task.reference)}", exp_ids=["e1"])
    plan = [[guide if i in (1, 3) else None for i in range(4)]]
    episodes = start_episodes([task], 4, FilesEnv, codec, plan)
    settings = RolloutSettings(max_turns=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=settings.max_action_tokens,
                            stop_token_ids=(codec.eoa_id,), seed=3)
    rollout(backend, episodes, codec, params, settings)
    group = to_groups(episodes, 4, "a", 0.0)[0]
    for i, traj in enumerate(group.trajectories):
        traj.validate()
        assert bool(traj.experience_ids) == (i in (1, 3))
        if traj.experience_ids:
            start, end = traj.experience_span
            assert traj.experience_ids == ["e1"]
            assert not traj.action_mask[start:end].any()
            stripped = strip_experience(traj)
            plain_prompt = episodes[0].tokens[:episodes[0].prompt_len]
            assert list(stripped.tokens[:stripped.prompt_len]) == plain_prompt
            # the actions and observations after the prompt are untouched
            assert np.array_equal(stripped.tokens[stripped.prompt_len:],
                                  traj.tokens[traj.prompt_len:])


def test_navigator_injects_into_share_and_reports_metrics(pool, backend):
    env = FilesEnv()
    tasks = [t for t in env.tasks("train") if t.query.startswith("move")][:2]
    # rule extractors key an experience by the query of the task it came from
    advice = {t.task_id: f"worked : {' ; '.join(t.reference)}" for t in tasks}
    pool.add([_exp(t.query, advice[t.task_id]) for t in tasks]
             + [_exp("delete folder tmp", "worked : rm tmp")])
    cfg = ExperienceConfig(share=0.5, top_k=2, min_similarity=0.3)
    nav = Navigator(pool, cfg, seed=0)
    plan = nav.guide(tasks, 4)
    for task, row in zip(tasks, plan):
        guided = [g for g in row if g is not None]
        assert len(guided) == 2
        assert guided[0].text.startswith(advice[task.task_id])  # its own lesson ranks first
        assert "rm tmp" not in guided[0].text
    episodes = start_episodes(tasks, 4, FilesEnv, PromptCodec(backend.tokenizer), plan)
    for ep, ok in zip(episodes, [1, 0, 1, 0, 0, 0, 1, 1]):
        ep.reward = float(ok)
    nav.record(episodes)
    m = nav.metrics(episodes, 4)
    assert m["retrieval_hit_rate"] == 1.0 and m["guided_fraction"] == 0.5
    assert m["pool_size"] == 3.0 and 0.3 <= m["retrieval_similarity"] <= 1.0
    guided_ok = [ep.reward for ep in episodes if ep.guided]
    plain_ok = [ep.reward for ep in episodes if not ep.guided]
    assert m["success_with_exp"] == pytest.approx(np.mean(guided_ok))
    assert m["success_without_exp"] == pytest.approx(np.mean(plain_ok))
    expected_uses: dict[str, int] = {}
    for ep in episodes:
        for exp_id in ep.experience_ids:
            expected_uses[exp_id] = expected_uses.get(exp_id, 0) + 1
    assert {e.exp_id: e.uses for e in pool.all() if e.uses} == expected_uses
    assert sum(e.successes for e in pool.all()) == sum(
        len(ep.experience_ids) for ep in episodes if ep.guided and ep.reward >= 1.0)


def test_no_hit_means_no_guidance(pool):
    pool.add([_exp("delete folder tmp", "worked : rm tmp")])
    nav = Navigator(pool, ExperienceConfig(min_similarity=0.95), seed=0)
    task = FilesEnv().tasks("train")[0]
    assert nav.guide([task], 4) == [[None] * 4]
    assert nav.metrics([], 4)["retrieval_hit_rate"] == 0.0

