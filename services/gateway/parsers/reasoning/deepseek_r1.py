"""vLLM's `deepseek_r1` reasoning parser (DeepSeek-R1 and its distills, QwQ): the answer starts
thinking, whether or not the model writes <think> (R1's newer templates put it in the prompt):
everything before </think> is reasoning, and an answer without </think> is all reasoning."""

from __future__ import annotations

from shoal.services.gateway.parsers.reasoning.think import State, ThinkParser


class DeepSeekR1Reasoning(ThinkParser):
    first: State = "thinking"
