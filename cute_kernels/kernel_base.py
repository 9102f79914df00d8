"""What the SM90 attention kernels share on the host side: the static
description every compiled kernel carries, the torch-order to kernel-order
view of a tensor, and the TMA partition of a (staged) shared-memory buffer."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from .config import PLAIN_SCORES, WARPGROUP_THREADS, ScoreMods

SMEM_ALIGN = 1024  # the 128 B swizzle pattern repeats every 1 KB


def permute(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    """A view of t with its modes reordered (no data moves)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, modes))


def tma_views(atom, s: cute.Tensor, g: cute.Tensor, staged: bool):
    """(smem view, gmem view) of a TMA copy; staged tensors keep their last mode."""
    s_rank = cute.rank(s) - 1 if staged else cute.rank(s)
    g_rank = cute.rank(g) - 1 if staged else cute.rank(g)
    return cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                 cute.group_modes(s, 0, s_rank), cute.group_modes(g, 0, g_rank))


def tma_store_tile(atom, s: cute.Tensor, g: cute.Tensor) -> None:
    """Issue one TMA store of the shared-memory tile s to the global tile g
    (one thread's worth: call it from a single warp)."""
    s_view, g_view = tma_views(atom, s, g, staged=False)
    cute.copy(atom, s_view, g_view)


def mma_operand_view(mem_range, layout: cute.ComposedLayout, dtype) -> cute.Tensor:
    """A SharedStorage field as a swizzled tensor for WGMMA operands, its base
    address made opaque to LLVM (passed through make_warp_uniform's shuffle).

    As `dynamic smem + constant`, the address is one that LLVM's
    CodeGenPrepare sinks into every block using it, to fold into addressing
    modes; the WGMMA descriptors derived from it (shift, mask, or) then get
    rebuilt at every main-loop step instead of once: 4-5 uniform
    instructions per operand and step (forward d=128 128x128 K/V step: 470
    SASS instructions, 456 with these views; fa4: 457)."""
    address = cute.arch.make_warp_uniform(mem_range.data_ptr().toint())
    base = cute.make_ptr(dtype, address, cute.AddressSpace.smem, assumed_align=SMEM_ALIGN)
    return cute.make_tensor(cute.recast_ptr(base, layout.inner), layout.outer)


class Sm90AttentionKernel:
    """One compiled kernel per (dtype, head_dim, head_dim_v, causal, score
    mods, config); head_dim is that of q and k, head_dim_v that of v and o
    (None: the same). The config (FwdConfig or BwdConfig) is validated before
    anything is traced."""

    def __init__(self, dtype, head_dim: int, causal: bool, config, head_dim_v: int | None = None,
                 mods: ScoreMods = PLAIN_SCORES):
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        config.validate(head_dim, head_dim_v)
        if causal and mods.local:
            raise ValueError("mods.local: expected False for a causal kernel (a causal window "
                             "is a local kernel with window_right = 0), got True")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.mods = mods
        self.cfg = config
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.consumer_wgs = config.consumer_warpgroups
        self.consumer_threads = WARPGROUP_THREADS * self.consumer_wgs
