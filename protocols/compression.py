"""Former home of the wire codecs; they live in :mod:`protocols.codecs` (N-D tensors, dtype and shape carried).

Kept as a re-export so that existing imports keep working.
"""

from protocols.codecs import (  # noqa: F401
    CODECS,
    BFloat16Compression,
    Codec,
    Float16Compression,
    Int8Compression,
    NoCompression,
    all_finite,
    get_codec,
)

__all__ = ["CODECS", "BFloat16Compression", "Codec", "Float16Compression", "Int8Compression", "NoCompression",
           "all_finite", "get_codec"]
