"""The wire format: msgpack frames with a schema version and a type tag; no pickle anywhere.

A frame is a msgpack array::

    ["autodidact", schema_version, type_tag, msg_id, body, credential]

``credential`` (v5) is the sender's role token (``protocol.run_dir.role_token``, "" when it
has none): the replay server decides with it which role a plaintext client may act as. It
rides in the envelope, not the body, so a store that keeps bodies never keeps a secret.

``body`` is itself msgpack bytes (a map of field name to value), kept as opaque bytes in the
envelope so a server can store exactly what a client sent (byte-identical) after validating it.
Numeric arrays travel as msgpack extension type 1 whose payload is ``[dtype, shape, raw]``:
little-endian raw bytes, never lists of numbers.

Messages are dataclasses registered with :func:`message`; decoding validates every field
against the dataclass annotations and raises :class:`SchemaError` with a reason and a path.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from typing import Any, Union

import msgpack
import numpy as np

from protocol.errors import SchemaError

MAGIC = "autodidact"
SCHEMA_VERSION = 7  # bump on any incompatible change to a message in protocol/messages.py
# v2: label deadline (BatchRequest.label_deadline_s, Batch.judge_timeouts). v3: GroupsSince /
# StoredGroups, and BatchRequest.timeout_s is a long-poll (at most MAX_BATCH_WAIT_S): a v2
# server would answer at once and let a v3 learner spin, so it refuses v3 frames instead.
# v4: the learner's requests (LearnerHello, BatchRequest, LedgerCommit) carry its token; an
# older learner's have none and are refused where the run has one. v5: the token moved out of
# those bodies into the envelope's ``credential``, and every role (actor, judge) sends its own.
# v6: Trajectory.contexts (an episode's rebuilt contexts): a v5 learner would train their
# tokens as one sequence, so it must refuse them rather than ignore the field. v7:
# BatchRequest.skip_uninformative and Batch.uninformative_skipped: a v6 server would serve the
# groups a learner asked it to set aside, and never free their admission slots.
MIN_SCHEMA_VERSION = 1  # oldest version this build still decodes
CREDENTIAL_SINCE = 5  # frames of this version or later carry a credential
MAX_CREDENTIAL_CHARS = 128  # a role token is 48 hex characters as made
ARRAY_EXT = 1

# Array dtypes allowed on the wire. Byte order is fixed to little-endian.
_WIRE_DTYPES = {
    "|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8",
}

_REGISTRY: dict[str, type] = {}


def message(tag: str):
    """Register a dataclass as a wire message with type tag ``tag``."""

    def wrap(cls):
        cls = dataclasses.dataclass(cls)
        if tag in _REGISTRY:
            raise ValueError(f"duplicate message tag {tag!r}")
        cls.TYPE = tag
        _REGISTRY[tag] = cls
        return cls

    return wrap


def registered_types() -> dict[str, type]:
    return dict(_REGISTRY)


def array_field(dtype: str, **kwargs):
    """A dataclass field holding a 1-D or N-D numpy array of exactly ``dtype``."""
    return dataclasses.field(metadata={"dtype": np.dtype(dtype).newbyteorder("<").str}, **kwargs)


# ---------------------------------------------------------------------------------------------
# encoding


def _ext_default(obj):
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        payload = msgpack.packb([arr.dtype.str, list(arr.shape), arr.tobytes()])
        return msgpack.ExtType(ARRAY_EXT, payload)
    if isinstance(obj, np.generic):
        return obj.item()
    if dataclasses.is_dataclass(obj) and hasattr(obj, "TYPE"):
        return _fields_of(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _fields_of(msg) -> dict:
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}


def encode_body(msg) -> bytes:
    """The msgpack bytes of a message's fields (what a store keeps)."""
    return msgpack.packb(_fields_of(msg), default=_ext_default, use_bin_type=True)


def encode(msg, msg_id: str = "", credential: str = "") -> bytes:
    """A whole frame for ``msg``. ``msg_id`` correlates replies and makes retries idempotent;
    ``credential`` is the sender's role token."""
    return pack_frame(msg.TYPE, msg_id, encode_body(msg), credential=credential)


def pack_frame(type_tag: str, msg_id: str, body: bytes, version: int = SCHEMA_VERSION,
               credential: str = "") -> bytes:
    outer = [MAGIC, version, type_tag, msg_id, body]
    if version >= CREDENTIAL_SINCE:
        outer.append(credential)
    return msgpack.packb(outer, use_bin_type=True)


# ---------------------------------------------------------------------------------------------
# decoding


@dataclasses.dataclass
class Envelope:
    """A frame whose envelope parsed; ``body`` is still raw bytes."""

    version: int
    type_tag: str
    msg_id: str
    body: bytes
    credential: str = ""  # the sender's role token (v5); "" before v5 or when it has none


def unpack_envelope(frame: bytes, max_bytes: int | None = None) -> Envelope:
    if max_bytes is not None and len(frame) > max_bytes:
        raise SchemaError("oversize", f"{len(frame)} bytes > limit {max_bytes}")
    try:
        outer = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise SchemaError("not_msgpack", type(exc).__name__) from None
    if not (isinstance(outer, list) and len(outer) >= 5 and outer[0] == MAGIC):
        raise SchemaError("bad_envelope", "expected [magic, version, type, id, body, "
                          "credential]")
    version = outer[1]
    if not isinstance(version, int) or isinstance(version, bool):
        raise SchemaError("bad_envelope", "envelope field of the wrong type")
    if version > SCHEMA_VERSION:
        raise SchemaError("future_version", f"v{version} > v{SCHEMA_VERSION}")
    if version < MIN_SCHEMA_VERSION:
        raise SchemaError("old_version", f"v{version} < v{MIN_SCHEMA_VERSION}")
    if len(outer) != (6 if version >= CREDENTIAL_SINCE else 5):
        raise SchemaError("bad_envelope", f"a v{version} envelope has "
                          f"{6 if version >= CREDENTIAL_SINCE else 5} fields")
    _, _, type_tag, msg_id, body, *rest = outer
    credential = rest[0] if rest else ""
    if not (isinstance(type_tag, str) and isinstance(msg_id, str) and isinstance(body, bytes)
            and isinstance(credential, str)):
        raise SchemaError("bad_envelope", "envelope field of the wrong type")
    if len(credential) > MAX_CREDENTIAL_CHARS:
        raise SchemaError("bad_envelope", f"credential longer than {MAX_CREDENTIAL_CHARS} "
                          "characters")
    return Envelope(version, type_tag, msg_id, body, credential)


def decode_body(type_tag: str, body: bytes):
    cls = _REGISTRY.get(type_tag)
    if cls is None:
        raise SchemaError("unknown_type", repr(type_tag)[:80])
    try:
        fields = msgpack.unpackb(body, raw=False, ext_hook=_ext_hook, strict_map_key=True)
    except SchemaError:
        raise
    except Exception as exc:
        raise SchemaError("not_msgpack", f"body: {type(exc).__name__}") from None
    try:
        return _build(cls, fields, type_tag)
    except SchemaError:
        raise
    except Exception as exc:  # a validator tripped over a shape it did not expect: still a
        # refusal of this frame, never an exception the receiver has to know about
        raise SchemaError("invalid", f"{type(exc).__name__} while validating",
                          type_tag) from None


def decode(frame: bytes, max_bytes: int | None = None):
    """Frame bytes -> (Envelope, message). Raises SchemaError on anything malformed."""
    env = unpack_envelope(frame, max_bytes)
    return env, decode_body(env.type_tag, env.body)


class _RawArray:
    """An array extension seen while unpacking, validated once its field's dtype is known."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype, shape, data):
        self.dtype, self.shape, self.data = dtype, shape, data


def _ext_hook(code, payload):
    if code != ARRAY_EXT:
        raise SchemaError("wrong_type", f"unknown msgpack extension {code}")
    try:
        dtype, shape, data = msgpack.unpackb(payload, raw=False)
    except Exception:
        raise SchemaError("bad_array", "array payload does not unpack") from None
    return _RawArray(dtype, shape, data)


def _to_array(raw: _RawArray, want_dtype: str, path: str) -> np.ndarray:
    if not (isinstance(raw.dtype, str) and isinstance(raw.shape, list)
            and isinstance(raw.data, bytes)
            and all(isinstance(d, int) and 0 <= d < 2**40 for d in raw.shape)):
        raise SchemaError("bad_array", "expected [dtype:str, shape:list[int], data:bytes]", path)
    if raw.dtype not in _WIRE_DTYPES:
        raise SchemaError("wrong_dtype", f"{raw.dtype!r} is not a wire dtype", path)
    if raw.dtype != want_dtype:
        raise SchemaError("wrong_dtype", f"{raw.dtype} where {want_dtype} is required", path)
    dtype = np.dtype(raw.dtype)
    count = math.prod(raw.shape)  # Python ints: a hostile shape cannot overflow the check
    if count * dtype.itemsize != len(raw.data):
        raise SchemaError("bad_array", f"{len(raw.data)} bytes for shape {raw.shape}", path)
    return np.frombuffer(raw.data, dtype=dtype).reshape(raw.shape)


def _hints(cls) -> dict[str, Any]:
    cached = cls.__dict__.get("_wire_hints")
    if cached is None:
        module = sys.modules[cls.__module__]
        cached = typing.get_type_hints(cls, vars(module))
        cls._wire_hints = cached
    return cached


def _build(cls, fields, path: str):
    if not isinstance(fields, dict):
        raise SchemaError("wrong_type", f"expected a map for {cls.__name__}", path)
    plan, names = _plan(cls)
    if not names.issuperset(fields):
        unknown = set(fields) - names
        raise SchemaError("unknown_field", ", ".join(sorted(map(str, unknown)))[:200], path)
    kwargs = {}
    for name, check, dtype, required in plan:
        if name not in fields:
            if required:
                raise SchemaError("missing_field", name, path)
            continue
        value, sub = fields[name], f"{path}.{name}"
        if dtype is not None:
            if not isinstance(value, _RawArray):
                raise SchemaError("wrong_type", "expected an array", sub)
            kwargs[name] = _to_array(value, dtype, sub)
        else:
            kwargs[name] = check(value, sub)
    msg = cls(**kwargs)
    validate = getattr(msg, "validate", None)
    if validate is not None:
        validate()
    return msg


def _plan(cls) -> tuple[tuple, frozenset]:
    """A message class's fields as (name, checker, array dtype, required), worked out once:
    decoding a frame then walks no type hints."""
    cached = cls.__dict__.get("_wire_plan")
    if cached is None:
        hints, plan = _hints(cls), []
        for f in dataclasses.fields(cls):
            required = f.default is dataclasses.MISSING \
                and f.default_factory is dataclasses.MISSING
            dtype = f.metadata.get("dtype")
            plan.append((f.name, None if dtype else _checker(hints[f.name]), dtype, required))
        cached = cls._wire_plan = (tuple(plan), frozenset(f.name for f in dataclasses.fields(cls)))
    return cached


_CHECKERS: dict = {}  # type hint -> its checker (value, path) -> value


def _checker(hint):
    """The checker of a type hint, made once: ``check(value, path)`` returns the value
    (a message built from its map) or raises SchemaError naming ``path``."""
    check = _CHECKERS.get(hint)
    if check is None:
        check = _CHECKERS[hint] = _make_checker(hint)
    return check


def _make_checker(hint):
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        optional = type(None) in args
        (inner,) = [a for a in args if a is not type(None)]
        inner_check = _checker(inner)

        def check_union(value, path):
            return None if value is None and optional else inner_check(value, path)
        return check_union
    if origin is list:
        return _list_checker(typing.get_args(hint)[0])
    if origin is dict or hint is dict:
        def check_map(value, path):
            if not isinstance(value, dict):
                raise SchemaError("wrong_type", "expected a map", path)
            _check_plain(value, path)
            return value
        return check_map
    if hint is Any:
        def check_any(value, path):
            _check_plain(value, path)
            return value
        return check_any
    if isinstance(hint, type) and hasattr(hint, "TYPE"):
        return lambda value, path: _build(hint, value, path)
    if hint is float:
        def check_float(value, path):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SchemaError("wrong_type", "expected a number", path)
            return float(value)
        return check_float
    if hint is int:
        def check_int(value, path):
            if isinstance(value, bool) or not isinstance(value, int):
                raise SchemaError("wrong_type", "expected an integer", path)
            return value
        return check_int
    if hint in (str, bool, bytes):
        def check_exact(value, path):
            if not isinstance(value, hint):
                raise SchemaError("wrong_type", f"expected {hint.__name__}", path)
            return value
        return check_exact
    raise TypeError(f"unsupported schema type {hint!r}")


# Element types a list of which is taken as it came when every element is exactly that type
# (what msgpack gives): no per-element call or path. bool is not int here, as in check_int.
_EXACT_ELEMENTS = (str, bytes, bool, int, float)


def _list_checker(inner):
    inner_check = _checker(inner)
    exact = inner if inner in _EXACT_ELEMENTS else None

    def check_list(value, path):
        if not isinstance(value, list):
            raise SchemaError("wrong_type", "expected a list", path)
        if exact is not None and all(type(v) is exact for v in value):
            return value
        return [inner_check(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return check_list


_PLAIN_SCALARS = (str, int, float, bool, bytes, type(None))
MAX_PLAIN_DEPTH = 32


def _check_plain(value, path: str, depth: int = 0):
    """JSON-like data only (no arrays) in free-form maps such as ``info``. Checked without
    building a path per element (an env's candidate actions are hundreds of texts a call);
    the path is worked out only for the refusal."""
    if not _is_plain(value, depth):
        _refuse_plain(value, path, depth)


def _is_plain(value, depth: int) -> bool:
    if depth > MAX_PLAIN_DEPTH:
        return False
    if isinstance(value, _PLAIN_SCALARS):
        return True
    inner_scalars_ok = depth < MAX_PLAIN_DEPTH
    if isinstance(value, list):
        return all((inner_scalars_ok and isinstance(v, _PLAIN_SCALARS)) or _is_plain(v, depth + 1)
                   for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and ((inner_scalars_ok and isinstance(v, _PLAIN_SCALARS))
                                           or _is_plain(v, depth + 1))
                   for k, v in value.items())
    return False


def _refuse_plain(value, path: str, depth: int = 0):
    """Raise the SchemaError naming where ``value`` stops being JSON-like."""
    if depth > MAX_PLAIN_DEPTH:
        raise SchemaError("invalid", "nesting deeper than 32", path)
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise SchemaError("wrong_type", "map keys must be strings", path)
            _refuse_plain(v, f"{path}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _refuse_plain(v, f"{path}[{i}]", depth + 1)
    elif not isinstance(value, _PLAIN_SCALARS):
        raise SchemaError("wrong_type", "free-form data must be JSON-like", path)
