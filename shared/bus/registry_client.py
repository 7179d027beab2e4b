"""Typed client of the registry API, used by every other service and the CLI.

Each method is one request on shoal.registry.<resource>.<verb>; errors come back as the
ShoalError kind the registry raised (NotFound, Conflict, InvalidRequest, ...).
"""

from __future__ import annotations

from shoal.shared.bus.client import Bus
from shoal.shared.schemas.common import Page
from shoal.shared.schemas.registry import (
    ApiKeyCreate, ApiKeyCreated, ApiKeyPublic, ApiKeyUpdate, ApiKeyVerified, ApiKeyVerify, ById,
    ByIdOrName, Deleted, DeleteRequest, InstanceCreate, InstanceFilter, InstancePublic,
    InstanceTransition, ListRequest, ModelCreate, ModelPublic, ModelUpdate, QuotaAcquire,
    QuotaGrant, ResponseRef, StoredResponse, UsageQuery, UsageRecord, UsageReport, WorkerLeave,
    WorkerPublic,
    WorkerRegister,
)


class RegistryClient:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._on = bus.subjects.registry

    # models
    async def create_model(self, req: ModelCreate) -> ModelPublic:
        return await self.bus.request(self._on("models", "create"), req, ModelPublic)

    async def get_model(self, id: str | None = None, name: str | None = None) -> ModelPublic:
        return await self.bus.request(self._on("models", "get"),
                                      ByIdOrName(id=id, name=name), ModelPublic)

    async def list_models(self, req: ListRequest | None = None) -> list[ModelPublic]:
        page = await self.bus.request(self._on("models", "list"), req or ListRequest(),
                                      Page[ModelPublic])
        return page.items

    async def update_model(self, req: ModelUpdate) -> ModelPublic:
        return await self.bus.request(self._on("models", "update"), req, ModelPublic)

    async def delete_model(self, req: DeleteRequest) -> Deleted:
        return await self.bus.request(self._on("models", "delete"), req, Deleted)

    # instances
    async def create_instance(self, req: InstanceCreate) -> InstancePublic:
        return await self.bus.request(self._on("instances", "create"), req, InstancePublic)

    async def get_instance(self, id: str) -> InstancePublic:
        return await self.bus.request(self._on("instances", "get"), ById(id=id),
                                      InstancePublic)

    async def list_instances(self, req: InstanceFilter | None = None) -> list[InstancePublic]:
        page = await self.bus.request(self._on("instances", "list"),
                                      req or InstanceFilter(),
                                      Page[InstancePublic])
        return page.items

    async def transition_instance(self, req: InstanceTransition) -> InstancePublic:
        return await self.bus.request(self._on("instances", "transition"), req,
                                      InstancePublic)

    async def delete_instance(self, req: DeleteRequest) -> Deleted:
        return await self.bus.request(self._on("instances", "delete"), req, Deleted)

    # workers
    async def register_worker(self, req: WorkerRegister) -> WorkerPublic:
        return await self.bus.request(self._on("workers", "register"), req, WorkerPublic)

    async def get_worker(self, id: str) -> WorkerPublic:
        return await self.bus.request(self._on("workers", "get"), ById(id=id),
                                      WorkerPublic)

    async def list_workers(self, req: ListRequest | None = None) -> list[WorkerPublic]:
        page = await self.bus.request(self._on("workers", "list"), req or ListRequest(),
                                      Page[WorkerPublic])
        return page.items

    async def delete_worker(self, req: DeleteRequest) -> Deleted:
        return await self.bus.request(self._on("workers", "delete"), req, Deleted)

    async def leave_worker(self, req: WorkerLeave) -> WorkerPublic:
        return await self.bus.request(self._on("workers", "leave"), req, WorkerPublic)

    # api keys
    async def create_key(self, req: ApiKeyCreate) -> ApiKeyCreated:
        return await self.bus.request(self._on("keys", "create"), req, ApiKeyCreated)

    async def list_keys(self, req: ListRequest | None = None) -> list[ApiKeyPublic]:
        page = await self.bus.request(self._on("keys", "list"), req or ListRequest(),
                                      Page[ApiKeyPublic])
        return page.items

    async def get_key(self, id_or_name: str) -> ApiKeyPublic:
        """The key with this id, else the one with this name (the registry resolves it)."""
        return await self.bus.request(self._on("keys", "get"), ById(id=id_or_name),
                                      ApiKeyPublic)

    async def revoke_key(self, id_or_name: str) -> ApiKeyPublic:
        return await self.bus.request(self._on("keys", "revoke"), ById(id=id_or_name),
                                      ApiKeyPublic)

    async def verify_key(self, secret: str) -> ApiKeyVerified:
        return await self.bus.request(self._on("keys", "verify"),
                                      ApiKeyVerify(secret=secret), ApiKeyVerified)

    async def update_key(self, req: ApiKeyUpdate) -> ApiKeyPublic:
        return await self.bus.request(self._on("keys", "update"), req, ApiKeyPublic)

    # quotas and usage (per key)
    async def acquire_quota(self, req: QuotaAcquire) -> QuotaGrant:
        return await self.bus.request(self._on("quota", "acquire"), req, QuotaGrant)

    async def record_usage(self, req: UsageRecord) -> UsageRecord:
        return await self.bus.request(self._on("usage", "record"), req, UsageRecord)

    async def usage(self, req: UsageQuery | None = None) -> UsageReport:
        return await self.bus.request(self._on("usage", "list"), req or UsageQuery(),
                                      UsageReport)

    # stored Responses API answers (per key)
    async def put_response(self, req: StoredResponse) -> Deleted:
        return await self.bus.request(self._on("responses", "put"), req, Deleted)

    async def get_response(self, id: str, key_id: str | None) -> StoredResponse:
        return await self.bus.request(self._on("responses", "get"),
                                      ResponseRef(id=id, key_id=key_id), StoredResponse)

    async def delete_response(self, id: str, key_id: str | None) -> Deleted:
        return await self.bus.request(self._on("responses", "delete"),
                                      ResponseRef(id=id, key_id=key_id), Deleted)
