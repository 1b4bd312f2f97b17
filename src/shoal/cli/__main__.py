"""``python -m shoal.cli``: the ``shoal`` command line."""

from __future__ import annotations

from shoal.cli.main import main

raise SystemExit(main())
