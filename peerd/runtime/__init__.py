"""The daemon's process plumbing: how it logs, stops and holds its files.

- :mod:`peerd.runtime.processes`: stopping on SIGINT/SIGTERM, helper processes out of the terminal's reach, bounded
  stops of helper process trees.
- :mod:`peerd.runtime.locks`: per-daemon ``flock`` locks on state files (identity key, control socket).
- :mod:`peerd.runtime.telemetry`: logging as text or JSON lines.
- :mod:`peerd.runtime.heap`: returning freed heap memory to the operating system between rounds.
"""
