"""Checks ``peerd join`` makes before it touches the network: this node's options against the run's config, and the
local checkpoint it would resume from.

A failure here costs the user nothing: no DHT node was started and no run config was published, so a typo in a flag
or a damaged file is reported in one line (exit 2 for options, 1 for the file) instead of after joining the swarm.
The same option checks run again once a joiner without ``--run-config`` has read the run's config from the DHT.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from peerd.worker.checkpoint_file import check_checkpoint, checkpoint_path
from peerd.config import ConfigError, NodeConfig
from peerd.run_config import RunConfig


def node_run_error(node: NodeConfig, run: RunConfig) -> Optional[ConfigError]:
    """Why this node cannot take part in ``run`` as configured (``--stage``, ``--local-devices``,
    ``--micro-batch-size``), as a ConfigError naming the key, or None if it can."""
    from peerd.worker.inner_step import micro_batch_count
    from peerd.worker.local_dp import LocalDevicesError, slice_size

    if node.stage is not None and run.stage_error(node.stage):
        return ConfigError(run.stage_error(node.stage), key="stage")
    if len(node.local_devices) > 1:
        if run.parallelism != "diloco":
            return ConfigError(f"local_devices: the run is a {run.parallelism} run; several local devices as one peer"
                               " are supported for DiLoCo runs only", key="local_devices")
        try:
            slice_size(run.batch_size, len(node.local_devices), node.micro_batch_size)
        except LocalDevicesError as e:
            return ConfigError(f"local_devices: {e}", key="local_devices")
        return None
    try:
        micro_batch_count(run.batch_size, node.micro_batch_size)
    except ValueError:
        divisors = [d for d in range(1, run.batch_size + 1) if run.batch_size % d == 0]
        return ConfigError(f"micro_batch_size ({node.micro_batch_size}, --micro-batch-size) must divide the run's "
                           f"batch_size ({run.batch_size}): use one of {', '.join(map(str, divisors))} (or 0 for the "
                           "whole batch)", key="micro_batch_size")
    return None


def check_node_against_run(node: NodeConfig, run: RunConfig) -> None:
    """Raise :func:`node_run_error`'s ConfigError if there is one."""
    error = node_run_error(node, run)
    if error is not None:
        raise error


def check_local_checkpoint(node: NodeConfig, run_name: str) -> Optional[Path]:
    """The checkpoint ``join`` would resume from (``<checkpoint_dir>/<run>/state.safetensors``), or None if there is
    none. Raises CheckpointError naming the file and the way out if it cannot be read (:func:`check_checkpoint`)."""
    path = checkpoint_path(node.checkpoint_path, run_name)
    if not path.exists():
        return None
    check_checkpoint(path)
    return path

