"""The ``swarm`` commands, one module per subject; each module's ``register(app)`` adds its
commands to the app (:mod:`silentswarm.cli.app` assembles them)."""
