"""Autoscaling: the autoscaler's last decisions kept on each model (the spec's `autoscaling`
lives in the spec JSON with the rest).

Revision ID: 0003_autoscaling
Revises: 0002_key_scopes
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_autoscaling"
down_revision = "0002_key_scopes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("models", sa.Column("scale_events", sa.JSON, nullable=False,
                                      server_default=sa.text("'[]'")))


def downgrade() -> None:
    op.drop_column("models", "scale_events")
