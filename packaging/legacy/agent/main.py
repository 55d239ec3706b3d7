"""``python -m agent.main``: where a fellow of the old layout re-execs after an UPDATE.

Up to 0.1 the agent was the top-level package ``agent``, and its UPDATE re-execs
``python -P -m agent.main`` once pip has installed the leader's package. This module runs
the agent of the one package, ``silentswarm.agent``, in that process (same pid, same
arguments). It is a namespace portion (no ``__init__.py``): it never shadows another
distribution's ``agent`` package, which Python would import first.
"""

from silentswarm.agent.main import main

main()
