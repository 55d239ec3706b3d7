"""The SilentSwarm fellow agent."""
