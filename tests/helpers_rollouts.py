"""Real rollouts for learner tests: made by the rollout code with a tiny policy on `files`."""

from __future__ import annotations

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
from protocol.messages import Group


def guided_files_groups(model_path: str) -> list[Group]:
    """Two groups of 4 on the first two `files` training tasks, rollouts 1 and 3 with injected
    experience, rewards alternating so the guided ones (odd positions) succeed and the
    advantages are ±1."""
    backend = TransformersBackend(model_path, device="cpu")
    codec = PromptCodec(backend.tokenizer)
    tasks = FilesEnv().tasks("train")[:2]
    plan = [[Guidance(f"worked : {' ; '.join(t.reference)}", [f"e{t.task_id}"])
             if i in (1, 3) else None for i in range(4)] for t in tasks]
    episodes = start_episodes(tasks, 4, FilesEnv, codec, plan)
    settings = RolloutSettings(max_turns=2)
    rollout(backend, episodes, codec,
            SamplingParams(temperature=1.0, max_new_tokens=settings.max_action_tokens,
                           stop_token_ids=(codec.eoa_id,), seed=0, logprobs_mode="raw"),
            settings)
    for i, ep in enumerate(episodes):
        ep.reward = float(i % 2)
    backend.close()
    return to_groups(episodes, 4, "a", 0.0)
