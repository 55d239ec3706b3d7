"""The ``swarm`` command line: thin commands over the leader's HTTP API."""
