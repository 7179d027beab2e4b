"""The registry's bus API: one endpoint per verb on shoal.registry.<resource>.<verb>.

Thin by design: parse (done by RpcService), call the repository, write the change events, reply.
Each write and its events commit in one transaction (the outbox, services/registry/outbox.py),
and the relay publishes them once committed: a consumer never sees a change that was rolled
back, and no committed change loses its event, even when the registry dies in between.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shoal.services.registry.outage import OutageLog
from shoal.services.registry.outbox import OutboxRelay, add_event, transaction
from shoal.services.registry.repo.api_keys import ApiKeyRepo
from shoal.services.registry.repo.common import database_down, database_unavailable
from shoal.services.registry.repo.instances import InstanceRepo
from shoal.services.registry.repo.models import ModelRepo
from shoal.services.registry.repo.quota import QuotaRepo
from shoal.services.registry.repo.responses import ResponseRepo
from shoal.services.registry.repo.workers import WorkerRepo
from shoal.shared.bus.client import Bus
from shoal.shared.bus.service import RpcService
from shoal.shared.errors import Conflict, ShoalError
from shoal.shared.schemas.events import (
    ApiKeyEvent, EventKind, InstanceEvent, ModelEvent, WorkerEvent
)
from shoal.shared.schemas.registry import (
    ApiKeyCreate, ApiKeyCreated, ApiKeyPublic, ApiKeyUpdate, ApiKeyVerify, ById, ByIdOrName,
    Deleted, DeleteRequest, InstanceCreate, InstanceDelete, InstanceFilter, InstancePublic,
    InstanceTransition, ListRequest, ModelCreate, ModelPublic, ModelUpdate, QuotaAcquire,
    ResponseRef, StoredResponse, UsageQuery, UsageRecord, WorkerLeave, WorkerPublic,
    WorkerRegister
)

log = logging.getLogger(__name__)
Req = TypeVar("Req", bound=BaseModel)
UNCONDITIONAL_DELETE_TRIES = 3
"""A delete without a version lost a race with a concurrent write (an instance's state moved
between the read and the delete): done again, since its caller asked for no version check."""
Res = TypeVar("Res")


class RegistryApi:
    def __init__(self, bus: Bus, sessions: async_sessionmaker[AsyncSession], models: ModelRepo,
                 workers: WorkerRepo, instances: InstanceRepo, keys: ApiKeyRepo, quota: QuotaRepo,
                 failpoints: frozenset[str] = frozenset()) -> None:
        self.bus = bus
        self.sessions = sessions
        self.models, self.workers, self.instances, self.keys = models, workers, instances, keys
        self.quota = quota
        self.responses = ResponseRepo(sessions)
        self.outage = OutageLog(log)
        """Database outages, logged a few lines at a time (heartbeats, relay, requests)."""
        self.relay = OutboxRelay(sessions, bus, self.outage)
        self.failpoints = failpoints

    def atomic(self, handler: Callable[[Req], Awaitable[Res]]) -> Callable[[Req], Awaitable[Res]]:
        """`handler` in one transaction with the events it writes; the relay is told after."""

        async def run(req: Req) -> Res:
            for attempt in range(UNCONDITIONAL_DELETE_TRIES):
                try:
                    async with transaction(self.sessions):
                        result = await handler(req)
                    break
                except Conflict as exc:  # a delete that named no version asked for no check
                    if (exc.code != "stale_version" or not isinstance(req, DeleteRequest)
                            or req.version is not None
                            or attempt == UNCONDITIONAL_DELETE_TRIES - 1):
                        raise
            self.committed()
            return result

        return run

    def translate(self, exc: BaseException) -> ShoalError | None:
        """RpcService's `translate`: a lost database is a 503 (Unavailable), reported to the
        outage log rather than one warning per request; None for any other error (a 500)."""
        cause = database_down(exc)
        if cause is None:
            return None
        self.outage.failed("registry requests", cause)
        return database_unavailable(exc)

    def committed(self) -> None:
        if "registry.after_commit" in self.failpoints:  # the chaos test's crash point
            os.kill(os.getpid(), signal.SIGKILL)
        self.relay.kick()

    async def register(self, svc: RpcService) -> None:
        endpoints = [
            ("models", "create", ModelCreate, self.create_model),
            ("models", "get", ByIdOrName, self.models.get),
            ("models", "list", ListRequest, self.models.list),
            ("models", "update", ModelUpdate, self.update_model),
            ("models", "delete", DeleteRequest, self.delete_model),
            ("instances", "create", InstanceCreate, self.create_instance),
            ("instances", "get", ById, self.instances.get),
            ("instances", "list", InstanceFilter, self.instances.list),
            ("instances", "transition", InstanceTransition, self.transition_instance),
            ("instances", "delete", InstanceDelete, self.delete_instance),
            ("workers", "register", WorkerRegister, self.register_worker),
            ("workers", "get", ById, self.workers.get),
            ("workers", "list", ListRequest, self.workers.list),
            ("workers", "delete", DeleteRequest, self.delete_worker),
            ("workers", "leave", WorkerLeave, self.leave_worker),
            ("keys", "create", ApiKeyCreate, self.create_key),
            ("keys", "get", ById, self.keys.get),
            ("keys", "list", ListRequest, self.keys.list),
            ("keys", "revoke", ById, self.revoke_key),
            ("keys", "verify", ApiKeyVerify, self.keys.verify),
            ("keys", "update", ApiKeyUpdate, self.update_key),
            ("quota", "acquire", QuotaAcquire, self.quota.acquire),
            ("usage", "record", UsageRecord, self.quota.record),
            ("usage", "list", UsageQuery, self.quota.usage),
            ("responses", "put", StoredResponse, self.responses.put),
            ("responses", "get", ResponseRef, self.responses.get),
            ("responses", "delete", ResponseRef, self.responses.delete),
        ]
        reads = {"get", "list", "verify"}
        for resource, verb, request_type, handler in endpoints:  # no events for these resources
            plain = verb in reads or resource in ("quota", "usage", "responses")
            await svc.endpoint(resource, verb, request_type,
                               handler if plain else self.atomic(handler))

    # ------------------------------------------------------------ models
    async def create_model(self, req: ModelCreate) -> ModelPublic:
        model = await self.models.create(req)
        await self.model_event(EventKind.CREATED, model)
        return model

    async def update_model(self, req: ModelUpdate) -> ModelPublic:
        model = await self.models.update(req)
        await self.model_event(EventKind.UPDATED, model)
        return model

    async def delete_model(self, req: DeleteRequest) -> Deleted:
        model, instances = await self.models.delete(req)
        for instance in instances:
            await self.instance_event(EventKind.DELETED, instance)
        await self.model_event(EventKind.DELETED, model)
        return Deleted(id=model.id)

    # ------------------------------------------------------------ instances
    async def create_instance(self, req: InstanceCreate) -> InstancePublic:
        instance = await self.instances.create(req)
        await self.instance_event(EventKind.CREATED, instance)
        return instance

    async def transition_instance(self, req: InstanceTransition) -> InstancePublic:
        instance = await self.instances.transition(req)
        await self.instance_event(EventKind.UPDATED, instance)
        return instance

    async def delete_instance(self, req: InstanceDelete) -> Deleted:
        instance = await self.instances.delete(req)
        await self.instance_event(EventKind.DELETED, instance)
        return Deleted(id=instance.id)

    # ------------------------------------------------------------ workers
    async def register_worker(self, req: WorkerRegister) -> WorkerPublic:
        worker, created, resumed = await self.workers.register(req)
        await self.worker_event(EventKind.CREATED if created else EventKind.UPDATED, worker)
        for instance in resumed:
            await self.instance_event(EventKind.UPDATED, instance)
        return worker

    async def leave_worker(self, req: WorkerLeave) -> WorkerPublic:
        """An agent that stops cleanly says so: NOT_READY now, not after its heartbeats time out."""
        worker, instances = await self.workers.leave(req)
        log.info("worker %s left: %s", worker.name, worker.state_message)
        await self.worker_event(EventKind.UPDATED, worker)
        for instance in instances:
            await self.instance_event(EventKind.UPDATED, instance)
        return worker

    async def delete_worker(self, req: DeleteRequest) -> Deleted:
        worker = await self.workers.delete(req)
        await self.worker_event(EventKind.DELETED, worker)
        return Deleted(id=worker.id)

    # ------------------------------------------------------------ api keys
    async def create_key(self, req: ApiKeyCreate) -> ApiKeyCreated:
        created = await self.keys.create(req)
        public = ApiKeyPublic.model_validate(created.model_dump(exclude={"secret"}))
        await self._emit("keys", public.id, ApiKeyEvent(kind=EventKind.CREATED, id=public.id,
                                                        version=public.version, data=public))
        return created

    async def update_key(self, req: ApiKeyUpdate) -> ApiKeyPublic:
        key = await self.keys.update(req)
        await self._emit("keys", key.id, ApiKeyEvent(kind=EventKind.UPDATED, id=key.id,
                                                     version=key.version, data=key))
        return key

    async def revoke_key(self, req: ById) -> ApiKeyPublic:
        key = await self.keys.revoke(req)
        await self._emit("keys", key.id, ApiKeyEvent(kind=EventKind.UPDATED, id=key.id,
                                                     version=key.version, data=key))
        return key

    # ------------------------------------------------------------ events
    async def model_event(self, kind: EventKind, m: ModelPublic) -> None:
        await self._emit("models", m.id, ModelEvent(kind=kind, id=m.id, version=m.version, data=m))

    async def instance_event(self, kind: EventKind, i: InstancePublic) -> None:
        await self._emit("instances", i.id,
                         InstanceEvent(kind=kind, id=i.id, version=i.version, data=i))

    async def worker_event(self, kind: EventKind, w: WorkerPublic) -> None:
        await self._emit("workers", w.id,
                         WorkerEvent(kind=kind, id=w.id, version=w.version, data=w))

    async def _emit(self, resource: str, row_id: str, event: BaseModel) -> None:
        """Into the outbox of the current transaction (published once it commits)."""
        add_event(self.bus.subjects.event(resource, row_id), event)


