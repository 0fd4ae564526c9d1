"""Think, then act (``actor.think``): a free-text thought before each call.

A reply is ``<think>thought</think>call``: the tags of the reasoning models that have them
(Qwen3, DeepSeek-R1: added tokens), spelled as plain text by the others. The env is given the
call alone; the step keeps the thought (``Step.thought``) for the step judge and the experience
extractor to read. The thought's tokens are trained with the call (``actor.think_trained``) or
kept as context only (masked). Constrained decoding opens the thought, lets it run free of tags
for at most ``actor.think_tokens`` tokens, closes it, and then holds the call to the env's
candidates or grammar (``inference.backends.constraint.ThinkThen``).
"""

from __future__ import annotations

from inference.codecs import THINK_TAGS

THINK_OPEN, THINK_CLOSE = THINK_TAGS
THINK_INSTRUCTION = (f"Before each call, think briefly inside {THINK_OPEN}{THINK_CLOSE} "
                     f"(what you know, what the call should do), then write the call after "
                     f"{THINK_CLOSE}.")


def split_thought(reply: str) -> tuple[str, str]:
    """(thought, call) of a reply: the text inside the last ``<think>...</think>`` and what
    follows it; a reply without the closing tag is all call, no thought."""
    head, closed, call = reply.rpartition(THINK_CLOSE)
    if not closed:
        return "", reply.strip()
    thought = head.split(THINK_OPEN, 1)[1] if THINK_OPEN in head else head
    return thought.strip(), call.strip()


def thought_tokens(decode, ids: list[int]) -> int:
    """How many of a reply's ``ids`` (with ``decode`` their text) make its thought, closing
    tag included: the shortest prefix whose text holds ``</think>``; 0 without one."""
    if THINK_CLOSE not in decode(ids):
        return 0
    for n in range(1, len(ids) + 1):
        if THINK_CLOSE in decode(ids[:n]):
            return n
    return 0
