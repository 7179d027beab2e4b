"""SamplingParams: how one request is sampled and when it stops, validated before queueing.

The names and meanings are vLLM's, so users transfer. `validate()` runs in `__post_init__`:
an invalid value raises InvalidRequest (HTTP 400 at the gateway) before anything is queued.
`StructuredOutputsParams` (vLLM's name) constrains the output; the engine checks that its schema,
regex or grammar parses (structured_output/compiler.py) and compiles it before the request is
scheduled.
"""

from __future__ import annotations

import dataclasses
import json as jsonlib
import math
from dataclasses import dataclass, field
from typing import Any

from shoal.shared.errors import InvalidRequest

MAX_LOGPROBS = 20
"""The most alternatives per token we return (OpenAI's top_logprobs limit is 20)."""


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one constraint on the output text (vLLM's StructuredOutputsParams)."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (object, or its JSON text): the output is a JSON value it validates."""
    regex: str | None = None
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (GBNF style, rule `root`), as xgrammar reads it."""
    json_object: bool | None = None
    """Any JSON object (OpenAI's response_format json_object)."""
    disable_any_whitespace: bool = False
    """JSON without free whitespace between tokens (small models can loop on whitespace)."""

    def __post_init__(self) -> None:
        if isinstance(self.choice, (list, tuple)):
            object.__setattr__(self, "choice", list(self.choice))
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint is set: one of STRUCTURED_KINDS."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def json_text(self) -> str:
        """The schema as JSON text, property order kept (it is the order of generation)."""
        schema = jsonlib.loads(self.json) if isinstance(self.json, str) else self.json
        return jsonlib.dumps(schema, ensure_ascii=False, separators=(",", ":"))

    @property
    def key(self) -> tuple[str, str, bool]:
        """The compiled-grammar cache key: equal keys compile to the same grammar."""
        kind = self.kind
        text = {"json": self.json_text if kind == "json" else "", "regex": self.regex or "",
                "choice": jsonlib.dumps(self.choice), "grammar": self.grammar or "",
                "json_object": ""}[kind]
        return kind, text, self.disable_any_whitespace

    def validate(self) -> None:
        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        _check(len(set_kinds) == 1, "structured_outputs",
               f"must set exactly one of {', '.join(STRUCTURED_KINDS)}, got "
               f"{', '.join(set_kinds) or 'none'}")
        _check(isinstance(self.disable_any_whitespace, bool),
               "structured_outputs.disable_any_whitespace", "must be a boolean")
        kind = set_kinds[0]
        value = getattr(self, kind)
        param = f"structured_outputs.{kind}"
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = jsonlib.loads(value)
                except ValueError as exc:
                    raise InvalidRequest(f"{param} is not valid JSON: {exc}", param=param) from None
            _check(isinstance(value, (dict, bool)), param, "must be a JSON schema (an object)")
        elif kind == "choice":
            _check(isinstance(value, list) and len(value) > 0
                   and all(isinstance(c, str) and c for c in value), param,
                   "must be a non-empty list of non-empty strings")
        elif kind == "json_object":
            _check(value is True, param, "must be true")
        else:
            _check(isinstance(value, str) and bool(value), param, "must be a non-empty string")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 = no top-k."""
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    """Per request: the same seed gives the same tokens whatever else is in the batch."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: never split across streamed chunks, not included in the text."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    """None = up to the model's context length."""
    min_tokens: int = 0
    logprobs: int | None = None
    """Top-N alternatives per sampled token (0 = only the sampled token's logprob)."""
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output (guided decoding); None = free text."""
    logit_bias: dict[int, float] | None = None
    """OpenAI's logit_bias: token id -> bias in [-100, 100], added to the logits before sampling
    (after penalties; logprobs stay the raw ones). The engine checks the ids against its
    vocabulary."""
    compiled_grammar: Any = field(default=None, init=False, repr=False, compare=False)
    """Set by the engine (never by users, never on the wire): the compiled form of
    structured_outputs, from which the sampler makes each sequence's matcher."""

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):  # from the wire: SamplingOptions dumped
            try:
                spec = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise InvalidRequest(f"structured_outputs: {exc}",
                                     param="structured_outputs") from None
            object.__setattr__(self, "structured_outputs", spec)
        if isinstance(self.stop, str):  # accept stop="x" as vLLM and OpenAI do
            object.__setattr__(self, "stop", [self.stop])
        else:
            object.__setattr__(self, "stop", list(self.stop))
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", _token_bias(self.logit_bias) or None)
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def with_compiled_grammar(self, grammar: Any) -> SamplingParams:
        """A copy carrying the compiled grammar (the engine calls this at admission)."""
        params = dataclasses.replace(self)
        object.__setattr__(params, "compiled_grammar", grammar)
        return params

    def validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n",
               f"must be an integer >= 1, got {self.n!r}")
        _check(self.n <= 128, "n", f"must be <= 128, got {self.n}")
        _check(_is_number(self.temperature) and self.temperature >= 0.0, "temperature",
               f"must be >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
               f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p",
               f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0, name,
                   f"must be in [-2, 2], got {value!r}")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0.0,
               "repetition_penalty", f"must be a finite number > 0, got "
               f"{self.repetition_penalty!r}")
        _check(self.seed is None or isinstance(self.seed, int), "seed",
               f"must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings")
        _check(len(self.stop) <= 16, "stop", f"at most 16 stop strings, got {len(self.stop)}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")
        _check(self.max_tokens is None
               or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"must be <= max_tokens ({self.min_tokens} > {self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS), name,
                   f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        _check(self.logit_bias is None or isinstance(self.logit_bias, dict), "logit_bias",
               "must map token ids to biases in [-100, 100]")
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "must be a StructuredOutputsParams or a dict of its fields")


def _token_bias(bias: dict[Any, Any]) -> dict[int, float]:
    """{token id (int, or its decimal string as JSON keys are): bias} checked: ids >= 0, biases
    numbers in [-100, 100] (OpenAI's range)."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else (
            int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else -1)
        _check(token >= 0, "logit_bias", f"keys must be token ids, got {str(key)[:40]!r}")
        _check(_is_number(value) and -100 <= value <= 100, "logit_bias",
               f"values must be numbers in [-100, 100], got {value!r}")
        out[token] = float(value)
    return out


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool): infinity and NaN are no sampling parameter."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(f"{param} {message}", param=param)
