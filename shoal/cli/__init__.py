"""The `shoal` command: run the stack or one service, and manage models, instances, workers, keys.

Services: `shoal up` (everything, embedded servers when no URLs are set), `shoal registry`,
`shoal worker`. Resources talk to the registry over NATS and print tables (`--json` for JSON).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from shoal.cli.serve import add_data_dir_argument, add_serve_arguments, refuse_unknown
from shoal.shared.errors import ShoalError
from shoal.shared.version import VERSION

SERVICES = ["registry", "scheduler", "worker", "gateway"]
"""What `shoal up` starts, in order (stopped in reverse)."""


def _labels(pairs: Sequence[str]) -> dict[str, str]:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"shoal: a label must be KEY=VALUE, got {pair!r}")
        labels[key] = value
    return labels


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"shoal {VERSION}")
    parser.add_argument("--data-dir", type=Path,
                        help="where `shoal up` keeps its files (default ~/.shoal)")
    parser.add_argument("--nats-url",
                        help="NATS server (default: SHOAL_NATS_URL or the running stack)")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the whole local stack in the foreground")
    up.add_argument("--simulate-devices", help="run the local worker as a simulated one")
    up.add_argument("--no-model", action="store_true", help="do not deploy the default model")
    add_data_dir_argument(up)
    sub.add_parser("scheduler", help="run the scheduler service")
    gateway = sub.add_parser("gateway", help="run the OpenAI-compatible gateway")
    gateway.add_argument("--host", help="listen address (default 127.0.0.1)")
    gateway.add_argument("--port", type=int, help="listen port (default 8000)")
    serve = sub.add_parser("serve", help="one model behind an OpenAI endpoint, with `vllm serve`'s "
                                         "flags: `shoal up` + deploy MODEL")
    add_serve_arguments(serve)
    sub.add_parser("registry", help="run the registry service")
    engine = sub.add_parser("engine", help="run one engine instance (started by a worker)")
    engine.add_argument("--instance-id", required=True)
    worker = sub.add_parser("worker", help="run a worker agent on this machine")
    worker.add_argument("--name", help="worker name (default: host name)")
    worker.add_argument("--simulate-devices", help='e.g. "8xH100-80GB" or "2xA10-24GB,1xcpu"')
    worker.add_argument("--label", action="append", default=[], help="KEY=VALUE, repeatable")
    worker.add_argument("--vllm-venv", type=Path,
                        help="run the vllm backend from this venv instead of installing it")

    for resource, verbs in (("models", ("list", "get", "deploy", "update", "delete")),
                            ("instances", ("list", "get")), ("workers", ("list", "get")),
                            ("keys", ("create", "list", "revoke", "update", "usage"))):
        res = sub.add_parser(resource, help=f"manage {resource}")
        res_sub = res.add_subparsers(dest="verb", required=True)
        for verb in verbs:
            p = res_sub.add_parser(verb)
            p.add_argument("--json", action="store_true", help="print JSON instead of a table")
            if (verb in ("get", "update", "delete", "revoke")
                    or (resource, verb) in (("models", "deploy"), ("keys", "create"))):
                p.add_argument("target", help="name or id")
            if (resource, verb) == ("models", "deploy"):
                p.add_argument("--source", required=True,
                               help="a Hugging Face id (org/name), folder or .gguf file")
                p.add_argument("--replicas", type=int, default=1)
                p.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto")
                p.add_argument("--placement", choices=["binpack", "spread"], default="binpack")
                p.add_argument("--worker-selector", action="append", default=[], help="KEY=VALUE")
                p.add_argument("--gpu-selector", action="append", default=[],
                               help="WORKER:GPU_INDEX")
                p.add_argument("--gpu-type")
                p.add_argument("--tp", type=int)
                p.add_argument("--pp", type=int)
                p.add_argument("--max-model-len", type=int)
                p.add_argument("--no-distributed", action="store_true",
                               help="never span several workers")
                p.add_argument("--engine-arg", action="append", default=[],
                               help="KEY=VALUE engine setting (max_num_seqs, kv_cache_memory, ...)")
                p.add_argument("--lora-module", action="append", default=[],
                               metavar="NAME=PATH",
                               help="a LoRA adapter the model serves (repeatable; needs "
                                    "--engine-arg enable_lora=true)")
                p.add_argument("--backend", choices=["shoal", "vllm", "custom"],
                               default="shoal", help="what serves it (README \"Backends\")")
                p.add_argument("--backend-version", help="vllm: the version to install")
                p.add_argument("--backend-arg", action="append", default=[], metavar="FLAGS",
                               help='raw flags for the backend, e.g. --backend-arg="--max-num-seqs'
                                    ' 8" (repeatable)')
                p.add_argument("--backend-command",
                               help="custom: the server command, with {model_path}, {port}, "
                                    "{served_name}, {host} placeholders")
                p.add_argument("--backend-health-path", help="custom: answers 200 when ready "
                                                              "(default /health)")
                p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                               help="environment of the model's processes (repeatable)")
                p.add_argument("--dry-run", action="store_true",
                               help="print where it would be placed (or why not) and create "
                                    "nothing")
                p.add_argument("--wait", action="store_true",
                               help="follow an instance (download, conversion, load) until RUNNING")
            if (resource, verb) == ("models", "update"):
                p.add_argument("--replicas", type=int)
                p.add_argument("--backend", choices=["shoal", "vllm", "custom"])
                p.add_argument("--backend-version")
                p.add_argument("--backend-arg", action="append", default=None, metavar="FLAGS",
                               help="the backend's flags: given, they replace the model's "
                                    "(--backend-arg= empties them); repeatable")
                p.add_argument("--backend-command")
                p.add_argument("--backend-health-path")
                p.add_argument("--env", action="append", default=None, metavar="KEY=VALUE",
                               help="given, replaces the model's env (--env= empties it)")
            if resource == "models" and verb in ("deploy", "update"):
                p.add_argument("--autoscale", action="append", default=[], metavar="KEY=VALUE",
                               help="autoscaling: min_replicas, max_replicas, metric "
                                    "(waiting_per_instance | kv_cache_usage), target, tolerance, "
                                    "scale_up_cooldown, scale_down_cooldown, scale_to_zero_after")
            if resource == "keys" and verb in ("create", "update"):
                p.add_argument("--scope", choices=["inference", "admin"],
                               help="inference: the OpenAI API only; admin: also the management "
                                    "API (create's default: admin for the first key, else "
                                    "inference)")
                p.add_argument("--limit", action="append", default=None, metavar="SPEC",
                               help="rpm=N,tpm=N,token_budget=N[,model=NAME] (repeatable; "
                                    "without model=: all models together; N from 1 to 10^15)")
            if (resource, verb) == ("keys", "update"):
                p.add_argument("--no-limits", action="store_true", help="remove every limit")
            if (resource, verb) == ("keys", "usage"):
                p.add_argument("--key", help="only this key (name or id)")
                p.add_argument("--model", help="only this model")
                p.add_argument("--since", help="first day, YYYY-MM-DD (UTC)")
                p.add_argument("--until", help="last day, YYYY-MM-DD (UTC)")
            if (resource, verb) == ("instances", "list"):
                p.add_argument("--model", help="only this model's instances (name)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from shoal.cli import commands  # deferred: keeps `shoal --help` instant

    try:
        if extra:
            refuse_unknown(extra)  # vLLM flags shoal serve does not take, named
        return commands.dispatch(args)
    except ShoalError as exc:
        print(f"shoal: {exc.message}", file=sys.stderr)
        return 1
    except ValidationError as exc:  # a bad flag value, caught by the wire model it fills
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "input"
        print(f"shoal: {where}: {first['msg']}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `shoal ... | head`
        return 0
