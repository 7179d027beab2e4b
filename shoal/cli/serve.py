"""`shoal serve MODEL`: the whole stack plus one model, with `vllm serve`'s flags.

vLLM's spellings are accepted for what Shoal does (they become the model's ModelSpec fields and
engine_args, checked by the same rules as a deploy); vLLM flags Shoal does not implement are
refused by name, never silently ignored.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shoal.shared.errors import InvalidRequest, NotFound
from shoal.shared.hf_hub import hub_config_folder, is_hub_id
from shoal.shared.schemas.registry import DeviceKind, ModelCreate
from shoal.shared.schemas.infer import REASONING_PARSERS, TOOL_CALL_PARSERS

DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
          "float": "float32", "float32": "float32"}
"""vLLM's --dtype spellings -> Shoal's."""


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("model", help="a Hugging Face id (org/name; the Hugging Face cache first), "
                                     "a Hugging Face folder or a .gguf file")
    serve.add_argument("--served-model-name", nargs="+", metavar="NAME",
                       help="the names clients use (default: from MODEL); answers carry the "
                            "first, the others are its aliases")
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default 8000)")
    serve.add_argument("--api-key", help="clients must send `Authorization: Bearer KEY` (or a key "
                                         "made with `shoal keys create`)")
    serve.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    serve.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    serve.add_argument("--tensor-parallel-size", "-tp", type=int, dest="tp")
    serve.add_argument("--pipeline-parallel-size", "-pp", type=int, dest="pp")
    serve.add_argument("--gpu-memory-utilization", type=float)
    serve.add_argument("--max-num-seqs", type=int)
    serve.add_argument("--max-num-batched-tokens", type=int)
    serve.add_argument("--block-size", type=int)
    serve.add_argument("--kv-cache-memory-bytes", type=int, help="bytes of the KV-cache pool")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    serve.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    serve.add_argument("--enforce-eager", action="store_true", default=None)
    serve.add_argument("--seed", type=int)
    serve.add_argument("--chat-template", help="a Jinja chat template: a file, or the template")
    serve.add_argument("--generation-config", default="vllm",
                       help="only 'vllm': sampling defaults are the request's (OpenAI's)")
    serve.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                       help='parse tool calls of tool_choice "auto" answers')
    serve.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                       help="split chat answers' <think> reasoning into reasoning_content")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='vLLM\'s switch for tool_choice "auto": taken with --tool-call-parser '
                            "(which alone already enables it), refused without one")
    add_data_dir_argument(serve)
    serve.add_argument("--quantization", "-q",
                       help="CPU weights: int8, int4 (groups of 32), gguf (a .gguf model's own "
                            "blocks: its default) or none (the checkpoint's dtype, a .gguf "
                            "dequantised to fp32); README: which is faster when")
    serve.add_argument("--load-format", choices=("auto", "safetensors", "dummy"),
                       help="dummy: random weights of the model's config.json (no weight files "
                            "read; benchmarks)")
    serve.add_argument("--speculative-config",
                       help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\'')
    serve.add_argument("--enable-lora", action="store_true", default=None,
                       help="serve LoRA adapters over the model (requests name one as `model`)")
    serve.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                       help="adapters to serve: name=path, or vLLM's JSON form "
                            '\'{"name": ..., "path": ..., "base_model_name": ...}\'')
    serve.add_argument("--max-loras", type=int, help="distinct adapters in one step (default 1)")
    serve.add_argument("--max-lora-rank", type=int, help="largest adapter rank (default 16)")
    serve.add_argument("--max-cpu-loras", type=int,
                       help="adapters kept in host memory (default --max-loras)")
    serve.add_argument("--otlp-traces-endpoint",
                       help="send traces there over OTLP (gRPC unless OTEL_EXPORTER_OTLP_PROTOCOL "
                            "says http/protobuf)")


def add_data_dir_argument(command: argparse.ArgumentParser) -> None:
    """`shoal serve MODEL --data-dir DIR`: the top-level --data-dir, also after the command
    (where vLLM users put flags); unset there, the top-level one stands."""
    command.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS,
                         help="where the stack keeps its files (default ~/.shoal)")


def refuse_unknown(extra: list[str]) -> None:
    """vLLM flags (or typos) that `shoal serve` does not take: one clear error naming them."""
    flags = sorted({a.split("=", 1)[0] for a in extra if a.startswith("-")})
    if flags:
        raise InvalidRequest(f"shoal serve does not support {', '.join(flags)} (see `shoal serve "
                             "--help` for the vLLM flags it takes)")
    if extra:
        raise InvalidRequest(f"unexpected arguments: {' '.join(extra)}")


def model_spec(args: argparse.Namespace) -> ModelCreate:
    """The model to deploy, from MODEL and the flags; refuses what Shoal cannot do."""
    if args.generation_config != "vllm":
        raise InvalidRequest("--generation-config: Shoal takes sampling defaults from the request "
                             "(vLLM's `--generation-config vllm`); a model's "
                             "generation_config.json is not applied", param="generation_config")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise InvalidRequest("--enable-auto-tool-choice requires --tool-call-parser (vLLM's "
                             "rule; Shoal's parsers: " + ", ".join(TOOL_CALL_PARSERS) + ")",
                             param="tool_call_parser")
    source, default_name = resolve_source(args.model)
    engine_args = {"max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "block_size": args.block_size, "kv_cache_memory": args.kv_cache_memory_bytes,
                   "enable_prefix_caching": args.enable_prefix_caching,
                   "enable_chunked_prefill": args.enable_chunked_prefill,
                   "enforce_eager": args.enforce_eager, "seed": args.seed,
                   "tool_call_parser": args.tool_call_parser, "quantization": args.quantization,
                   "load_format": args.load_format,
                   "reasoning_parser": args.reasoning_parser,
                   "chat_template": chat_template(args.chat_template),
                   "speculative_config": speculative_config(args.speculative_config),
                   "enable_lora": args.enable_lora, "max_loras": args.max_loras,
                   "max_lora_rank": args.max_lora_rank, "max_cpu_loras": args.max_cpu_loras}
    name, *aliases = args.served_model_name or [default_name]
    spec = {"name": name, "aliases": aliases or None, "source": source,
            "device": DeviceKind.AUTO if (args.tp or args.pp) else DeviceKind.CPU,
            "tp": args.tp, "pp": args.pp, "max_model_len": args.max_model_len,
            "dtype": DTYPES[args.dtype], "gpu_memory_utilization": args.gpu_memory_utilization,
            "engine_args": {k: v for k, v in engine_args.items() if v is not None},
            "lora_modules": lora_modules(args.lora_modules)}
    return ModelCreate(**{k: v for k, v in spec.items() if v is not None})


def resolve_source(model: str) -> tuple[str, str]:
    """(the source to deploy, the default served name). A path that exists is served from
    there; a Hugging Face id must be in the cache or the hub must answer (checked here, so an
    offline machine hears it at once instead of a PENDING instance)."""
    path = Path(model).expanduser()
    if path.exists():
        return str(path.resolve()), path.stem.split(".")[0]
    if not is_hub_id(model):
        raise NotFound(f"{path} does not exist (nor is {model!r} a Hugging Face id org/name)")
    hub_config_folder(model)  # raises the cache / hub message
    return model, model.rsplit("/", 1)[1]


def lora_modules(values: list[str] | None) -> list[dict] | None:
    """vLLM's --lora-modules: name=path (a relative path made absolute: the engine runs
    elsewhere), or a JSON object {"name", "path", "base_model_name"}."""
    if not values:
        return None
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                module = json.loads(value)
            except ValueError:
                raise InvalidRequest(f"--lora-modules: not JSON: {value}",
                                     param="lora_modules") from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise InvalidRequest(f"--lora-modules takes name=path, got {value!r}",
                                     param="lora_modules")
            module = {"name": name, "path": path}
        if isinstance(module, dict) and isinstance(module.get("path"), str):
            module["path"] = str(Path(module["path"]).expanduser().resolve())
        modules.append(module)
    return modules


def speculative_config(value: str | None) -> dict | None:
    """vLLM's --speculative-config: a JSON object (its fields are checked with the deploy)."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        raise InvalidRequest(f"--speculative-config is not JSON: {value}",
                             param="speculative_config") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest("--speculative-config must be a JSON object",
                             param="speculative_config")
    return parsed


def chat_template(value: str | None) -> str | None:
    """vLLM's --chat-template: a file's contents, or the template text itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise NotFound(f"--chat-template: {value} is neither a file nor a Jinja template")
    return value
