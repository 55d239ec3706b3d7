"""``python -m silentswarm.agent.runtime.glue``: see :mod:`silentswarm.agent.runtime.glue.cli`."""

from silentswarm.agent.runtime.glue.cli import main

raise SystemExit(main())
