"""SilentSwarm: pipeline-parallel transformer training across heterogeneous machines."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("silentswarm")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+src"
