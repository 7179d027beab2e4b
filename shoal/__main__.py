"""`python -m shoal ...` is the `shoal` command."""

from shoal.cli import main

raise SystemExit(main())
