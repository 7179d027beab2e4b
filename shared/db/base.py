"""Declarative base and the mixins every table shares: an opaque id, timestamps, a version.

`version` is SQLAlchemy's version_id_col: each flush of a row runs `UPDATE ... WHERE id = :id AND
version = :old` and a lost race raises StaleDataError, which the registry turns into a 409
(docs/architecture.md "Data and concurrency": a stale write is refused, never lost).
"""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import DateTime, Integer, String, func
from sqlalchemy.ext.asyncio import AsyncAttrs
from sqlalchemy.orm import DeclarativeBase, Mapped, declared_attr, mapped_column


def new_id() -> str:
    """64 random bits as hex: opaque, safe as a NATS subject token."""
    return uuid.uuid4().hex[:16]


class Base(AsyncAttrs, DeclarativeBase):
    pass


class RowMixin:
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now()
    )
    version: Mapped[int] = mapped_column(Integer, nullable=False)

    @declared_attr.directive
    def __mapper_args__(cls) -> dict[str, object]:  # noqa: N805 - SQLAlchemy's signature
        return {"version_id_col": cls.version, "eager_defaults": True}
