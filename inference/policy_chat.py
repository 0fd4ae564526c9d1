"""The policy itself as a chat model, through its inference backend.

Lets the explorer and the task proposer use the model being trained when no external LLM is
configured. Messages are flattened to plain text ("system: ...", "user: ...", "assistant:");
a small word-level model will mostly answer nonsense, which the callers detect and count.
"""

from __future__ import annotations

from inference.backends.base import InferenceBackend, SamplingParams
from inference.llm import ChatModel, ReplyFormat


class PolicyChat(ChatModel):
    def __init__(self, backend: InferenceBackend, max_context: int = 512,
                 max_new_tokens: int = 48, seed: int = 0):
        super().__init__()
        self.backend = backend
        self.max_context, self.max_new_tokens = max_context, max_new_tokens
        self.seed = seed
        self.name = "policy"

    def close(self) -> None:
        self.backend.close()

    def complete(self, messages: list[dict], temperature: float = 0.7,
                 max_tokens: int = 512, reply_format: ReplyFormat | None = None) -> str:
        self._count("requests")
        tokenizer = self.backend.tokenizer
        text = "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages)
        new = min(max_tokens, self.max_new_tokens)
        ids = tokenizer.encode(text + "\nassistant:", add_special_tokens=False)
        ids = ids[-(self.max_context - new):] or [tokenizer.bos_token_id or 0]
        self.seed += 1
        params = SamplingParams(temperature=temperature, max_new_tokens=new, seed=self.seed)
        out = self.backend.generate([ids], params)[0]
        return tokenizer.decode(out.token_ids, skip_special_tokens=True)
