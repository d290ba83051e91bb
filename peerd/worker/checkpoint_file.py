"""Local checkpoints of a peer's training state, written atomically after every outer round.

One file per run: ``<checkpoint_dir>/<run_id>/state.safetensors``. Tensors are stored with safetensors (no pickle:
a checkpoint cannot run code when loaded); the small metadata (outer round, sampler position, run fingerprint) is
JSON in the safetensors header. Writes go to a temporary file in the same folder, are fsync'ed, then renamed over
the old file and the folder is fsync'ed, so a crash at any moment leaves either the old or the new checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

FILENAME = "state.safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used (corrupt, or from another run configuration)."""


@dataclass
class Checkpoint:
    """Tensors (name -> CPU tensor) and JSON-serializable metadata."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any]


def checkpoint_path(checkpoint_dir: str | os.PathLike, run_id: str) -> Path:
    return Path(checkpoint_dir) / run_id / FILENAME


def save_checkpoint(
    path: str | os.PathLike, checkpoint: Checkpoint, before_rename: Optional[Callable[[], None]] = None
) -> int:
    """Atomically write ``checkpoint`` to ``path``; returns the file size in bytes.

    ``before_rename`` runs after the temporary file is durable and before it replaces the old checkpoint (a seam
    for crash tests)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().contiguous() for name, t in checkpoint.tensors.items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        # written from the tensors' own memory (safetensors >= 0.8): an in-memory file first held a second copy of
        # the whole checkpoint, 20 bytes per parameter (22 GB for a 1.1B model), in host memory
        save_file(tensors, tmp, metadata={"peerd": json.dumps(checkpoint.metadata, sort_keys=True)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return size


def load_checkpoint(path: str | os.PathLike) -> Optional[Checkpoint]:
    """Read a checkpoint; None if there is none. Raises CheckpointError if the file is unreadable or corrupt.

    The tensors map the file (``safetensors.safe_open``): their pages come in from the page cache as they are used,
    a tensor changed in place gets its own copy of those pages (the file never changes), and they stay valid after a
    later checkpoint replaced the file or it was deleted (the mapping holds the old file)."""
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a crash mid-write; never published
        stale.unlink(missing_ok=True)
    if not path.exists():
        return None
    try:
        # tensor by tensor from the file (no copy of the whole file in memory first: 20 bytes per parameter)
        with safe_open(path, framework="pt") as f:
            metadata = json.loads((f.metadata() or {})["peerd"])
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, ValueError, KeyError, OSError) as e:
        raise unreadable(path, e) from None
    return Checkpoint(tensors, metadata)


def unreadable(path: Path, cause: object) -> CheckpointError:
    """The error of a checkpoint that cannot be read, with the way out: a peer without it starts from the swarm."""
    return CheckpointError(f"checkpoint {path} is unreadable ({cause}); move it away (e.g. mv {path} {path}.broken) "
                           "and the peer starts fresh from the swarm's current state")


def check_checkpoint(path: str | os.PathLike) -> None:
    """Check that the checkpoint at ``path`` can be loaded, reading its header and sizes but not its tensors (a
    truncated or overwritten file fails here; safetensors has no checksum of the values). Raises CheckpointError
    (:func:`unreadable`)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header_len = int.from_bytes(f.read(8), "little")
            if not 2 <= header_len <= min(size - 8, 100 * 2**20):
                raise ValueError(f"header of {header_len} bytes in a file of {size}")
            header = json.loads(f.read(header_len))
        metadata = json.loads(header["__metadata__"]["peerd"])
        if not isinstance(metadata, dict):
            raise ValueError("metadata is not a table")
        end = max((int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"),
                  default=0)
        if 8 + header_len + end != size:
            raise ValueError(f"{size} bytes, the header describes {8 + header_len + end}")
    except (ValueError, KeyError, TypeError, IndexError, OSError) as e:
        raise unreadable(path, e) from None


#: Prefix of an optimizer's per-parameter state tensors in a checkpoint: ``inner.<param index>.<state key>``.
OPTIMIZER_PREFIX = "inner."


def optimizer_tensors(optimizer: torch.optim.Optimizer, to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """The per-parameter state of ``optimizer`` (e.g. AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``) named
    ``inner.<index>.<key>``, for :func:`save_checkpoint`: CPU tensors (copies of those on a GPU), or with ``to_cpu``
    False the optimizer's own tensors where they live (the caller copies them before the next step changes them)."""
    out = {f"{OPTIMIZER_PREFIX}{index}.{key}": torch.as_tensor(value).detach()
           for index, state in optimizer.state_dict()["state"].items() for key, value in state.items()}
    return {name: t.cpu() for name, t in out.items()} if to_cpu else out


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                           device: torch.device) -> None:
    """Restore what :func:`optimizer_tensors` saved (moments onto ``device``; ``step`` stays where the optimizer
    keeps it). Raises ValueError/KeyError/RuntimeError if the tensors do not fit the optimizer's parameters."""
    state = optimizer.state_dict()
    inner: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith(OPTIMIZER_PREFIX):
            _, index, key = name.split(".", 2)
            inner.setdefault(int(index), {})[key] = value.to(device) if key != "step" else value
    state["state"] = inner
    optimizer.load_state_dict(state)

