"""The only TensorFlow code: model, data, stage loop and schedule, trainable compression.

It runs in its own process (``swarm-stage``), started by the runner or by hand.
"""
