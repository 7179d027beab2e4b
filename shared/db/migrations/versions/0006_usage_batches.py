"""Usage records are counted once: the ids of those already counted (`usage_batches`).

Revision ID: 0006_usage_batches
Revises: 0005_outbox_trace
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_usage_batches"
down_revision = "0005_outbox_trace"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_batches",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False, index=True),
    )


def downgrade() -> None:
    op.drop_table("usage_batches")
