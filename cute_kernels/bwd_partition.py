"""How the backward's GEMMs are split across its consumer warpgroups, by
BwdConfig: the tiled MMAs of the scores (Sᵀ/dPᵀ, or S/dP with keys_on_n),
dK/dV and dQ, their operands, and the stages of the 16-bit (tile_n, tile_m)
ring that hands dSᵀ (and where shared, Pᵀ) from one GEMM to the next. The
main kernel (bwd_sm90.py) and the dQ postprocess (bwd_pre_post.py), which
reads the accumulator in dQ's MMA layout, share them."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass.cute as cute

from . import wgmma
from .config import WARPGROUP_THREADS
from .bwd_config import BwdConfig


def dq_tiled_mma(dtype, config: BwdConfig, head_dim: int):
    """dQ = dS·K with dS (tile_m x tile_n) and Kᵀ read MN-major from shared
    memory, or with BwdConfig.dq_transposed dQᵀ = Kᵀ·dSᵀ (head_dim x tile_m),
    both operands MN-major. The postprocess partitions the dQ accumulator
    with this same MMA."""
    wgs = config.dq_warpgroups
    if config.dq_transposed():
        return wgmma.tiled_mma(dtype, False, False, (wgs, 1, 1), config.tile_m)
    if config.dq_split_m():
        return wgmma.tiled_mma(dtype, False, False, (wgs, 1, 1), head_dim)
    return wgmma.tiled_mma(dtype, False, False, (1, wgs, 1), head_dim // wgs)


def dq_gemm_shape(config: BwdConfig, head_dim: int) -> tuple[int, int]:
    """The (M, N) that dq_tiled_mma computes: (tile_m, head_dim), or
    (head_dim, tile_m) when dQ is transposed."""
    if config.dq_transposed():
        return head_dim, config.tile_m
    return config.tile_m, head_dim


def score_shape(config: BwdConfig) -> tuple[int, int]:
    """The (M, N) of the score GEMMs: (keys, queries), or with keys_on_n
    (queries, keys)."""
    if config.keys_on_n:
        return config.tile_m, config.tile_n
    return config.tile_n, config.tile_m


def dkv_shape(config: BwdConfig, dim: int) -> tuple[int, int]:
    """The (M, N) of the dK (dim = head_dim) or dV (head_dim_v) accumulator:
    (keys, dim), or transposed with keys_on_n."""
    if config.keys_on_n:
        return dim, config.tile_n
    return config.tile_n, dim


def sdp_tiled_mma(dtype, config: BwdConfig, tile_m: int):
    """Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (keys on M): each warpgroup its 64 keys and
    all tile_m queries, or with dim_split the shared 64 keys and its share of
    the queries; with keys_on_n S = Q·Kᵀ and dP = dO·Vᵀ, each warpgroup all
    queries and its share of the keys."""
    if config.keys_on_n:
        return wgmma.tiled_mma(dtype, True, True, (1, 2, 1), config.tile_n // 2)
    if config.dim_split > 1:
        return wgmma.tiled_mma(dtype, True, True, (1, config.dim_split, 1),
                               tile_m // config.dim_split)
    return wgmma.tiled_mma_ss(dtype, config.consumer_warpgroups, tile_m)


def dkv_tiled_mma(dtype, config: BwdConfig, dim: int):
    """dK += dSᵀ·Q (dim = head_dim) or dV += Pᵀ·dO (dim = head_dim_v), Q and
    dO read MN-major: Pᵀ / dSᵀ from registers, each warpgroup its keys, or
    with dim_split from shared memory, each warpgroup its share of dim; with
    keys_on_n dKᵀ += Qᵀ·dS and dVᵀ += dOᵀ·P, Qᵀ and dOᵀ MN-major, dS and P
    (stored as dSᵀ, Pᵀ) K-major, each warpgroup all of dim for its keys."""
    if config.keys_on_n:
        return wgmma.tiled_mma(dtype, False, True, (1, 2, 1), config.tile_n // 2)
    if config.dim_split > 1:
        return wgmma.tiled_mma(dtype, True, False, (1, config.dim_split, 1),
                               dim // config.dim_split)
    return wgmma.tiled_mma_rs(dtype, config.consumer_warpgroups, dim)


def pt_buffer(config: BwdConfig, ds_buffer):
    """The stage of the (tile_n, tile_m) ring that holds Pᵀ beside dSᵀ's stage
    ds_buffer (BwdConfig.score_buffers: dSᵀ's stages first)."""
    if config.keys_on_n:
        return config.ds_buffers
    return 2 + ds_buffer


@dataclass
class Operands:
    """One consumer warpgroup's WGMMA operands, named by the GEMM they feed
    (_a, _b): the scores (S or Sᵀ) and dP's from shared memory; dV's and dK's
    with P and dS from registers (dim_split 1) or from the ring (dim_split,
    keys_on_n); dQ's from dS and Kᵀ in shared memory. Staged operands are
    indexed by the methods below, which return each GEMM's (A, B)."""

    s_a: cute.Tensor
    s_b: cute.Tensor
    dp_a: cute.Tensor
    dp_b: cute.Tensor
    dv_a: cute.Tensor
    dv_b: cute.Tensor
    dk_a: cute.Tensor
    dk_b: cute.Tensor
    dq_a: cute.Tensor
    dq_b: cute.Tensor
    config: BwdConfig

    def scores(self, q_stage):
        if self.config.keys_on_n:
            return self.s_a[None, None, None, q_stage], self.s_b
        return self.s_a, self.s_b[None, None, None, q_stage]

    def dp(self, do_stage):
        if self.config.keys_on_n:
            return self.dp_a[None, None, None, do_stage], self.dp_b
        return self.dp_a, self.dp_b[None, None, None, do_stage]

    def dv(self, do_stage, ds_buffer):
        if self.config.keys_on_n:
            return (self.dv_a[None, None, None, do_stage],
                    self.dv_b[None, None, None, pt_buffer(self.config, ds_buffer)])
        a = self.dv_a
        if self.config.dim_split > 1:
            a = a[None, None, None, pt_buffer(self.config, ds_buffer)]
        return a, self.dv_b[None, None, None, do_stage]

    def dk(self, q_stage, ds_buffer):
        if self.config.keys_on_n:
            return self.dk_a[None, None, None, q_stage], self.dk_b[None, None, None, ds_buffer]
        a = self.dk_a
        if self.config.dim_split > 1:
            a = a[None, None, None, ds_buffer]
        return a, self.dk_b[None, None, None, q_stage]

    def dq(self, ds_buffer):
        if self.config.dq_transposed():
            return self.dq_a, self.dq_b[None, None, None, ds_buffer]
        return self.dq_a[None, None, None, ds_buffer], self.dq_b


def make_operands(config: BwdConfig, sK, sV, sQ, sdO, sdSt, mma_sdp, mma_dk, mma_dv, mma_dq,
                  wg) -> Operands:
    """Warpgroup wg's operands over the CTA's shared memory (WGMMA operands are
    per warpgroup: descriptors, or register A fragments)."""
    tile_m, tile_n = config.tile_m, config.tile_n
    wg_sdp, wg_dk, wg_dv = [m.get_slice(wg * WARPGROUP_THREADS)
                            for m in (mma_sdp, mma_dk, mma_dv)]
    # with dq_one_warpgroup only warpgroup 0 computes dQ
    wg_dq = mma_dq.get_slice(0 if config.dq_one_warpgroup else wg * WARPGROUP_THREADS)
    sQt, sdOt = wgmma.transpose_view(sQ), wgmma.transpose_view(sdO)
    if config.keys_on_n:
        # S = Q·Kᵀ, dP = dO·Vᵀ; dKᵀ = Qᵀ·dS, dVᵀ = dOᵀ·P with dS, P read from
        # their transposed copies (N = keys, K = queries: K-major)
        s = (wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ)),
             wg_sdp.make_fragment_B(wg_sdp.partition_B(sK)))
        dp = (wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO)),
              wg_sdp.make_fragment_B(wg_sdp.partition_B(sV)))
        dv = (wg_dv.make_fragment_A(wg_dv.partition_A(sdOt)),
              wg_dv.make_fragment_B(wg_dv.partition_B(sdSt)))
        dk = (wg_dk.make_fragment_A(wg_dk.partition_A(sQt)),
              wg_dk.make_fragment_B(wg_dk.partition_B(sdSt)))
    else:
        s = (wg_sdp.make_fragment_A(wg_sdp.partition_A(sK)),
             wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ)))
        dp = (wg_sdp.make_fragment_A(wg_sdp.partition_A(sV)),
              wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO)))
        if config.dim_split > 1:
            pt = wg_dv.make_fragment_A(wg_dv.partition_A(sdSt))
            dst = wg_dk.make_fragment_A(wg_dk.partition_A(sdSt))
        else:
            pt = wg_dv.make_fragment_A(wg_dv.partition_shape_A((tile_n, tile_m)))
            dst = wg_dk.make_fragment_A(wg_dk.partition_shape_A((tile_n, tile_m)))
        dv = (pt, wg_dv.make_fragment_B(wg_dv.partition_B(sdOt)))
        dk = (dst, wg_dk.make_fragment_B(wg_dk.partition_B(sQt)))
    # dQ's operands: dS = (dSᵀ)ᵀ and Kᵀ, as A and B, or B and A for dQᵀ
    sdS, sKt = wgmma.transpose_view(sdSt), wgmma.transpose_view(sK)
    if config.dq_transposed():
        dq = (wg_dq.make_fragment_A(wg_dq.partition_A(sKt)),
              wg_dq.make_fragment_B(wg_dq.partition_B(sdS)))
    else:
        dq = (wg_dq.make_fragment_A(wg_dq.partition_A(sdS)),
              wg_dq.make_fragment_B(wg_dq.partition_B(sKt)))
    return Operands(*s, *dp, *dv, *dk, *dq, config)


def warpgroup_slab(config: BwdConfig, buffer: cute.Tensor, cols: int, wg):
    """Warpgroup wg's part of a (tile_n, cols) buffer with the keys on its rows
    (a stage of the Pᵀ/dSᵀ ring, cols = tile_m; the K or V buffer that dK or
    dV leaves through, cols = its head dim), as the (M, N) of the
    accumulator that fills it, and whether stmatrix writes it transposed:
    its 64 keys' rows; with dim_split its share of the columns; with
    keys_on_n its keys' rows, seen as (cols, keys)."""
    if config.keys_on_n:
        rows = cute.local_tile(buffer, (config.tile_n // 2, cols), (wg, 0))
        return wgmma.transpose_view(rows), True
    if config.dim_split > 1:
        return cute.local_tile(buffer, (64, cols // config.dim_split), (0, wg)), False
    return cute.local_tile(buffer, (64, cols), (wg, 0)), False
