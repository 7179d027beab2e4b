"""The transactional outbox of change events (docs/architecture.md "Events: an outbox").

Revision ID: 0004
Revises: 0003_autoscaling
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003_autoscaling"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "event_outbox",
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("msg_id", sa.String(32), nullable=False),
        sa.Column("subject", sa.String(255), nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(),
                  nullable=False),
    )


def downgrade() -> None:
    op.drop_table("event_outbox")
