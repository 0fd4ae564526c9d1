"""Real rollouts for learner tests, made by the rollout code with a tiny policy on `files`, and
the learner that trains on them."""

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
from protocol.config import RunConfig
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


def learner_for(model_path: str, run_dir, control, replay=None, **sets):
    """A learner on ``model_path`` built as a run builds it (``autodidact.wiring``), warming up
    over one update; ``sets`` set learner fields (``lr=...``), or another section's as
    ``section__field``."""
    from autodidact.wiring import build_learner

    cfg = RunConfig()
    cfg.model.path = model_path
    cfg.learner.warmup_updates = 1
    for key, value in sets.items():
        section, name = key.split("__") if "__" in key else ("learner", key)
        setattr(getattr(cfg, section), name, value)
    return build_learner(cfg, run_dir, control, replay)
