"""Stored answers of OpenAI's Responses API (`responses`), for `previous_response_id`.

vLLM keeps them in one process's memory, lost on restart; here they are rows, so a conversation
goes on after any gateway or registry restarts. Each row belongs to the key that created it
(NULL: no Shoal key) and goes with the key if the key is deleted.

Revision ID: 0010_stored_responses
Revises: 0009_run_revision
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_stored_responses"
down_revision = "0009_run_revision"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("key_id", sa.String(32), sa.ForeignKey("api_keys.id", ondelete="CASCADE"),
                  nullable=True, index=True),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("previous_response_id", sa.String(64), nullable=True),
        sa.Column("conversation", sa.JSON, nullable=False),
        sa.Column("response", sa.JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now()),
    )


def downgrade() -> None:
    op.drop_table("responses")
