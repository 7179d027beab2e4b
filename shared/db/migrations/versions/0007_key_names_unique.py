"""API key names are unique among keys not revoked (`shoal keys revoke NAME` and `keys update NAME`
must mean one key).

Before this, names could repeat, and a name meant the first match. Keys that share a name with an
older key not revoked are renamed here, the oldest keeping it: `NAME-2`, `NAME-3`, ... (shortened
to fit 63 characters; the first free one). Their ids, secrets, scopes, limits and usage are
unchanged; `shoal keys list` shows the new names. A revoked key keeps its name, which a new key
may take again (rotation).

Revision ID: 0007_key_names_unique
Revises: 0006_usage_batches
"""

import sqlalchemy as sa
from alembic import op

revision = "0007_key_names_unique"
down_revision = "0006_usage_batches"
branch_labels = None
depends_on = None
INDEX = "uq_api_keys_active_name"
MAX_NAME = 63


def _free_name(base: str, taken: set[str]) -> str:
    for n in range(2, 10**6):
        suffix = f"-{n}"
        name = base[:MAX_NAME - len(suffix)] + suffix
        if name not in taken:
            return name
    raise RuntimeError(f"no free name for API key {base!r}")


def upgrade() -> None:
    conn = op.get_bind()
    rows = conn.execute(sa.text(
        "SELECT id, name, revoked_at IS NULL AS active FROM api_keys "
        "ORDER BY created_at, id")).all()
    taken = {row.name for row in rows}
    seen: set[str] = set()
    for row in rows:
        if not row.active:
            continue
        if row.name in seen:
            name = _free_name(row.name, taken)
            taken.add(name)
            conn.execute(sa.text("UPDATE api_keys SET name = :name, version = version + 1 "
                                 "WHERE id = :id"), {"name": name, "id": row.id})
        else:
            seen.add(row.name)
    op.create_index(INDEX, "api_keys", ["name"], unique=True,
                    postgresql_where=sa.text("revoked_at IS NULL"))


def downgrade() -> None:
    op.drop_index(INDEX, table_name="api_keys")
