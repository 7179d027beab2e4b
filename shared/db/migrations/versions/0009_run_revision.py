"""A model's run revision, and the one each instance was made for: an update that changes how
a model runs bumps the model's, and the scheduler replaces the instances made before it, one at
a time (services/scheduler/reconcile.py), as GPUStack replaces a model's instances.

Revision ID: 0009_run_revision
Revises: 0008_quota_reservations
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_run_revision"
down_revision = "0008_quota_reservations"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("models", "instances"):
        op.add_column(table, sa.Column("run_revision", sa.Integer, nullable=False,
                                       server_default="0"))


def downgrade() -> None:
    for table in ("models", "instances"):
        op.drop_column(table, "run_revision")
