"""Config files: every one shipped parses; bad keys, types and values are refused by name."""

import dataclasses
import types
import typing
from pathlib import Path

import pytest
import yaml

from autodidact.resolve import resolve_config
from protocol.config import RunConfig
from protocol.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(ROOT.glob("configs/**/*.yaml"))


def test_there_are_shipped_configs():
    assert SHIPPED, "configs/ holds no YAML"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    assert isinstance(resolve_config(path), RunConfig)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_says_which_validation_comparison_chose_it(path):
    # Settings are chosen on validation, never on test; a config that was not says so.
    said = [line for line in path.read_text().splitlines()
            if line.startswith("# Chosen on validation:")]
    assert len(said) == 1, f"{path.name}: no '# Chosen on validation:' line"


def test_default_yaml_matches_embedded_defaults():
    assert resolve_config(ROOT / "configs" / "default.yaml") == RunConfig()


def test_overrides_apply_with_types():
    cfg = resolve_config(overrides=["replay.max_groups=12", "redis.heartbeat_ttl_s=3", "name=x"])
    assert (cfg.replay.max_groups, cfg.redis.heartbeat_ttl_s, cfg.name) == (12, 3.0, "x")


@pytest.mark.parametrize("override, names", [
    ("replay.bogus=1", "replay.bogus"),
    ("bogus.key=1", "bogus"),
    ("replay.max_groups=many", "replay.max_groups"),
    ("replay.max_groups=true", "replay.max_groups"),
    ("replay.map_size=-5", "replay.map_size"),
    ("replay.map_size=10", "replay.map_size must be at least 1048576 bytes"),
    ("replay.judge_lease_s=0", "replay.judge_lease_s"),
    ("redis=3", "redis"),
    ("novalue", "key=value"),
])
def test_bad_config_is_refused_naming_the_key(override, names):
    with pytest.raises(ConfigError) as info:
        resolve_config(overrides=[override])
    assert names in str(info.value)


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("replay:\n  max_grups: 3\n")
    with pytest.raises(ConfigError, match="replay.max_grups"):
        resolve_config(path)


# --- every field, by introspection: a new field without a check fails here ------------------------

SECTIONS = {f.name: f.type for f in dataclasses.fields(RunConfig)
            if dataclasses.is_dataclass(typing.get_type_hints(RunConfig)[f.name])}
_HINTS = {name: typing.get_type_hints(cls) for name, cls in
          [("", RunConfig)] + [(s, typing.get_type_hints(RunConfig)[s]) for s in SECTIONS]}


def _fields(kinds) -> list[str]:
    """``section.key`` (or a top-level ``key``) of every field whose type is in ``kinds``."""
    out = []
    for section, hints in _HINTS.items():
        for key, hint in hints.items():
            if hint in kinds:
                out.append(f"{section}.{key}" if section else key)
    return out


NUMERIC = _fields((int, float))
# Numeric fields for which 0 is a meaningful value ("off", "all", "none", "greedy"...); every
# other one must refuse 0. A new numeric field goes here only if 0 means something for it.
ZERO_OK = {
    "seed", "warmstart.steps", "eval.num_tasks", "learner.max_staleness",
    "learner.warmup_updates", "learner.probe_every", "learner.diagnostics_every",
    "learner.kl_coef", "learner.alpha",
    "learner.alpha_min", "learner.alpha_decay_updates", "learner.alpha_cutoff_updates",
    "learner.clip_low", "learner.clip_high", "llm.max_retries", "llm.temperature",
    "explore.seeds", "explore.rounds", "explore.breadth_steps", "explore.depth_steps",
    "explore.max_steps", "explore.max_entities", "explore.max_tasks", "explore.min_tasks",
    "explore.min_valid_fraction", "explore.dedup_jaccard", "explore.kind_target",  # 0: off
    "explore.from_examples",  # 0: no example re-grounded
    "tasks.synthetic_share", "tasks.match_examples",  # 0: self-made tasks drawn alike
    "tasks.rl_synthetic_share",  # 0: RL on hand-written tasks alone
    "tasks.grader_repetition_cap", "experience.min_similarity", "experience.share",
    "experience.update_every", "experience.dedup_similarity", "experience.warmstart_share",
    "judge.workers", "judge.temperature", "actor.num_actors",  # 0: a head node (multinode)
    "learner.logit_chunk_tokens", "learner.micro_batch_tokens",  # 0: off
    "actor.vllm_max_model_len",  # 0: the model's own
    "learner.lora_rank", "learner.lora_dropout",  # 0: full fine-tuning; no dropout
    "learner.token_log_groups",  # 0: no token log
    "eval.probe_every",  # 0: no validation probe
    "learner.entropy_coef",  # 0: no entropy bonus
    "learner.lr_min_ratio",  # 0: a decay all the way down
    "learner.seq_clip_low", "learner.seq_clip_high",  # 0: no room that side, as clip_low/high
}


def _load(raw: dict, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return resolve_config(path)


def _nested(key: str, value) -> dict:
    section, _, name = key.rpartition(".")
    return {section: {name: value}} if section else {name: value}


def _refused(key: str, value, tmp_path, names: str | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        _load(_nested(key, value), tmp_path)
    assert (names or key) in str(info.value), str(info.value)
    return str(info.value)


def test_introspection_sees_the_sections():
    assert {"replay", "learner", "experience", "judge", "security"} <= set(SECTIONS)
    assert {"replay.map_size", "experience.share", "learner.max_staleness"} <= set(NUMERIC)


@pytest.mark.parametrize("key", NUMERIC)
def test_every_numeric_field_refuses_a_negative_value(key, tmp_path):
    """Sizes, counts, rates, temperatures, fractions: none is meaningful below zero (the one
    sentinel, tasks.synthetic_share = -1, is exactly -1)."""
    hint = _HINTS[key.rpartition(".")[0]][key.rpartition(".")[2]]
    _refused(key, -10**6 if hint is int else -1e6, tmp_path)


@pytest.mark.parametrize("key", [k for k in NUMERIC if k not in ZERO_OK])
def test_numeric_fields_refuse_zero_where_it_is_meaningless(key, tmp_path):
    _refused(key, 0, tmp_path)


@pytest.mark.parametrize("key", sorted(ZERO_OK))
def test_zero_is_accepted_where_it_means_something(key, tmp_path):
    assert key in NUMERIC, "stale entry in ZERO_OK"
    _load(_nested(key, 0), tmp_path)


@pytest.mark.parametrize("key", _fields((float,)))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")],
                         ids=["nan", "inf", "-inf"])
def test_every_float_field_refuses_non_finite_values(key, value, tmp_path):
    _refused(key, value, tmp_path)


@pytest.mark.parametrize("key", _fields((int,)))
def test_every_int_field_refuses_what_does_not_fit_64_bits(key, tmp_path):
    _refused(key, 2**64, tmp_path)


@pytest.mark.parametrize("key, value", [
    # probabilities and fractions outside [0, 1]: eta (experience.share) first
    ("experience.share", 1.5), ("experience.share", 1.0000001), ("experience.warmstart_share", 2.0),
    ("experience.min_similarity", 1.5), ("experience.dedup_similarity", 3.0),
    ("actor.top_p", 1.5), ("explore.min_valid_fraction", 1.01), ("explore.dedup_jaccard", 7.0),
    ("tasks.synthetic_share", 1.5), ("tasks.synthetic_share", -0.5),
    ("tasks.grader_repetition_cap", 1.5), ("learner.clip_low", 1.5), ("learner.clip_high", 11.0),
    # bounds the rest of the system imposes
    ("learner.dual_clip", 1.0), ("learner.max_staleness", 2**31), ("learner.batch_groups", 2**31),
    ("judge.lease_s", 1e9), ("replay.judge_lease_s", 1e9), ("judge.max_groups", 2**31),
    ("replay.map_size", 2**64), ("model.heads", 3), ("model.kv_heads", 3),
    ("experience.kind_order", ["success", "bogus"]), ("name", ""), ("name", " x"),
])
def test_impossible_values_are_refused_naming_the_key(key, value, tmp_path):
    _refused(key, value, tmp_path)


def test_eta_inside_the_range_is_accepted(tmp_path):
    for value in (0, 0.0, 0.5, 1, 1.0):
        assert _load({"experience": {"share": value}}, tmp_path).experience.share == value


def test_no_action_fits_is_refused(tmp_path):
    _refused("actor.max_action_tokens", 384, tmp_path)  # == env.max_context by default
    with pytest.raises(ConfigError, match="env.max_context"):
        _load({"env": {"max_context": 16}}, tmp_path)


def test_a_validation_probe_without_actor_0_is_refused(tmp_path):
    """The probe runs on actor-0 alone: a head that starts no actors could never probe."""
    with pytest.raises(ConfigError, match="eval.probe_every.*actor.num_actors=0"):
        _load({"eval": {"probe_every": 5}, "actor": {"num_actors": 0}}, tmp_path)
    assert _load({"eval": {"probe_every": 5}, "actor": {"num_actors": 1}},
                 tmp_path).eval.probe_every == 5
    assert _load({"eval": {"probe_every": 0}, "actor": {"num_actors": 0}},
                 tmp_path).actor.num_actors == 0


def _wrong_type(hint):
    if dataclasses.is_dataclass(hint):
        return 3
    if typing.get_origin(hint) is types.UnionType:  # fits no member
        return [1.5]
    return {int: "many", float: "many", bool: "maybe", str: 12, dict: "x"}.get(
        hint, "x" if typing.get_origin(hint) is list else None)


ALL_FIELDS = [f"{s}.{k}" if s else k for s, hints in _HINTS.items() for k in hints]


@pytest.mark.parametrize("key", ALL_FIELDS)
def test_every_field_refuses_a_wrong_type(key, tmp_path):
    section, _, name = key.rpartition(".")
    hint = _HINTS[section][name]
    assert _wrong_type(hint) is not None, f"no wrong value known for {hint}"
    _refused(key, _wrong_type(hint), tmp_path)
    if hint in (int, float):
        _refused(key, True, tmp_path)  # YAML booleans are not numbers
    if typing.get_origin(hint) is list:
        _refused(key, [[1]], tmp_path, f"{key}[0]")


@pytest.mark.parametrize("raw, names", [
    ({"bogus": 1}, "bogus"),
    *(({s: {"bogus": 1}}, f"{s}.bogus") for s in SECTIONS),
    ({"env": {"options": {"bogus": 1}}}, "env.options.bogus"),
    ({"env": {"name": "bfcl", "options": {"num_worlds": 3}}}, "env.options.num_worlds"),
    ({"env": {"options": {"num_worlds": "many"}}}, "env.options.num_worlds"),
    ({"env": {"name": "nosuchenv"}}, "env.name"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unknown_keys_at_every_level_are_refused(raw, names, tmp_path):
    with pytest.raises(ConfigError) as info:
        _load(raw, tmp_path)
    assert names in str(info.value)


def test_env_options_of_the_env_are_accepted(tmp_path):
    cfg = _load({"env": {"options": {"num_worlds": 12, "holdout": "world"}}}, tmp_path)
    assert cfg.env.options == {"num_worlds": 12, "holdout": "world"}
    # a plugin env is imported only when an env is made: its options are not checked here
    _load({"env": {"name": "some.module:thing", "options": {"anything": 1}}}, tmp_path)


def test_overrides_name_the_key_too():
    for item, names in [("experience.share=1.5", "experience.share"),
                        ("learner.lr=.nan", "learner.lr"), ("learner.lr=.inf", "learner.lr"),
                        ("replay.max_groups=-1", "replay.max_groups"),
                        ("env.options.bogus=1", "env.options.bogus")]:
        with pytest.raises(ConfigError, match=names):
            resolve_config(overrides=[item])


def test_a_float_in_e_notation_without_a_dot_is_a_number(tmp_path):
    """YAML 1.1 reads ``2e-5`` as a string; ``--set warmstart.lr=2e-5`` must still work, and
    the same text stays a refusal where a string is not a number."""
    from protocol.config import load_config

    cfg = load_config(None, ["warmstart.lr=2e-5", "learner.lr=3E-4"])
    assert cfg.warmstart.lr == 2e-5 and cfg.learner.lr == 3e-4
    with pytest.raises(ConfigError, match="warmstart.lr"):
        load_config(None, ["warmstart.lr=fast"])
    with pytest.raises(ConfigError, match="warmstart.steps"):
        load_config(None, ["warmstart.steps=2e5"])  # an int field takes no float text


# --- the resolved config.yaml and broken files ----------------------------------------------


def test_the_resolved_config_reads_back_whole_and_refuses_a_cut_or_changed_copy(tmp_path):
    from autodidact.roles import write_resolved_config
    from protocol.config import load_config, to_dict

    cfg = load_config(None, ["learner.lr=3e-5", "env.max_turns=7"])
    path = write_resolved_config(cfg, tmp_path)
    assert to_dict(load_config(path)) == to_dict(cfg)
    assert path.stat().st_mode & 0o777 == 0o600
    text = path.read_text()
    cut = tmp_path / "cut.yaml"
    cut.write_text(text[: len(text) * 2 // 3])  # the last sections are gone
    with pytest.raises(ConfigError, match=r"cut\.yaml: incomplete or altered resolved config"):
        load_config(cut)
    changed = tmp_path / "changed.yaml"
    changed.write_text(text.replace("max_turns: 7", "max_turns: 9"))
    with pytest.raises(ConfigError, match="incomplete or altered"):
        load_config(changed)
    assert yaml.safe_load(text)["learner"]["lr"] == 3e-5  # still plain YAML for other readers


@pytest.mark.parametrize("content, message", [
    (b"learner:\n  lr: [1e-5\nenv: {}\n", r"bad\.yaml:\d+:\d+: not valid YAML"),
    (b"learner:\n\tlr: 1e-5\n", r"bad\.yaml:2:1: not valid YAML"),
    (b"\xff\xfe\x00garbage", r"bad\.yaml: not UTF-8 text \(byte 0\)"),
    (b"- a list\n", r"bad\.yaml: top level must be a mapping"),
])
def test_broken_yaml_names_the_file_and_line(tmp_path, content, message):
    from protocol.config import load_config

    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        load_config(bad)


def test_a_broken_override_value_is_named():
    from protocol.config import load_config

    with pytest.raises(ConfigError, match=r"override 'learner.lr=\[1e-5': the value is not"):
        load_config(None, ["learner.lr=[1e-5"])
