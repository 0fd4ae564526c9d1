"""A tiny policy made locally from a config: the single-machine default, no hub access.

The tokenizer is word-level over a given word list, so every environment word is one token
and action strings tokenize identically in any context. The model is a random-init Llama-style
decoder (GQA, RoPE, SwiGLU, RMSNorm, tied embeddings), saved with ``save_pretrained`` so that
``AutoTokenizer``/``AutoModelForCausalLM.from_pretrained(path)`` load it offline like any
other checkpoint, and vLLM can serve it.

Why not Qwen2: transformers 5 hard-wires ``model_type: qwen2`` checkpoints to ``Qwen2Tokenizer``
(a byte-level BPE rebuilt from the vocabulary), ignoring the saved ``tokenizer.json``, so a
word-level tokenizer next to a Qwen2 config loads as a tokenizer that encodes nothing. A Llama
config keeps ``AutoTokenizer`` on the saved tokenizer in transformers 4 and 5 alike.

Command line::

    python -m inference.tiny_model PATH --words-file WORDS.txt [--special <exp> </exp>]
    python -m inference.tiny_model PATH            # print the parameter count of an existing one
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[BOS]", "[EOS]")
FINGERPRINT_FILE = "autodidact_tiny_model.json"
_FORMAT = 2  # bump when the way the model is built changes, so old folders are rebuilt


def make_tiny_model(
    path: str | os.PathLike,
    words: Sequence[str],
    special_words: Sequence[str] = (),
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    max_positions: int = 1024,
    seed: int = 0,
) -> Path:
    """Create (or reuse) a tiny word-level causal LM at ``path`` and return the path.

    Vocabulary: ``[PAD] [UNK] [BOS] [EOS]``, then ``special_words`` (markers such as the
    experience delimiters; matched anywhere in text and dropped by
    ``decode(skip_special_tokens=True)``), then ``words`` in order, duplicates dropped.
    No BOS is added automatically; prompt builders add ``[BOS]`` if they want it.

    Idempotent: a folder already built from the same words and config is reused untouched
    (compared through a json fingerprint). A folder with a different fingerprint is rebuilt;
    a non-empty folder without one is refused rather than overwritten. The build happens in a
    temporary sibling folder that is renamed into place, so concurrent callers never see a
    half-written model.
    """
    path = Path(path)
    vocab = _vocabulary(words, special_words)
    fingerprint = {
        "format": _FORMAT,
        "vocab": vocab,
        "special_words": list(special_words),
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "intermediate": intermediate,
        "max_positions": max_positions,
        "seed": seed,
    }
    if _read_fingerprint(path) == fingerprint:
        return path
    if path.exists() and any(path.iterdir()) and _read_fingerprint(path) is None:
        raise FileExistsError(f"{path} is not empty and was not made by make_tiny_model")

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _build(staging, vocab, len(SPECIAL_TOKENS) + len(special_words), fingerprint)
        _install(staging, path, fingerprint)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _vocabulary(words: Sequence[str], special_words: Sequence[str]) -> list[str]:
    """Specials, markers, then words; every entry must be one whitespace-free token."""
    vocab: list[str] = []
    for token in (*SPECIAL_TOKENS, *special_words, *words):
        if not token or any(ch.isspace() for ch in token):
            raise ValueError(
                f"vocabulary entries must be non-empty and contain no whitespace: {token!r}"
            )
        if token not in vocab:
            vocab.append(token)
    return vocab


def _build(folder: Path, vocab: list[str], n_special: int, fingerprint: dict) -> None:
    """Write tokenizer, model and fingerprint into ``folder``."""
    tokenizer = _make_tokenizer(vocab, n_special)
    tokenizer.save_pretrained(str(folder))
    model = _make_model(tokenizer, fingerprint)
    model.save_pretrained(str(folder))
    (folder / FINGERPRINT_FILE).write_text(json.dumps(fingerprint, indent=1))


def _make_tokenizer(vocab: list[str], n_special: int):
    """Word-level tokenizer: whitespace split, one id per word, unknown words -> [UNK]."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Specials and markers are "added tokens": matched even without surrounding spaces and
    # skippable on decode. Without a decoder, decode joins tokens with single spaces.
    core.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in vocab[:n_special]]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        # The default clean-up glues punctuation to the previous word; words must round-trip.
        clean_up_tokenization_spaces=False,
    )


def _make_model(tokenizer, fp: dict):
    """A random-init Llama-style decoder whose vocabulary is exactly the tokenizer's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=fp["hidden"],
        num_hidden_layers=fp["layers"],
        num_attention_heads=fp["heads"],
        num_key_value_heads=fp["kv_heads"],
        intermediate_size=fp["intermediate"],
        max_position_embeddings=fp["max_positions"],
        tie_word_embeddings=True,  # as in the small Qwen2.5 models; saves parameters here
        attention_bias=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # A private RNG stream: the same seed gives the same weights, and callers' RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(fp["seed"])
        model = LlamaForCausalLM(config)
    return model.eval()


def _install(staging: Path, path: Path, fingerprint: dict) -> None:
    """Move the finished build into place; if another process won the race, keep theirs."""
    if path.exists():
        if _read_fingerprint(path) == fingerprint:
            return
        shutil.rmtree(path)  # ours, with an outdated fingerprint (checked by the caller)
    try:
        os.rename(staging, path)
    except OSError:
        if _read_fingerprint(path) != fingerprint:
            raise


def _read_fingerprint(path: Path) -> dict | None:
    try:
        return json.loads((path / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return None


# ChatML, as Qwen2.5-Instruct renders it, tool role included.
CHATML_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}"
    "\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def make_tiny_chat_model(path: str | os.PathLike, corpus: Sequence[str], vocab_size: int = 2000,
                         hidden: int = 64, layers: int = 2, max_positions: int = 4096,
                         seed: int = 0) -> Path:
    """A random-init model with a byte-level BPE tokenizer (trained on ``corpus``) and a ChatML
    chat template: the shape of a real instruction-tuned checkpoint, for exercising the
    chat-template rollout path without hub access. Rebuilt on every call."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHAT_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"],
                                        clean_up_tokenization_spaces=False)
    tokenizer.chat_template = CHATML_TEMPLATE
    fingerprint = {"hidden": hidden, "layers": layers, "heads": 4, "kv_heads": 2,
                   "intermediate": 2 * hidden, "max_positions": max_positions, "seed": seed}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    _make_model(tokenizer, fingerprint).save_pretrained(str(path))
    return path


def parameter_count(path: str | os.PathLike) -> int:
    """Number of distinct parameters (tied embeddings counted once) of the model at ``path``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


def describe(path: str | os.PathLike) -> str:
    """One line for logs and the command line: path, vocabulary size, parameter count."""
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(path)))
    return f"{path}: vocab {vocab}, {parameter_count(path):,} parameters"


def main(argv: Sequence[str] | None = None) -> None:
    """Make a tiny model from a word file (one or more words per line) and print its size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--words-file", help="whitespace-separated words; omit to only describe")
    parser.add_argument("--special", nargs="*", default=[], help="marker tokens")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.words_file:
        words = Path(args.words_file).read_text().split()
        make_tiny_model(
            args.path, words, args.special, hidden=args.hidden, layers=args.layers, seed=args.seed
        )
    print(describe(args.path))


if __name__ == "__main__":
    main()
