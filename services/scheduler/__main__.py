"""`python -m shoal.services.scheduler`: run the scheduler in the foreground (SIGTERM stops it)."""

from __future__ import annotations

import sys

from shoal.cli.runner import resolve_settings, run_service
from shoal.services.scheduler.replica import run_scheduler


def main() -> int:
    return run_service("scheduler", run_scheduler, resolve_settings())


if __name__ == "__main__":
    sys.exit(main())
