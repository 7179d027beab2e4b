"""The tokens a request reserves against its key's token limits at admission (pure): the most it
can spend, so one request with many prompts and a large n, or many requests at once, cannot spend
a `tpm` or `token_budget` many times over before their usage is recorded (issue 24).

A request may spend, per prompt, its prompt tokens plus n times its output, which is at most
`max_tokens` and at most what the context leaves. Text prompts are not tokenized here (the
gateway has no tokenizer): they are estimated at one token per BYTES_PER_TOKEN bytes, OpenAI's
rule of thumb; the record settles the reservation to the real usage afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

BYTES_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
"""What a chat template adds around each message (role tags), about."""
MAX_OUTPUT_UNKNOWN = 16
"""Output tokens per sequence when neither max_tokens nor the model's context is known (no
engine of the model has reported; vLLM's default max_tokens for completions)."""


def text_tokens(text: str) -> int:
    """The estimated tokens of a text (rounded up)."""
    return -(-len(text.encode()) // BYTES_PER_TOKEN)


def prompt_tokens(prompt: str | Sequence[int]) -> int:
    """A prompt's tokens: exact for token ids, estimated for text."""
    return text_tokens(prompt) if isinstance(prompt, str) else len(prompt)


def chat_tokens(texts: Sequence[str], template_tokens: int = 0) -> int:
    """A chat's estimated prompt tokens: its messages' texts (tool definitions among them), the
    tags around each, and what the model's template adds to any chat (its engines report it:
    `EngineLoad.chat_template_tokens`, SmolLM2's default system prompt for one)."""
    return template_tokens + sum(text_tokens(t) + TOKENS_PER_MESSAGE for t in texts)


def reservation(prompts: Sequence[int], n: int, max_tokens: int | None,
                max_model_len: int | None) -> int:
    """Tokens to reserve for prompts of these (estimated) sizes, each sampled n times with at
    most `max_tokens` output (None: up to the context)."""
    total = 0
    for prompt in prompts:
        room = None if max_model_len is None else max(max_model_len - prompt, 0)
        caps = [x for x in (max_tokens, room) if x is not None]
        total += prompt + n * (min(caps) if caps else MAX_OUTPUT_UNKNOWN)
    return total
