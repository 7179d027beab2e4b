"""Initial schema: models, workers, instances, api_keys.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _common() -> list[sa.Column]:
    return [
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(),
                  nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(),
                  nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "models", *_common(),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("spec", sa.JSON, nullable=False),
    )
    op.create_table(
        "workers", *_common(),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("labels", sa.JSON, nullable=False),
        sa.Column("simulated", sa.Boolean, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("state_message", sa.Text),
        sa.Column("status", sa.JSON, nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), index=True),
    )
    op.create_table(
        "instances", *_common(),
        sa.Column("name", sa.String(96), nullable=False, unique=True),
        sa.Column("model_id", sa.String(32), sa.ForeignKey("models.id", ondelete="CASCADE"),
                  index=True),
        sa.Column("model_name", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("state_message", sa.Text),
        sa.Column("state_changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("worker_id", sa.String(32), sa.ForeignKey("workers.id", ondelete="SET NULL"),
                  index=True),
        sa.Column("worker_name", sa.String(64)),
        sa.Column("placement", sa.JSON),
        sa.Column("restart_count", sa.Integer, nullable=False),
    )
    op.create_table(
        "api_keys", *_common(),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("secret_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("expires_at", sa.DateTime(timezone=True)),
        sa.Column("revoked_at", sa.DateTime(timezone=True)),
    )


def downgrade() -> None:
    for table in ("api_keys", "instances", "workers", "models"):
        op.drop_table(table)
