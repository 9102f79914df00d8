"""What the SM90 attention kernels share: the static description every
compiled kernel carries, the torch-order to kernel-order view of a tensor,
the TMA partition of a (staged) shared-memory buffer, and the two ways a
shared-memory tile leaves for global memory (one TMA store, or row by row
where the tile ends past its sequence)."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from .config import PLAIN_FEATURES, WARPGROUP_THREADS, Features

SMEM_ALIGN = 1024  # the 128 B swizzle pattern repeats every 1 KB


def permute(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    """A view of t with its modes reordered (no data moves)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, modes))


def tma_views(atom, s: cute.Tensor, g: cute.Tensor, staged: bool,
              g_tile_modes: int | None = None):
    """(smem view, gmem view) of a TMA copy; staged tensors keep their last
    mode, or the gmem view all after its first g_tile_modes (a paged cache's
    blocks per page and pages)."""
    s_rank = cute.rank(s) - 1 if staged else cute.rank(s)
    g_rank = cute.rank(g) - 1 if staged else cute.rank(g)
    if g_tile_modes is not None:
        g_rank = g_tile_modes
    return cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                 cute.group_modes(s, 0, s_rank), cute.group_modes(g, 0, g_rank))


def tma_store_tile(atom, s: cute.Tensor, g: cute.Tensor) -> None:
    """Issue one TMA store of the shared-memory tile s to the global tile g
    (one thread's worth: call it from a single warp)."""
    s_view, g_view = tma_views(atom, s, g, staged=False)
    cute.copy(atom, s_view, g_view)


def _row_copy_threads(tile_rows: int, pieces: int, threads: int) -> tuple[int, int]:
    """(threads per row, threads used) of store_rows: a row's 16-byte pieces
    spread over threads that divide them, as many rows at once as divide
    the tile's."""
    lanes_per_row = math.gcd(pieces, 32)
    used = threads
    while tile_rows % (used // lanes_per_row):
        used //= 2
    return lanes_per_row, used


@cute.jit
def store_rows(s: cute.Tensor, g: cute.Tensor, rows: Int32, thread: Int32,
               threads: cutlass.Constexpr[int]):
    """Copy rows [0, rows) of the shared-memory tile s (R, C), swizzled or
    not, to the global tile g of the same shape, 16 bytes per copy, by
    `threads` threads (thread in [0, threads)). For a tile that ends past
    its sequence in a packed batch, where a TMA store, which clips only at
    the tensor's end, would write over the next sequence's rows."""
    vec = 128 // s.element_type.width
    tile_rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
    lanes_per_row, used = _row_copy_threads(tile_rows, cols // vec, threads)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), s.element_type,
                               num_bits_per_copy=128)
    tiled = cute.make_tiled_copy_tv(
        atom, cute.make_ordered_layout((used // lanes_per_row, lanes_per_row), order=(1, 0)),
        cute.make_layout((1, vec)))
    if thread < used:
        thr = tiled.get_slice(thread)
        src, dst = thr.partition_S(s), thr.partition_D(g)
        coords = thr.partition_S(cute.make_identity_tensor((tile_rows, cols)))
        for m in cutlass.range_constexpr(cute.size(src, mode=[1])):
            if coords[0, m, 0][0] < rows:
                cute.copy(atom, src[None, m, None], dst[None, m, None])


def mma_operand_view(mem_range, layout: cute.ComposedLayout, dtype) -> cute.Tensor:
    """A SharedStorage field as a swizzled tensor for WGMMA operands, its base
    address made opaque to LLVM (passed through make_warp_uniform's shuffle).

    As `dynamic smem + constant`, the address is one that LLVM's
    CodeGenPrepare sinks into every block using it, to fold into addressing
    modes; the WGMMA descriptors derived from it (shift, mask, or) then get
    rebuilt at every main-loop step instead of once: 4-5 uniform
    instructions per operand and step (forward d=128 128x128 K/V step: 470
    SASS instructions, 456 with these views; fa4: 457)."""
    return mma_operand_at(mem_range.data_ptr().toint(), layout, dtype)


def mma_operand_at(address: Int32, layout: cute.ComposedLayout, dtype) -> cute.Tensor:
    """mma_operand_view's tensor at a shared-memory address: one stage of a
    ring whose stage changes per tile, its address made opaque after the
    stage's offset is added (else LLVM sinks that addition, and the
    descriptors after it, into every main-loop step)."""
    # The mask is no change to an SMEM_ALIGN-aligned address, and tells LLVM
    # the alignment that the shuffle hides: the K blocks of one swizzle atom
    # then offset the WGMMA descriptor by an or, not by a 64-bit add, which
    # ptxas (CUDA 13) may do in vector registers at every main-loop step.
    address = cute.arch.make_warp_uniform(address) & Int32(-SMEM_ALIGN)
    base = cute.make_ptr(dtype, address, cute.AddressSpace.smem, assumed_align=SMEM_ALIGN)
    return cute.make_tensor(cute.recast_ptr(base, layout.inner), layout.outer)


def mma_operand_parts_at(address: Int32, layout: cute.ComposedLayout, dtype) -> list[cute.Tensor]:
    """mma_operand_at once per swizzle atom along K (the layout's second
    mode), each tensor at its atom's first column: a K block is then within
    SMEM_ALIGN of its tensor's base address. One opaque base for all atoms
    would have the later atoms' descriptors made by 64-bit adds, which
    ptxas (CUDA 13) keeps in vector registers and moves to uniform ones
    before every WGMMA (wgmma.AtomParts reads the parts)."""
    k_mode = layout.outer.shape[1]
    atom_cols = k_mode[0] if isinstance(k_mode, tuple) else k_mode
    parts = []
    for col in range(0, cute.size(k_mode), atom_cols):
        offset = cute.crd2idx((0, col), layout.outer) * dtype.width // 8
        assert offset % SMEM_ALIGN == 0, f"swizzle atom at {offset} B, not {SMEM_ALIGN}-aligned"
        parts.append(mma_operand_at(address + offset, layout, dtype))
    return parts


class Sm90AttentionKernel:
    """One compiled kernel per (dtype, head_dim, head_dim_v, causal, score
    features, config); head_dim is that of q and k, head_dim_v that of v and o
    (None: the same). The config (FwdConfig or BwdConfig) is validated before
    anything is traced."""

    def __init__(self, dtype, head_dim: int, causal: bool, config, head_dim_v: int | None = None,
                 features: Features = PLAIN_FEATURES):
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        if dtype is cutlass.Float8E4M3FN:  # the forward's e4m3 inputs
            config.validate(head_dim, head_dim_v, fp8=True)
        else:
            config.validate(head_dim, head_dim_v)
        if causal and features.local:
            raise ValueError("features.local: expected False for a causal kernel (a causal window "
                             "is a local kernel with window_right = 0), got True")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.features = features
        self.cfg = config
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.consumer_wgs = config.consumer_warpgroups
        self.consumer_threads = WARPGROUP_THREADS * self.consumer_wgs
