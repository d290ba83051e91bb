"""Compute limits a volunteer sets in the node config, applied before a role allocates anything.

``threads`` caps torch's intra-op (and, when still possible, inter-op) thread pools; ``gpu_memory_fraction`` caps
this process's share of the GPU's memory through the CUDA caching allocator (an allocation past it raises an
out-of-memory error instead of crowding out the volunteer's own programs). Bandwidth caps live in
:mod:`peerd.transport.pacing`, active hours in :mod:`peerd.service.schedule`.
"""

from __future__ import annotations

import logging
from typing import Any

from peerd.config import ConfigError

logger = logging.getLogger(__name__)


def apply_cpu_threads(threads: int, torch_module: Any = None) -> None:
    """Cap torch's thread pools at ``threads`` (0 = leave torch's defaults)."""
    if not threads:
        return
    torch = torch_module or __import__("torch")
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # only allowed before the first inter-op parallel work; the intra-op cap is what matters
        pass


def apply_gpu_memory_fraction(fraction: float, device: Any, torch_module: Any = None) -> bool:
    """Cap this process's CUDA memory on ``device`` at ``fraction`` of the GPU; True if applied.

    No-op (False) for 0 or a CPU device. Raises ConfigError for a fraction outside (0, 1].
    """
    if not fraction:
        return False
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"gpu_memory_fraction must be in (0, 1], got {fraction}")
    torch = torch_module or __import__("torch")
    device = torch.device(device)
    if device.type != "cuda":
        logger.info("gpu_memory_fraction %.2f ignored: training on %s", fraction, device)
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    total = torch.cuda.get_device_properties(index).total_memory
    logger.info("GPU %d: this process may allocate at most %.0f%% of %.1f GB", index, 100 * fraction, total / 1e9,
                extra={"event": "gpu_limit", "fraction": fraction, "device": str(device)})
    return True
