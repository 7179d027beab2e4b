"""API key scopes and limits, usage per key/model/day, shared rate-limit windows.

Keys made before scopes existed become admin keys (they could do everything), so nothing that
worked stops working.

Revision ID: 0002_key_scopes
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002_key_scopes"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("scope", sa.String(16), nullable=False,
                                        server_default="admin"))
    op.add_column("api_keys", sa.Column("limits", sa.JSON, nullable=False,
                                        server_default=sa.text("'[]'")))
    op.create_table(
        "api_key_usage",
        sa.Column("key_id", sa.String(32), sa.ForeignKey("api_keys.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("model", sa.String(64), primary_key=True),
        sa.Column("day", sa.Date, primary_key=True),
        *(sa.Column(name, sa.BigInteger, nullable=False, server_default="0")
          for name in ("requests", "prompt_tokens", "cached_tokens", "output_tokens")),
    )
    op.create_table(
        "rate_windows",
        sa.Column("key_id", sa.String(32), sa.ForeignKey("api_keys.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("model", sa.String(64), primary_key=True),
        sa.Column("window", sa.BigInteger, primary_key=True),
        sa.Column("requests", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("tokens", sa.BigInteger, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_table("rate_windows")
    op.drop_table("api_key_usage")
    op.drop_column("api_keys", "limits")
    op.drop_column("api_keys", "scope")
