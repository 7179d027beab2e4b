"""Outbox rows keep the trace context of the call that made the change (published with it).

Revision ID: 0005_outbox_trace
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005_outbox_trace"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("event_outbox", sa.Column("headers", sa.JSON, nullable=True))


def downgrade() -> None:
    op.drop_column("event_outbox", "headers")
