"""Training devices: which names a node config may give (checked without torch, at config time) and which device a
name means on this machine (checked with torch when the node starts; a device that is not there is one line).

Names: ``auto`` (a CUDA GPU if torch sees one, else Apple's MPS if present, else the CPU), ``cpu``, ``cuda`` (the
current CUDA GPU), ``cuda:N``, ``mps`` (Apple silicon's GPU through Metal; it has one device). ROCm builds of torch
show AMD GPUs as ``cuda`` devices (``torch.version.hip`` is set), so ``cuda``/``cuda:N`` name them too. Several
GPUs of one machine as one peer: a list, ``["cuda:0", "cuda:1"]`` (``cuda:0,cuda:1`` on the command line or in
``PEERD_DEVICE``), which is :attr:`peerd.config.NodeConfig.local_devices` (:mod:`peerd.worker.local_dp`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

#: What ``device`` accepts, for error messages.
DEVICE_NAMES = "auto, cpu, cuda, cuda:N, mps, or a list of cuda:N (several GPUs as one peer)"

#: Names people type for a GPU that torch spells otherwise: the hint that goes with the refusal.
_HINTS = {
    "gpu": "use cuda (or auto)",
    "rocm": "ROCm builds of torch show AMD GPUs as cuda devices: use cuda or cuda:N",
    "hip": "ROCm builds of torch show AMD GPUs as cuda devices: use cuda or cuda:N",
    "amd": "ROCm builds of torch show AMD GPUs as cuda devices: use cuda or cuda:N",
    "metal": "Apple's GPU is mps",
    "apple": "Apple's GPU is mps",
}


class DeviceUnavailable(RuntimeError):
    """The node config names a device this machine (or this build of torch) does not have; the message is one line
    that says what there is."""


def split_devices(value: Union[str, Sequence[Any]]) -> tuple[Any, ...]:
    """``"cuda:0,cuda:1"`` or ``["cuda:0", "cuda:1"]`` -> ``("cuda:0", "cuda:1")``; one name -> a tuple of one.
    Entries of a list are kept as given (:func:`device_problem` judges them)."""
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def device_problem(device: Any) -> Optional[str]:
    """Why ``device`` (one name) is no device name, or None. Checks no device (no torch import)."""
    if not isinstance(device, str):
        return f"must be {DEVICE_NAMES}, got {device!r}"
    if device in ("auto", "cpu", "cuda", "mps"):
        return None
    kind, colon, index = device.partition(":")
    if colon and kind == "cuda":
        return None if index.isdigit() else f"cuda:N takes a GPU index (cuda:0, cuda:1, ...), got {device!r}"
    if colon and kind == "mps":
        return None if index == "0" else f"mps has one device (mps or mps:0), got {device!r}"
    hint = _HINTS.get(kind.lower())
    return f"must be {DEVICE_NAMES}, got {device!r}" + (f": {hint}" if hint else "")


def _torch(torch_module: Any = None) -> Any:
    if torch_module is not None:
        return torch_module
    import torch

    return torch


def _mps_available(torch: Any) -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def gpu_backend(torch_module: Any = None) -> str:
    """How this build of torch reaches GPUs: ``"ROCm (HIP 6.2.4)"`` for a ROCm build, ``"CUDA 12.4"`` for a CUDA
    build, ``"no GPU support"`` for a CPU-only build."""
    torch = _torch(torch_module)
    hip = getattr(torch.version, "hip", None)
    if hip:
        return f"ROCm (HIP {hip})"
    cuda = getattr(torch.version, "cuda", None)
    return f"CUDA {cuda}" if cuda else "no GPU support"


def resolve_device(device: str, torch_module: Any = None) -> Any:
    """The ``torch.device`` that the name ``device`` means on this machine.

    ``auto``: the current CUDA (or ROCm) GPU, else MPS, else the CPU. ``cuda:N`` must exist (N < the GPU count);
    ``mps`` needs a torch built with MPS on a Mac that has it.

    Raises:
        DeviceUnavailable: the device is not there (one line saying what is).
        ValueError: ``device`` is no device name (:func:`device_problem`).
    """
    problem = device_problem(device)
    if problem:
        raise ValueError(f"device {problem}")
    torch = _torch(torch_module)
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if _mps_available(torch) else "cpu")
    kind = device.partition(":")[0]
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"device {device}: torch sees no CUDA or ROCm GPU on this machine (torch "
                                    f"{torch.__version__}, {gpu_backend(torch)}); use device = \"cpu\" or \"auto\", "
                                    "or install a GPU build of torch")
        count = torch.cuda.device_count()
        index = int(device[5:]) if ":" in device else None
        if index is not None and index >= count:
            have = ", ".join(f"cuda:{i}" for i in range(count))
            raise DeviceUnavailable(f"device {device}: this machine has {count} GPU{'s' if count != 1 else ''} "
                                    f"({have})")
    if kind == "mps" and not _mps_available(torch):
        mps = getattr(torch.backends, "mps", None)
        why = ("this build of torch has no MPS support" if mps is None or not mps.is_built()
               else "MPS is not available on this machine (Apple silicon and macOS 12.3 or newer)")
        raise DeviceUnavailable(f"device {device}: {why}; use device = \"cpu\" or \"auto\"")
    return torch.device(device)


def describe_device(device: Any, torch_module: Any = None) -> str:
    """One line for logs and ``peerd doctor``: ``cuda:0 (NVIDIA H100 80GB HBM3, 79.1 GiB, CUDA 12.4)``,
    ``cuda:0 (AMD Instinct MI300X, 191.5 GiB, ROCm (HIP 6.2.4))``, ``mps (Apple GPU)``, ``cpu``."""
    torch = _torch(torch_module)
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return f"cuda:{index} ({props.name}, {props.total_memory / 2**30:.1f} GiB, {gpu_backend(torch)})"
    if device.type == "mps":
        return "mps (Apple GPU)"
    return str(device)


def off_the_round(setting: Optional[bool], device: Any) -> bool:
    """Whether work that can leave a round boundary's path (node ``background_checkpoint``, ``background_eval``)
    runs in the background: ``setting`` where the node sets it, else where a GPU trains (``device``, a
    ``torch.device``, is not the CPU), where the boundary would idle the accelerator; on a CPU the background work
    would take the inner steps' own cores."""
    return bool(setting) if setting is not None else device.type != "cpu"
