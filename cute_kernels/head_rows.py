"""What the small kernels that move whole token rows share (cache_append.py,
row_gaps.py): a row holds every head's head_dim (K, dQ) or head_dim_v (V)
values, which they copy or write in 16-byte pieces, so both head dims must
be whole pieces."""

from __future__ import annotations

THREADS = 128
PIECE_BYTES = 16


class HeadRowKernel:
    """One compiled kernel per (dtype, head_dim, head_dim_v); `piece` is the
    elements of a 16-byte piece."""

    def __init__(self, dtype, head_dim: int, head_dim_v: int):
        self.piece = PIECE_BYTES * 8 // dtype.width
        for name, dim in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
            if dim % self.piece:
                raise ValueError(f"{name}: expected a multiple of {self.piece} ({PIECE_BYTES} "
                                 f"bytes of {dtype}), got {dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
