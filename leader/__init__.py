"""The SilentSwarm leader: control plane and operator API. Never imports TensorFlow."""
