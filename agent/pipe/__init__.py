"""The data-plane mechanic: frames, codecs and links.

Imports nothing of SilentSwarm and no TensorFlow; subjects, addresses and callbacks are injected.
"""
