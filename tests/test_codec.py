"""The wire format: round trips, raw arrays, and every rejection reason."""

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import codec
from protocol.errors import SchemaError
from protocol.messages import Group, Step, StepLabels, Task, Trajectory, WeightsAnnouncement


def make_group(n_traj=2, T=12, version=3, gid="g-1"):
    trajs = []
    for i in range(n_traj):
        mask = np.zeros(T, np.uint8)
        mask[4:8] = 1
        trajs.append(Trajectory(
            traj_id=f"{gid}/{i}", tokens=np.arange(T, dtype=np.int32),
            logprobs=-np.linspace(0, 1, T).astype(np.float32),
            versions=np.where(mask == 1, version, -1).astype(np.int32), action_mask=mask,
            prompt_len=4, steps=[Step("ls", "a b", 4, 8)], reward=float(i), success=bool(i)))
    return Group(group_id=gid, task=Task("t", "files", "q", 1), trajectories=trajs)


def frame_with_body(tag, body_map, version=codec.SCHEMA_VERSION):
    body = msgpack.packb(body_map, default=codec._ext_default, use_bin_type=True)
    return codec.pack_frame(tag, "m1", body, version)


def reason_of(frame):
    with pytest.raises(SchemaError) as info:
        codec.decode(frame, max_bytes=1 << 20)
    return info.value.reason


def test_round_trip_preserves_everything():
    g = make_group()
    env, back = codec.decode(codec.encode(g, "id-7"))
    assert env.msg_id == "id-7" and env.type_tag == "group"
    assert back.group_id == g.group_id and back.task == g.task
    for a, b in zip(g.trajectories, back.trajectories):
        for name in ("tokens", "logprobs", "versions", "action_mask"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
            assert getattr(a, name).dtype == getattr(b, name).dtype
        assert a.steps == b.steps and a.reward == b.reward
    assert back.policy_versions() == (3, 3)


def test_arrays_travel_as_raw_bytes_not_lists():
    g = make_group(T=1000)
    raw = msgpack.unpackb(codec.encode_body(g), raw=False, ext_hook=lambda c, d: (c, d))
    code, payload = raw["trajectories"][0]["tokens"]
    dtype, shape, data = msgpack.unpackb(payload)
    assert (code, dtype, shape) == (codec.ARRAY_EXT, "<i4", [1000])
    assert data == np.arange(1000, dtype="<i4").tobytes()


def test_big_endian_input_is_sent_little_endian():
    t = make_group().trajectories[0]
    t.tokens = t.tokens.astype(">i4")
    body = msgpack.unpackb(codec.encode_body(t), ext_hook=lambda c, d: msgpack.unpackb(d))
    assert body["tokens"][0] == "<i4"


def test_encode_body_is_deterministic():
    assert codec.encode_body(make_group()) == codec.encode_body(make_group())


@pytest.mark.parametrize("frame, reason", [
    (b"\xc1\xc1garbage", "not_msgpack"),
    (msgpack.packb([1, 2, 3]), "bad_envelope"),
    (msgpack.packb(["autodidact", 1, "group", "id"]), "bad_envelope"),
    (codec.pack_frame("no_such_type", "x", msgpack.packb({})), "unknown_type"),
    (codec.pack_frame("task", "x", msgpack.packb({}), version=codec.SCHEMA_VERSION + 1),
     "future_version"),
    (codec.pack_frame("task", "x", msgpack.packb({}), version=0), "old_version"),
    (codec.pack_frame("task", "x", msgpack.packb({"task_id": "t"})), "missing_field"),
    (codec.pack_frame("task", "x", b"\xc1"), "not_msgpack"),
    # v5 envelopes have a credential, older ones none; a string of bounded length
    (msgpack.packb(["autodidact", 5, "task", "x", msgpack.packb({})]), "bad_envelope"),
    (msgpack.packb(["autodidact", 4, "task", "x", msgpack.packb({}), ""]), "bad_envelope"),
    (msgpack.packb(["autodidact", 5, "task", "x", msgpack.packb({}), 7]), "bad_envelope"),
    (codec.pack_frame("task", "x", msgpack.packb({}), credential="t" * 129), "bad_envelope"),
])
def test_malformed_frames_are_refused_with_a_reason(frame, reason):
    assert reason_of(frame) == reason


def test_field_level_rejections():
    good = codec._fields_of(Task("t", "files", "q", 1))
    assert reason_of(frame_with_body("task", {**good, "extra": 1})) == "unknown_field"
    assert reason_of(frame_with_body("task", {**good, "seed": "one"})) == "wrong_type"
    assert reason_of(frame_with_body("task", {**good, "seed": True})) == "wrong_type"
    assert reason_of(frame_with_body("task", {**good, "goal": [1]})) == "wrong_type"
    t = codec._fields_of(make_group().trajectories[0])
    floats = t["tokens"].astype(np.float32)
    assert reason_of(frame_with_body("trajectory", {**t, "tokens": floats})) == "wrong_dtype"
    assert reason_of(frame_with_body("trajectory", {**t, "tokens": [1, 2, 3]})) == "wrong_type"
    assert reason_of(frame_with_body("trajectory", {**t, "tokens": t["tokens"][:3]})) == "invalid"


def test_array_payload_must_match_shape():
    bad = msgpack.ExtType(codec.ARRAY_EXT, msgpack.packb(["<i4", [10], b"\x00" * 8]))
    t = codec._fields_of(make_group().trajectories[0])
    body = msgpack.packb({**t, "tokens": bad}, default=codec._ext_default)
    assert reason_of(codec.pack_frame("trajectory", "m", body)) == "bad_array"


def test_oversize_is_refused_before_parsing():
    frame = codec.encode(make_group(T=10_000))
    with pytest.raises(SchemaError) as info:
        codec.decode(frame, max_bytes=1000)
    assert info.value.reason == "oversize"


def test_labels_must_be_binary():
    body = codec._fields_of(StepLabels("g", [[1, 0, 2]]))
    assert reason_of(frame_with_body("labels", body)) == "invalid"


def test_no_pickle_types_accepted():
    class Evil:
        pass
    with pytest.raises(TypeError):
        codec.encode(WeightsAnnouncement(1, 1, 1, "x", chunk_sha256=[Evil()]))


def test_the_credential_rides_in_the_envelope_not_the_body():
    task = Task("t", "files", "q", 1)
    env, decoded = codec.decode(codec.encode(task, "m", credential="secret"))
    assert env.credential == "secret" and decoded == task
    assert b"secret" not in env.body  # what a store keeps never holds it
    old = codec.pack_frame("task", "m", codec.encode_body(task), version=4)
    assert codec.decode(old)[0].credential == ""  # a v4 frame still decodes, with none


# Free-form values (an info map, an env's answer): JSON-like, nested at most 32 deep.
_plain_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5)
    | st.binary(max_size=4) | st.sampled_from([object(), 1j, (1, 2)]),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=3) | st.integers(), inner, max_size=3),
    max_leaves=30)


@given(_plain_values, st.integers(min_value=0, max_value=34))
def test_free_form_values_are_refused_exactly_when_not_json_like(value, depth):
    """The fast check (no path per element) and the one that names the path agree."""
    from protocol.codec import _check_plain, _is_plain, _refuse_plain

    try:
        _refuse_plain(value, "v", depth)
        refused = False
    except SchemaError:
        refused = True
    assert _is_plain(value, depth) is not refused
    if refused:
        with pytest.raises(SchemaError):
            _check_plain(value, "v", depth)
    else:
        _check_plain(value, "v", depth)
