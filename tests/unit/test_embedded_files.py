"""The embedded servers' secrets: made once, kept 0600, never printed."""

from __future__ import annotations

from pathlib import Path

from shoal.shared.embedded import Credentials, read_stack_file, redact_url, write_stack_file


def test_credentials_are_made_once_and_private(tmp_path: Path) -> None:
    first = Credentials.load_or_create(tmp_path)
    assert (tmp_path / "credentials.json").stat().st_mode & 0o777 == 0o600
    assert Credentials.load_or_create(tmp_path) == first
    assert len(first.nats_password) >= 24 and first.nats_password != first.postgres_password


def test_stack_file_is_private(tmp_path: Path) -> None:
    write_stack_file(tmp_path / "stack.json", "nats://u:p@h:1", "postgresql://u:p@/db", pid=1)
    assert (tmp_path / "stack.json").stat().st_mode & 0o777 == 0o600
    assert read_stack_file(tmp_path / "stack.json")["pid"] == 1


def test_urls_are_redacted() -> None:
    assert redact_url("nats://shoal:s3cret@127.0.0.1:4222") == "nats://shoal:***@127.0.0.1:4222"
    assert redact_url("postgresql://postgres:s3cret@/postgres?host=/x") == \
        "postgresql://postgres:***@/postgres?host=/x"
    assert redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
