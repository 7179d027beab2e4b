"""vLLM's `qwen3` reasoning parser (Qwen3): reasoning only between the model's own <think> and
</think>; an answer without <think> (`chat_template_kwargs: {"enable_thinking": false}`, whose
template writes an empty think block into the prompt) is all content."""

from __future__ import annotations

from shoal.services.gateway.parsers.reasoning.think import State, ThinkParser


class Qwen3Reasoning(ThinkParser):
    first: State = "before"
