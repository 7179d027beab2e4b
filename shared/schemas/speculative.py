"""SpeculativeConfig: vLLM's `speculative_config` (a JSON object), checked once for the wire (a
deploy's engine_args), `shoal serve --speculative-config` and the engine's EngineConfig alike.

Methods: "ngram" (prompt lookup: the continuation of the latest earlier occurrence of the last
n tokens), "draft_model" (a second model folder or GGUF sharing the target's tokenizer) and
"layer_skip" (the target's first `num_draft_layers` layers and its LM head as the draft, a
self-speculative method needing no second checkpoint). Every proposer drafts greedily, so the
draft distribution is a point mass and the verification (rejection sampling) stays exact.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.common import Wire

SPEC_METHODS = ("ngram", "draft_model", "layer_skip")

NGRAM_DEFAULT_WINDOW = 5
"""vLLM's prompt_lookup_min / _max when neither is given."""


class SpeculativeConfig(Wire):
    method: Literal["ngram", "draft_model", "layer_skip"] | None = None
    """"ngram", "draft_model" (needs `model`) or "layer_skip" (needs `num_draft_layers`);
    default: "draft_model" when `model` is given."""
    num_speculative_tokens: int = Field(ge=1, le=32)
    """Tokens proposed per step and verified in one target forward."""
    prompt_lookup_min: int | None = Field(default=None, ge=1)
    """ngram: the shortest suffix looked up (default: prompt_lookup_max, or 5)."""
    prompt_lookup_max: int | None = Field(default=None, ge=1)
    """ngram: the longest suffix looked up (default: prompt_lookup_min, or 5)."""
    model: str | None = Field(default=None, min_length=1)
    """draft_model: a Hugging Face folder or .gguf file with the target's tokenizer."""
    num_draft_layers: int | None = Field(default=None, ge=1)
    """layer_skip: how many of the target's first layers form the draft."""
    disable_by_batch_size: int | None = Field(default=None, ge=1)
    """No speculation in a step with at least this many running sequences (it costs
    throughput at large batch). None: never switched off."""

    @model_validator(mode="after")
    def _complete(self) -> SpeculativeConfig:
        if self.method is None:
            if self.model is None:
                raise ValueError("speculative_config needs a method (ngram, draft_model, "
                                 "layer_skip) or a draft model")
            self.method = "draft_model"
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo = lo if lo is not None else (hi if hi is not None else NGRAM_DEFAULT_WINDOW)
            hi = hi if hi is not None else lo
            if lo > hi:
                raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if self.method == "draft_model" and self.model is None:
            raise ValueError("method draft_model needs `model` (a folder or .gguf)")
        if self.method == "layer_skip" and self.num_draft_layers is None:
            raise ValueError("method layer_skip needs `num_draft_layers`")
        return self


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """A dict (or JSON text, or a SpeculativeConfig) -> SpeculativeConfig; InvalidRequest naming
    `speculative_config` for anything else."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    try:
        if isinstance(value, str | bytes):
            return SpeculativeConfig.model_validate_json(value)
        if isinstance(value, dict):
            return SpeculativeConfig.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"speculative_config{'.' + where if where else ''}: {first['msg']}",
                             param="speculative_config") from None
    raise InvalidRequest("speculative_config must be a JSON object", param="speculative_config")
