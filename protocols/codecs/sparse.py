"""The sparse codec ``topk`` (SparseLoCo's top-k with 2-bit values) and the error feedback that keeps what it did
not send."""

from __future__ import annotations

import math

import numpy as np
import torch

from protocols.codecs.base import Buffer, Codec


class TopKCompression(Codec):
    """``"topk"``: SparseLoCo's top-k + 2-bit compressor (Sarfi et al. 2025, arXiv 2508.15706, section 3).

    The values are cut into chunks of ``chunk_size`` (default 4096; the last may be short). From a chunk of ``m``
    values the ``k = ceil(fraction * m)`` largest magnitudes are kept (default fraction 0.02; ties broken by the lower
    index, so the choice is deterministic), with ``lo`` / ``hi`` the smallest / largest kept magnitude. A kept value
    travels as its chunk-local index (uint16) and 2 bits: bit 0 = its magnitude is nearer ``hi`` than ``lo`` (a tie
    goes to ``lo``), bit 1 = negative; it decodes to ``+-lo`` or ``+-hi`` (so the error on a kept value is at most
    ``(hi - lo) / 2``); every other value decodes to 0.

    Layout (little-endian): per chunk ``lo, hi`` as fp32 (``8 * n_chunks`` bytes), then all chunks' indices as uint16,
    ascending within a chunk (``2 K`` bytes, ``K`` = total kept), then the 2-bit codes, four per byte from the low
    bits up, unused bits 0 (``ceil(K / 4)`` bytes). The size depends only on ``n``, so it is exact before decoding.
    A decoder refuses non-finite or negative magnitudes, ``lo > hi``, indices out of the chunk or not strictly
    increasing, and non-zero padding bits. Peers must agree on ``fraction`` and ``chunk_size``.
    """

    name = "topk"
    sparse = True

    def __init__(self, fraction: float = 0.02, chunk_size: int = 4096) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 1 <= chunk_size <= 65536:
            raise ValueError(f"chunk_size must be an int in [1, 65536], got {chunk_size!r}")
        self.fraction, self.chunk_size = float(fraction), chunk_size

    def _chunks(self, numel: int) -> list[tuple[int, int, int]]:
        """(start, length, k) per chunk; full chunks first, then a short last one."""
        out = []
        for start in range(0, numel, self.chunk_size):
            m = min(self.chunk_size, numel - start)
            out.append((start, m, min(m, math.ceil(self.fraction * m))))
        return out

    def kept(self, numel: int) -> int:
        """K, how many of ``numel`` values travel."""
        return sum(k for _, _, k in self._chunks(numel))

    def encoded_size(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        nchunks, kept = -(-numel // self.chunk_size), self.kept(numel)
        return 8 * nchunks + 2 * kept + (kept + 3) // 4

    def _select(self, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows (c, m) fp32 -> ascending kept indices (c, k) uint16, magnitudes (lo, hi) (c,) and 2-bit codes (c, k)."""
        order = np.argsort(-np.abs(rows), axis=1, kind="stable")[:, :k]
        idx = np.sort(order, axis=1)
        vals = np.take_along_axis(rows, idx, axis=1)
        mags = np.abs(vals)
        lo, hi = mags.min(axis=1), mags.max(axis=1)
        nearer_hi = (hi[:, None] - mags) < (mags - lo[:, None])
        codes = nearer_hi.astype(np.uint8) | ((vals < 0).astype(np.uint8) << 1)
        return idx.astype("<u2"), np.stack([lo, hi], axis=1), codes

    def _encode_flat(self, flat: torch.Tensor) -> Buffer:
        x = flat.to(torch.float32).numpy()
        numel, c = x.size, self.chunk_size
        full = numel // c
        parts = []
        if full:
            parts.append(self._select(x[: full * c].reshape(full, c), self._chunks(c)[0][2]))
        if numel % c:
            tail = x[full * c:].reshape(1, -1)
            parts.append(self._select(tail, self._chunks(tail.size)[0][2]))
        if not parts:
            return b""
        scales = np.concatenate([p[1].reshape(-1) for p in parts]).astype("<f4")
        idx = np.concatenate([p[0].reshape(-1) for p in parts])
        codes = np.concatenate([p[2].reshape(-1) for p in parts])
        codes = np.concatenate([codes, np.zeros(-codes.size % 4, dtype=np.uint8)]).reshape(-1, 4)
        packed = codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)
        return scales.tobytes() + idx.tobytes() + packed.astype(np.uint8).tobytes()

    def decode_sparse(self, buf: Buffer, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode untrusted ``buf`` (``numel`` values encoded) without densifying: ``(positions, values)``, int64
        (K,) strictly increasing positions in [0, numel) and their fp32 (K,) values (``K`` = :meth:`kept`; a value
        may be 0 where a chunk's magnitudes are 0). Raises ValueError on a wrong size or invalid metadata, as
        :meth:`decode`."""
        if isinstance(numel, bool) or not isinstance(numel, (int, np.integer)) or numel < 0:
            raise ValueError(f"numel must be an int >= 0, got {numel!r}")
        try:
            view = memoryview(buf).cast("B")
        except TypeError as e:
            raise ValueError(f"buffer must be bytes-like and contiguous: {e}") from None
        if view.nbytes != self.encoded_size(int(numel)):
            raise ValueError(f"topk: expected {self.encoded_size(int(numel))} bytes for {numel} values, "
                             f"got {view.nbytes}")
        positions, values = self._sparse(view, int(numel))
        return torch.from_numpy(positions), torch.from_numpy(values)

    def _sparse(self, view: memoryview, numel: int) -> tuple[np.ndarray, np.ndarray]:
        """Validated positions (int64, ascending) and fp32 values of a buffer of the exact size."""
        chunks = self._chunks(numel)
        kept = sum(k for _, _, k in chunks)
        scales = np.frombuffer(view, dtype="<f4", count=2 * len(chunks)).astype(np.float32).reshape(-1, 2)
        if not (np.isfinite(scales).all() and (scales >= 0).all() and (scales[:, 0] <= scales[:, 1]).all()):
            raise ValueError("topk: magnitudes must be finite, >= 0 and lo <= hi")
        idx = np.frombuffer(view, dtype="<u2", count=kept, offset=8 * len(chunks)).astype(np.int64)
        packed = np.frombuffer(view, dtype=np.uint8, offset=8 * len(chunks) + 2 * kept)
        codes = np.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], axis=1).reshape(-1)
        if codes[kept:].any():
            raise ValueError("topk: padding bits must be 0")
        codes = codes[:kept]
        lengths = np.repeat([m for _, m, _ in chunks], [k for _, _, k in chunks])
        starts = np.repeat([s for s, _, _ in chunks], [k for _, _, k in chunks])
        chunk_of = np.repeat(np.arange(len(chunks)), [k for _, _, k in chunks])
        if (idx >= lengths).any():
            raise ValueError("topk: index beyond its chunk")
        same_chunk = chunk_of[1:] == chunk_of[:-1]
        if (same_chunk & (idx[1:] <= idx[:-1])).any():
            raise ValueError("topk: indices within a chunk must be strictly increasing")
        mags = scales[chunk_of, (codes & 1).astype(np.int64)]
        return (starts + idx).astype(np.int64), np.where(codes & 2, -mags, mags).astype(np.float32)

    def _decode_flat(self, view: memoryview, numel: int, dtype: torch.dtype) -> torch.Tensor:
        positions, values = self._sparse(view, numel)
        out = np.zeros(numel, dtype=np.float32)
        out[positions] = values
        return torch.from_numpy(out).to(dtype)

    def __repr__(self) -> str:
        return f"TopKCompression(fraction={self.fraction}, chunk_size={self.chunk_size})"


class ErrorFeedback:
    """The part of a sparse codec's input that was not sent, kept locally and added to the next round's input.

    SparseLoCo (arXiv 2508.15706, Algorithm 1): ``e <- decay * e + delta``; send ``C(e)``; ``e <- e - decode(C(e))``.
    :meth:`compensate` gives the vector to send (``decay * e + delta``, fp32 (P,)); after the all-reduce,
    :meth:`record` keeps ``compensated - sent`` where ``sent`` is what the codec actually delivered (the all-reduce
    reports it: :attr:`protocols.allreduce.AllReduceResult.sent`). With ``decay = 1`` nothing is ever lost: the sum of
    everything sent plus :attr:`error` equals the sum of the deltas. The state is this peer's alone (never sent).
    """

    def __init__(self, numel: int, decay: float = 1.0) -> None:
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be an int >= 0, got {numel!r}")
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay!r}")
        self.decay = float(decay)
        self.error = torch.zeros(numel, dtype=torch.float32)  # (P,)

    def compensate(self, delta: torch.Tensor) -> torch.Tensor:
        """A new fp32 (P,) tensor ``decay * error + delta``; the state is unchanged. ValueError on a wrong shape."""
        if not isinstance(delta, torch.Tensor) or delta.shape != self.error.shape:
            raise ValueError(f"delta must have shape {tuple(self.error.shape)}")
        out = self.error * self.decay if self.decay != 1.0 else self.error.clone()
        return out.add_(delta.detach().to("cpu", torch.float32))

    def record(self, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Keep ``compensated - sent`` (both fp32 (P,)) as the error. ValueError on a wrong shape (state unchanged)."""
        for name, t in (("compensated", compensated), ("sent", sent)):
            if not isinstance(t, torch.Tensor) or t.shape != self.error.shape:
                raise ValueError(f"{name} must have shape {tuple(self.error.shape)}")
        self.error = compensated.detach().to("cpu", torch.float32) - sent.detach().to("cpu", torch.float32)

    def send(self, delta: torch.Tensor, codec: Codec) -> bytes:
        """Compensate ``delta``, encode it with ``codec`` (1-D fp32 interface), record what the bytes decode to."""
        compensated = self.compensate(delta)
        payload = codec.encode(compensated)
        self.record(compensated, codec.decode(payload, compensated.numel()))
        return payload
