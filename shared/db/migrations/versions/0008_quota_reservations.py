"""Requests reserve their tokens at admission (`quota_reservations`), and key limits are bounded.

A request of a key with token limits reserves the most it can spend when it is admitted, settled
to its usage when it ends; before, token limits were checked against finished requests only, so
one batched request (or many parallel ones) could spend hundreds of times a budget.

Limits above MAX_LIMIT (10**15) are refused from now on; such a limit stored before (it made
every request of its key fail on the BIGINT counters) is lowered to MAX_LIMIT here.

Revision ID: 0008_quota_reservations
Revises: 0007_key_names_unique
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0008_quota_reservations"
down_revision = "0007_key_names_unique"
branch_labels = None
depends_on = None
MAX_LIMIT = 10**15
FIELDS = ("rpm", "tpm", "token_budget")


def _bounded(limits: list[dict]) -> list[dict]:
    return [{k: (min(v, MAX_LIMIT) if k in FIELDS and isinstance(v, (int, float)) else v)
             for k, v in limit.items()} for limit in limits]


def upgrade() -> None:
    op.create_table(
        "quota_reservations",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("key_id", sa.String(32), sa.ForeignKey("api_keys.id", ondelete="CASCADE"),
                  nullable=False, index=True),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("window", sa.BigInteger, nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    conn = op.get_bind()
    for row in conn.execute(sa.text("SELECT id, limits FROM api_keys")).all():
        limits = row.limits if isinstance(row.limits, list) else json.loads(row.limits or "[]")
        bounded = _bounded(limits)
        if bounded != limits:
            conn.execute(sa.text("UPDATE api_keys SET limits = :limits, version = version + 1 "
                                 "WHERE id = :id"), {"limits": json.dumps(bounded), "id": row.id})


def downgrade() -> None:
    op.drop_table("quota_reservations")
