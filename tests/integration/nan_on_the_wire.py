"""A real ``peerd`` peer that puts NaN on the wire (RELIABILITY row B2), run as its own process.

The ``corrupt(how="nan")`` fault of its ``PEERD_FAULTS`` schedule is applied to the encoded slices it sends to the
other reducers instead of to its pseudo-gradient. An unmodified peer never sends NaN: its own codec refuses to encode
non-finite values (``peerd`` then dies with "cannot encode non-finite values"), so the honest reducers' checks would
never be reached. A hostile peer skips its own checks; this one does the same. Its own part is reduced honestly. The
fault is logged and counted as usual (a ``fault`` event with ``where="wire"``), once per round it is due.

Usage: ``python tests/integration/nan_on_the_wire.py join ...`` (the arguments of ``peerd``).
"""

from __future__ import annotations

import sys

import numpy as np

from peerd.commands.main import main
from peerd.testing.faults import Faults
from protocols.allreduce import ButterflyAllReduce

_NAN_DTYPES = {"none": "<f4", "fp16": "<f2"}
_armed = False  # a corrupt(how="nan") fault is due in the round being averaged
_transform = Faults.transform_pseudo_gradient
_encode_part = ButterflyAllReduce._encode_part


def transform_pseudo_gradient(self: Faults, tensor):
    global _armed
    fault = self._due("corrupt")
    _armed = fault is not None and fault.how == "nan"
    if not _armed:
        return _transform(self, tensor)
    self._fire(fault, how=fault.how, where="wire")
    return tensor


def encode_part(self: ButterflyAllReduce, part) -> bytes:
    encoded = _encode_part(self, part)
    if not _armed:
        return encoded
    if self.codec.name not in _NAN_DTYPES:
        raise ValueError(f"NaN on the wire is implemented for codecs {sorted(_NAN_DTYPES)}, not {self.codec.name!r}")
    return np.full(part.numel(), np.nan, dtype=_NAN_DTYPES[self.codec.name]).tobytes()


if __name__ == "__main__":
    Faults.transform_pseudo_gradient = transform_pseudo_gradient
    ButterflyAllReduce._encode_part = encode_part
    sys.exit(main(sys.argv[1:]))
