"""What each `shoal` command does (argument parsing is in __init__.py)."""

from __future__ import annotations

import argparse
import os
import sys

from shoal.cli.serve import lora_modules
from shoal.cli import SERVICES, _labels
from shoal.cli.resources import (
    emit, instances_table, keys_table, models_table, run, usage_table, workers_table
)
from shoal.cli.runner import resolve_settings, run_service
from shoal.shared.bus.deploy import check_update, deploy
from shoal.shared.bus.gather import gather
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.errors import InvalidRequest, NotFound
from shoal.shared.schemas.gateway import GatewayInfo
from shoal.shared.schemas.registry import (
    ApiKeyCreate, ApiKeyCreated, ApiKeyPublic, ApiKeyUpdate, DeleteRequest, DeviceKind,
    InstanceFilter, KeyLimit, ModelCreate, ModelPublic, ModelUpdate, UsageQuery, UsageRow,
)
from shoal.shared.states import InstanceState


def dispatch(args: argparse.Namespace) -> int:
    overrides: dict[str, object] = {"data_dir": args.data_dir, "nats_url": args.nats_url}
    if args.command in ("gateway", "serve"):
        overrides.update(gateway_host=args.host, gateway_port=args.port)
    if args.command == "gateway":
        from shoal.services.gateway.service import run_gateway

        return run_service("gateway", run_gateway, resolve_settings(**overrides))
    if args.command == "serve":
        from shoal.cli.serve import model_spec
        from shoal.cli.up import up

        spec = model_spec(args)
        if args.otlp_traces_endpoint:  # for every service of the stack, which inherit the env
            os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = args.otlp_traces_endpoint
            os.environ["SHOAL_OTEL_EXPORTER"] = "otlp"
        if args.api_key:
            overrides["api_key"] = args.api_key
        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
        return up(settings, SERVICES, {}, spec, strict=True)
    if args.command == "up":
        from shoal.cli.up import up

        from shoal.cli.up import DEFAULT_MODEL
        from shoal.services.engine import smollm2_gguf_path

        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
        extra = ({"worker": ["--simulate-devices", args.simulate_devices]}
                 if args.simulate_devices else {})
        deploy = None if args.no_model or args.simulate_devices else ModelCreate(
            name=DEFAULT_MODEL, source=str(smollm2_gguf_path()), device=DeviceKind.CPU)
        return up(settings, SERVICES, extra, deploy)
    if args.command == "scheduler":
        from shoal.services.scheduler.replica import run_scheduler

        return run_service("scheduler", run_scheduler, resolve_settings(**overrides))
    if args.command == "registry":
        from shoal.services.registry.service import run_registry

        return run_service("registry", run_registry, resolve_settings(**overrides))
    if args.command == "engine":
        from functools import partial

        from shoal.services.backends.service import run_instance

        return run_service("engine", partial(run_instance, instance_id=args.instance_id),
                           resolve_settings(**overrides))
    if args.command == "worker":
        from shoal.services.worker.agent import run_worker

        settings = resolve_settings(**overrides, worker_name=args.name,
                                    simulate_devices=args.simulate_devices,
                                    worker_labels=_labels(args.label) or None,
                                    vllm_venv=args.vllm_venv)
        return run_service("worker", run_worker, settings)
    settings = resolve_settings(**overrides)
    return RESOURCES[args.command](settings, args)


async def _model(client: RegistryClient, target: str) -> ModelPublic:
    try:
        return await client.get_model(name=target)
    except NotFound:
        return await client.get_model(id=target)


def models_cmd(settings: Settings, args: argparse.Namespace) -> int:
    if args.verb == "list":
        emit(run(settings, lambda c: c.list_models()), args.json, models_table)
    elif args.verb == "get":
        emit(run(settings, lambda c: _model(c, args.target)), args.json, models_table)
    elif args.verb == "deploy":
        req = ModelCreate(
            name=args.target, source=args.source, replicas=args.replicas, device=args.device,
            placement_strategy=args.placement, worker_selector=_labels(args.worker_selector),
            gpu_selector=args.gpu_selector, gpu_type=args.gpu_type, tp=args.tp, pp=args.pp,
            max_model_len=args.max_model_len, distributed=not args.no_distributed,
            engine_args={k: _scalar(v) for k, v in _labels(args.engine_arg).items()},
            autoscaling=_autoscaling(args.autoscale),
            lora_modules=lora_modules(args.lora_module) or [],
            **_backend_fields(args),
        )
        if args.dry_run:
            return dry_run(settings, req, args.json)
        model = run(settings, lambda c: deploy(c.bus, req))  # refused what the dry run refuses
        emit(model, args.json, models_table)
        if args.wait:
            return wait_for(settings, model)
    elif args.verb == "update":
        async def update(c: RegistryClient) -> ModelPublic:
            model = await _model(c, args.target)
            changes: dict[str, object] = {}
            if args.replicas is not None:
                changes["replicas"] = args.replicas
            if args.autoscale:
                base = model.autoscaling.model_dump() if model.autoscaling else {}
                changes["autoscaling"] = {**base, **_autoscaling(args.autoscale)}
            changes.update(_backend_changes(args))
            req = ModelUpdate(id=model.id, version=model.version,
                              **changes)  # type: ignore[arg-type]
            await check_update(c.bus, model, req)  # refused what the PATCH refuses
            return await c.update_model(req)

        emit(run(settings, update), args.json, models_table)
    elif args.verb == "delete":
        async def delete(c: RegistryClient) -> None:
            model = await _model(c, args.target)
            await c.delete_model(DeleteRequest(id=model.id))

        run(settings, delete)
        print(f"deleted model {args.target}")
    return 0


def _backend_fields(args: argparse.Namespace) -> dict[str, object]:
    """The backend's settings of `models deploy` (README "Backends"); unset ones keep the
    spec's defaults."""
    fields: dict[str, object] = {"backend": args.backend,
                                 "backend_parameters": list(args.backend_arg),
                                 "env": _labels(args.env)}
    for name in ("backend_version", "backend_command", "backend_health_path"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    return fields


def _backend_changes(args: argparse.Namespace) -> dict[str, object]:
    """The backend's settings of `models update`: only those given (the rest is kept)."""
    changes: dict[str, object] = {}
    for name in ("backend", "backend_version", "backend_command", "backend_health_path"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.backend_arg is not None:
        changes["backend_parameters"] = [a for a in args.backend_arg if a.strip()]
    if args.env is not None:
        changes["env"] = _labels([e for e in args.env if e.strip()])
    return changes


def wait_for(settings: Settings, model: ModelPublic) -> int:
    """`models deploy --wait`: show an instance's progress until it is RUNNING (0), or until it
    fails (ERROR: its reason, 1) or an hour has passed (1). Ctrl-C stops the wait, not the
    deployment."""
    import time

    from shoal.cli.progress import failed_start, wait_running

    deadline = time.monotonic() + 3600
    try:
        inst = run(settings, lambda c: wait_running(c, model.id, deadline))
    except KeyboardInterrupt:
        return 130
    if inst is None:
        print(f"shoal: {model.name} has no RUNNING instance yet; see `shoal instances list`")
        return 1
    if inst.state is InstanceState.ERROR:
        print(f"shoal: {failed_start(model.name, inst)}\nshoal: the model stays deployed and "
              f"the worker retries it with back-off; `shoal instances list --model {model.name}` "
              f"follows it, `shoal models delete {model.name}` removes it", file=sys.stderr)
        return 1
    print(f"shoal: {model.name} RUNNING as {inst.name}")
    return 0


def _scalar(text: str) -> int | float | bool | str:
    """An --engine-arg value as the type it reads as."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def dry_run(settings: Settings, req: ModelCreate, as_json: bool) -> int:
    """Where one instance of the model would go on the current fleet, or why not: the
    scheduler's answer (it reads the model's files); what can never run is refused (exit 1)."""
    from shoal.shared.bus.scheduler_client import SchedulerClient

    plan = run(settings, lambda c: SchedulerClient(c.bus).plan(req))
    if as_json:
        print(plan.placement.model_dump_json(indent=2) if plan.placement else "null")
    print(plan.message)
    return 0 if plan.fits else 2


def instances_cmd(settings: Settings, args: argparse.Namespace) -> int:
    if args.verb == "list":
        async def list_(c: RegistryClient):  # noqa: ANN202
            model_id = (await _model(c, args.model)).id if args.model else None
            return await c.list_instances(InstanceFilter(model_id=model_id))

        emit(run(settings, list_), args.json, instances_table)
    else:
        emit(run(settings, lambda c: c.get_instance(args.target)), args.json, instances_table)
    return 0


def workers_cmd(settings: Settings, args: argparse.Namespace) -> int:
    if args.verb == "list":
        emit(run(settings, lambda c: c.list_workers()), args.json, workers_table)
    else:
        emit(run(settings, lambda c: c.get_worker(args.target)), args.json, workers_table)
    return 0


def _autoscaling(pairs: list[str] | None) -> dict[str, object] | None:
    """`--autoscale max_replicas=4 --autoscale target=2 ...` -> the autoscaling fields (checked
    by AutoscaleSpec: a missing or bad one is named)."""
    if not pairs:
        return None
    return {k: _scalar(v) for k, v in _labels(pairs).items()}


def parse_limit(spec: str) -> KeyLimit:
    """`rpm=60,tpm=10000,token_budget=1000000,model=smol` -> KeyLimit (checked by it)."""
    fields: dict[str, str] = {}
    for part in spec.split(","):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in ("rpm", "tpm", "token_budget", "model"):
            raise InvalidRequest(f"--limit {spec!r}: expected rpm=N,tpm=N,token_budget=N"
                                 "[,model=NAME]", param="limit")
        fields[name.strip()] = value.strip()
    return KeyLimit.model_validate(fields)


def open_gateways_warning(gateways: list[GatewayInfo]) -> str | None:
    """What `keys create` says when a gateway does not require keys (None: every gateway that
    answered does): the key works where it is sent, but requests without one are served."""
    open_ones = sorted(g.address for g in gateways if not g.keys_required)
    if not open_ones:
        return None
    return (f"warning: the gateway at {', '.join(open_ones)} does not require API keys "
            "(SHOAL_REQUIRE_API_KEY is not set): requests without a key are still served with "
            "full access, the management API included. This key is honoured when it is sent "
            "(its scope, limits and usage); set SHOAL_REQUIRE_API_KEY=true on the gateway to "
            "require keys.")


def keys_cmd(settings: Settings, args: argparse.Namespace) -> int:
    if args.verb == "create":
        limits = [parse_limit(x) for x in args.limit or []]

        async def create(c: RegistryClient) -> tuple[ApiKeyCreated, list[GatewayInfo]]:
            created = await c.create_key(ApiKeyCreate(name=args.target, scope=args.scope,
                                                      limits=limits))
            return created, await gather(c.bus, c.bus.subjects.gateway_info, GatewayInfo)

        created, gateways = run(settings, create)
        if args.json:
            emit(created, True, keys_table)
        else:
            print(f"API key {created.name} ({created.id}, {created.scope.value}) created. Its "
                  f"secret is shown once:\n\n    {created.secret}\n")
        warning = open_gateways_warning(gateways)
        if warning:
            print(warning, file=sys.stderr)
    elif args.verb == "list":
        emit(run(settings, lambda c: c.list_keys()), args.json, keys_table)
    elif args.verb == "update":
        limits = [] if args.no_limits else (
            [parse_limit(x) for x in args.limit] if args.limit else None)

        async def update(c: RegistryClient) -> ApiKeyPublic:
            key = await c.get_key(args.target)  # a name or an id: the registry resolves it
            fields: dict[str, object] = {"id": key.id, "version": key.version}
            if args.scope is not None:
                fields["scope"] = args.scope
            if limits is not None:
                fields["limits"] = limits
            return await c.update_key(ApiKeyUpdate(**fields))  # type: ignore[arg-type]

        emit(run(settings, update), args.json, keys_table)
    elif args.verb == "usage":
        async def usage(c: RegistryClient) -> list[UsageRow]:
            key_id = (await c.get_key(args.key)).id if args.key else None
            report = await c.usage(UsageQuery(key_id=key_id, model=args.model, since=args.since,
                                              until=args.until))
            return report.rows

        emit(run(settings, usage), args.json, usage_table)
    else:
        emit(run(settings, lambda c: c.revoke_key(args.target)), args.json, keys_table)
    return 0


RESOURCES = {"models": models_cmd, "instances": instances_cmd, "workers": workers_cmd,
             "keys": keys_cmd}
