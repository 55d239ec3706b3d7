"""``python -m agent.runtime.glue``: see :mod:`agent.runtime.glue.cli`."""

from agent.runtime.glue.cli import main

raise SystemExit(main())
