"""This machine's accelerators.

- :mod:`peerd.hardware.devices`: which device names a node config may give, and which device a name means here.
- :mod:`peerd.hardware.memory`: the device memory a dense preset's inner steps need, and the micro-batch and
  activation checkpointing that make a run fit this machine.
"""
