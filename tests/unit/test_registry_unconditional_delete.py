"""A delete that names no version asked for no check: when it loses a race with a concurrent write
(an instance's state moved between its read and its delete) the registry does it again instead of
answering 409 (the MoE deploy e2e test saw that 409 on `delete_model` right after serving). A
delete that names a version, or any other write, still gets the 409."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shoal.services.registry.api import UNCONDITIONAL_DELETE_TRIES, RegistryApi
from shoal.shared.errors import Conflict
from shoal.shared.schemas.registry import DeleteRequest, ModelUpdate


class _Session:
    """Stands in for an AsyncSession's transaction: the handler under test writes nothing."""

    async def __aenter__(self) -> _Session:
        return self

    async def __aexit__(self, *exc: object) -> bool:
        return False

    def begin(self) -> _Session:
        return self


def _api() -> RegistryApi:
    api = RegistryApi.__new__(RegistryApi)  # only atomic() is under test: no bus, no database
    api.sessions = _Session  # type: ignore[assignment]
    api.committed = lambda: None  # type: ignore[method-assign]
    return api


def _losing(times: int) -> tuple[list[Any], Any]:
    calls: list[Any] = []

    async def handler(req: Any) -> str:
        calls.append(req)
        if len(calls) <= times:
            raise Conflict("model 'm' was changed by someone else", code="stale_version")
        return "done"

    return calls, handler


def test_an_unversioned_delete_is_done_again_after_a_lost_race() -> None:
    calls, handler = _losing(UNCONDITIONAL_DELETE_TRIES - 1)
    assert asyncio.run(_api().atomic(handler)(DeleteRequest(id="m"))) == "done"
    assert len(calls) == UNCONDITIONAL_DELETE_TRIES


def test_it_gives_up_after_its_tries() -> None:
    calls, handler = _losing(UNCONDITIONAL_DELETE_TRIES)
    with pytest.raises(Conflict):
        asyncio.run(_api().atomic(handler)(DeleteRequest(id="m")))
    assert len(calls) == UNCONDITIONAL_DELETE_TRIES


@pytest.mark.parametrize("req", [DeleteRequest(id="m", version=3),
                                 ModelUpdate(id="m", version=3)])
def test_a_versioned_or_other_write_still_gets_the_conflict(req: Any) -> None:
    calls, handler = _losing(1)
    with pytest.raises(Conflict):
        asyncio.run(_api().atomic(handler)(req))
    assert len(calls) == 1
