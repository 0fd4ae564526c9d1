"""The base model a run starts from: a named model's converted folder, or a tiny word-level
policy made from the env's vocabulary.

    prepare_model        model.path (converted on first use), or the tiny model under model/
    policy_vocabulary    the tiny policy's words: the env's, the advice words of rule-made
                         experiences, and the prompt and experience markers
"""

from __future__ import annotations

from pathlib import Path

from protocol.config import RunConfig
from protocol.run_dir import RunDir


def policy_vocabulary(env_cls) -> tuple[list[str], tuple[str, ...]]:
    """(words, special words) of a tiny word-level policy for ``env_cls``: the env's words plus
    the advice words rule-made experiences use, and the prompt and experience markers."""
    from inference.codecs import EXPERIENCE_MARKERS, MARKERS
    from navigating.extraction import ADVICE_WORDS
    from navigating.navigator import SEPARATOR

    return [*env_cls.vocabulary(), *ADVICE_WORDS, SEPARATOR], (*MARKERS, *EXPERIENCE_MARKERS)


def prepare_model(cfg: RunConfig, run_dir: Path) -> str:
    """The base model path: cfg.model.path (a named model's converted folder, see
    inference/models.py), or a tiny model fitted to the env's vocabulary (made once under
    ``model/``; the same on every machine that makes it from one config)."""
    if cfg.model.path:
        from inference.models import model_folder

        return model_folder(cfg.model.path)  # a named model: converted on first use
    from environments import env_class
    from inference.tiny_model import make_tiny_model

    m = cfg.model
    words, special = policy_vocabulary(env_class(cfg.env))
    path = make_tiny_model(RunDir(run_dir).model, words, special_words=special, hidden=m.hidden,
                           layers=m.layers, heads=m.heads, kv_heads=m.kv_heads,
                           intermediate=m.intermediate,
                           max_positions=m.max_positions, seed=cfg.seed)
    return str(path)
