"""ORM tables: models, workers, instances, api_keys, the keys' usage and rate windows, and
stored Responses API answers.
They never leave the registry.

JSON columns hold structured fields (labels, device status, placement claim) whose shape is
defined and validated by the pydantic schemas in shared/schemas/registry/.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

from sqlalchemy import (
    JSON, BigInteger, Boolean, Date, DateTime, ForeignKey, Index, Integer, LargeBinary, String,
    Text, func, text,
)
from sqlalchemy.orm import Mapped, mapped_column

from shoal.shared.db.base import Base, RowMixin


class ModelRow(RowMixin, Base):
    __tablename__ = "models"

    name: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    """ModelSpec as JSON (source, replicas, placement, engine args, autoscaling)."""
    scale_events: Mapped[list[dict[str, Any]]] = mapped_column(JSON, nullable=False, default=list)
    """The autoscaler's last decisions (ScaleEvent as JSON), oldest first."""
    run_revision: Mapped[int] = mapped_column(Integer, nullable=False, default=0,
                                              server_default="0")
    """Bumped by an update that changes how the model runs (RUN_FIELDS)."""


class WorkerRow(RowMixin, Base):
    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    hostname: Mapped[str] = mapped_column(String(255), nullable=False)
    labels: Mapped[dict[str, str]] = mapped_column(JSON, nullable=False, default=dict)
    simulated: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    state: Mapped[str] = mapped_column(String(16), nullable=False)
    state_message: Mapped[str | None] = mapped_column(Text)
    status: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    """DeviceStatus as JSON; refreshed by heartbeats."""
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), index=True)


class InstanceRow(RowMixin, Base):
    __tablename__ = "instances"

    name: Mapped[str] = mapped_column(String(96), unique=True, nullable=False)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    model_name: Mapped[str] = mapped_column(String(64), nullable=False)
    state: Mapped[str] = mapped_column(String(16), nullable=False, index=True)
    state_message: Mapped[str | None] = mapped_column(Text)
    state_changed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    worker_id: Mapped[str | None] = mapped_column(
        ForeignKey("workers.id", ondelete="SET NULL"), index=True
    )
    worker_name: Mapped[str | None] = mapped_column(String(64))
    placement: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """Placement as JSON (gpu indexes, claim, tp/pp, subordinate workers, warnings)."""
    run_revision: Mapped[int] = mapped_column(Integer, nullable=False, default=0,
                                              server_default="0")
    """The model's run_revision when this instance was made (older ones are replaced)."""
    restart_count: Mapped[int] = mapped_column(Integer, nullable=False, default=0)


class ApiKeyRow(RowMixin, Base):
    __tablename__ = "api_keys"
    __table_args__ = (Index("uq_api_keys_active_name", "name", unique=True,
                            postgresql_where=text("revoked_at IS NULL")),)
    """A name means one key not revoked (migration 0007); revoked keys keep theirs."""

    name: Mapped[str] = mapped_column(String(64), nullable=False)
    prefix: Mapped[str] = mapped_column(String(16), nullable=False)
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    """SHA-256 of the secret; the secret itself is never stored."""
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    scope: Mapped[str] = mapped_column(String(16), nullable=False, default="admin")
    """"admin" or "inference" (keys made before scopes existed are admin: they could do all)."""
    limits: Mapped[list[dict[str, Any]]] = mapped_column(JSON, nullable=False, default=list)
    """KeyLimit list as JSON."""


class ApiKeyUsageRow(Base):
    """Usage of one key on one model on one (UTC) day: what `shoal keys usage` shows and what
    token budgets are counted against. Upserted atomically after each request."""

    __tablename__ = "api_key_usage"

    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"),
                                        primary_key=True)
    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    day: Mapped[date] = mapped_column(Date, primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)


class RateWindowRow(Base):
    """Requests and tokens of one key in one one-minute window, for one model or all ("*"):
    the shared counters every gateway replica's requests are counted in."""

    __tablename__ = "rate_windows"

    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"),
                                        primary_key=True)
    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    window: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    """Unix minute (epoch seconds // 60)."""
    requests: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)


class UsageBatchRow(Base):
    """A usage record already counted (`UsageRecord.batch_id`), written in the same transaction
    as its counts: a retried record finds its id here and counts nothing. Rows older than a day
    are deleted (a gateway retries a record for 10 minutes at most)."""

    __tablename__ = "usage_batches"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False,
                                                  index=True)


class OutboxRow(Base):
    """A change event written in the same transaction as the change, published to JetStream
    by the registry's relay and then deleted (the transactional outbox)."""

    __tablename__ = "event_outbox"

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    msg_id: Mapped[str] = mapped_column(String(32), nullable=False)
    """JetStream's Nats-Msg-Id: a relay that dies after publishing and before deleting the row
    publishes it again, and the stream drops the duplicate."""
    subject: Mapped[str] = mapped_column(String(255), nullable=False)
    payload: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    headers: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    """The trace context (traceparent, tracestate) of the call that made the change: the event
    is published with it, so the consumers' spans continue that call's trace."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class QuotaReservationRow(Base):
    """Tokens a request of a key with token limits may still spend, reserved at its admission
    (added to its window's tokens and counted against budgets) and deleted when its usage record
    settles it. A reservation whose record never comes (its gateway died) stops counting against
    budgets at `expires_at`."""

    __tablename__ = "quota_reservations"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"),
                                        index=True)
    model: Mapped[str] = mapped_column(String(64), nullable=False)
    window: Mapped[int] = mapped_column(BigInteger, nullable=False)
    """The Unix minute whose token windows hold the reserved tokens."""
    tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class ResponseRow(Base):
    """A stored Responses API answer (StoredResponse), scoped to the key that created it."""

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_id: Mapped[str | None] = mapped_column(
        String(32), ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    model: Mapped[str] = mapped_column(String(128), nullable=False)
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    conversation: Mapped[list[dict[str, Any]]] = mapped_column(JSON, nullable=False)
    response: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True),
                                                 server_default=func.now())
