"""What serves a model: our engine (`shoal`), vLLM's OpenAI server (`vllm`), or any
OpenAI-compatible server command (`custom`), with the raw flags passed through to it.

Pure: the checks a deploy makes on a backend's settings (a 400 naming the field) and the
reading of flags (`--name value`, `--name=value`, `-tp 2`) that the worker's argument building
(services/backends/args.py) shares, so both read a flag the same way.
"""

from __future__ import annotations

import re
import shlex
from enum import Enum
from typing import Annotated

from pydantic import AfterValidator, Field

from shoal.shared.schemas.common import Wire
from shoal.shared.schemas.infer import REASONING_PARSERS, TOOL_CALL_PARSERS


class BackendKind(str, Enum):
    SHOAL = "shoal"
    VLLM = "vllm"
    CUSTOM = "custom"


RESERVED_FLAGS: dict[str, str] = {
    "tensor-parallel-size": "tp", "tp": "tp", "pipeline-parallel-size": "pp", "pp": "pp",
    "data-parallel-size": "replicas", "dp": "replicas", "port": "the worker (a free port)",
    "host": "the worker", "served-model-name": "the model's name and aliases",
    "model": "source", "gpu-memory-utilization": "gpu_memory_utilization",
    "max-model-len": "max_model_len", "dtype": "dtype",
    "distributed-executor-backend": "the placement (Ray across workers)",
}
"""vLLM flags Shoal computes itself -> the ModelSpec field (or what) sets them instead."""

PLACEHOLDERS = ("model_path", "port", "served_name", "host", "model_name", "data_dir")
"""What a custom backend_command may name in braces, e.g. `--port {port}`."""

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ExtendedKVCache(Wire):
    """The KV cache past GPU memory (LMCache in CPU RAM), as GPUStack's extended_kv_cache."""

    chunk_size: int | None = Field(default=None, ge=1)
    """Tokens per LMCache chunk (LMCACHE_CHUNK_SIZE; unset: LMCache's own)."""
    ram_size_gib: float | None = Field(default=None, gt=0)
    """CPU RAM for the cache in GiB (LMCACHE_MAX_LOCAL_CPU_SIZE)."""
    ram_ratio: float | None = Field(default=None, gt=0)
    """Or that many times the instance's GPU memory claim."""


def flatten_parameters(parameters: list[str]) -> list[str]:
    """Each entry may hold several whitespace-separated tokens ("--max-num-seqs 8"); `--a = b`
    spellings are joined to `--a=b`, as users type them in a form. A flag followed by a JSON
    object or list (`--speculative-config {"method": "ngram"}`) keeps that value whole: split
    as shell words it would lose its quotes."""
    tokens: list[str] = []
    for raw in parameters:
        text = raw.strip()
        key, _, value = text.partition("=")
        flag, _, rest = text.partition(" ")
        if text.startswith("-") and value and " " not in key.strip():
            tokens.append(f"{key.strip()}={value.strip()}")  # the value may hold spaces (JSON)
        elif text.startswith("-") and rest.strip()[:1] in ("{", "["):
            tokens += [flag, rest.strip()]
        else:
            tokens += shlex.split(text)
    return tokens


def flag_name(token: str) -> str | None:
    """`--max-model-len=8` -> "max-model-len"; `-tp` -> "tp"; a value -> None. Underscores
    read as dashes (vLLM accepts both)."""
    if not token.startswith("-") or token in ("-", "--") or _is_number(token):
        return None
    return token.lstrip("-").split("=", 1)[0].replace("_", "-")


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def find_flag(tokens: list[str], *names: str) -> str | bool | None:
    """The value of the first of `names` in `tokens`: its value, True for a bare flag (a
    boolean), None when absent."""
    for i, token in enumerate(tokens):
        name = flag_name(token)
        if name is None or name not in names:
            continue
        if "=" in token:
            return token.split("=", 1)[1]
        following = tokens[i + 1] if i + 1 < len(tokens) else None
        return following if following is not None and flag_name(following) is None else True
    return None


def reserved_flag(parameters: list[str]) -> tuple[str, str] | None:
    """The first flag of `parameters` that Shoal computes itself, with what sets it instead."""
    for token in flatten_parameters(parameters):
        name = flag_name(token)
        if name in RESERVED_FLAGS:
            return name, RESERVED_FLAGS[name]
    return None


def tool_call_parser_of(parameters: list[str]) -> str | None:
    """vLLM's `--tool-call-parser NAME` among the flags: the gateway parses "auto" tool choice
    answers of every backend with it (the adapter renders the chat template and sends vLLM
    token ids, so vLLM's own parser never sees a chat)."""
    value = find_flag(flatten_parameters(parameters), "tool-call-parser")
    return value if isinstance(value, str) else None


def reasoning_parser_of(parameters: list[str]) -> str | None:
    """vLLM's `--reasoning-parser NAME` among the flags: the gateway splits every backend's chat
    reasoning with it (vLLM's own parser never sees a chat, as for tool calls)."""
    value = find_flag(flatten_parameters(parameters), "reasoning-parser")
    return value if isinstance(value, str) else None


def check_parameters(parameters: list[str]) -> list[str]:
    """A deploy's backend_parameters: they parse (quotes balance), set no flag of Shoal's, and
    name a tool-call parser only if the gateway has it."""
    try:
        flatten_parameters(parameters)
    except ValueError as exc:
        raise ValueError(f"cannot split {parameters!r}: {exc}") from None
    found = reserved_flag(parameters)
    if found is not None:
        name, instead = found
        raise ValueError(f"--{name} is computed by Shoal (from {instead}); it cannot be given "
                         f"in backend_parameters")
    parser = tool_call_parser_of(parameters)
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser {parser}: Shoal parses tool calls itself for every "
                         f"backend, with one of {', '.join(TOOL_CALL_PARSERS)}")
    reasoning = reasoning_parser_of(parameters)
    if reasoning is not None and reasoning not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {reasoning}: Shoal splits reasoning itself for "
                         f"every backend, with one of {', '.join(REASONING_PARSERS)}")
    return parameters


def check_env(env: dict[str, str]) -> dict[str, str]:
    bad = [k for k in env if not ENV_NAME.match(k)]
    if bad:
        raise ValueError(f"{bad[0]!r} is not an environment variable name")
    return env


def check_command(command: str) -> str:
    """A custom backend's command: it splits, names only known placeholders, and says where it
    listens ({port}: the worker picks a free port for each instance)."""
    try:
        shlex.split(command)
    except ValueError as exc:
        raise ValueError(f"cannot split the command: {exc}") from None
    names = re.findall(r"\{([^{}]*)\}", command)
    unknown = [n for n in names if n not in PLACEHOLDERS]
    if unknown:
        raise ValueError(f"unknown placeholder {{{unknown[0]}}}; known: "
                         + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS))
    if "port" not in names:
        raise ValueError("the command must listen on {port} (the worker picks a free port)")
    return command


BackendParameters = Annotated[list[str], Field(max_length=256), AfterValidator(check_parameters)]
BackendEnv = Annotated[dict[str, str], AfterValidator(check_env)]
BackendCommand = Annotated[str, Field(min_length=1, max_length=4096),
                           AfterValidator(check_command)]
BackendVersion = Annotated[str, Field(max_length=64, pattern=r"^[0-9A-Za-z][0-9A-Za-z.+!_-]*$")]
HealthPath = Annotated[str, Field(pattern=r"^/")]
"""The backend fields with their checks, one definition for a create and an update (PATCH)."""
