"""Alembic environment: runs on the connection the registry hands over (see db/session.py)."""

from __future__ import annotations

from alembic import context

from shoal.shared.db import tables  # noqa: F401 - registers the tables on Base.metadata
from shoal.shared.db.base import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through shoal.shared.db.session.run_migrations()")

context.configure(connection=connection, target_metadata=Base.metadata, compare_type=True)
with context.begin_transaction():
    context.run_migrations()
