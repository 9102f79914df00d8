"""How the backward's GEMMs are split across its consumer warpgroups, by
BwdConfig: the tiled MMAs of Sᵀ/dPᵀ, dK/dV and dQ, and the stages of the
16-bit (tile_n, tile_m) ring that hands dSᵀ (and with dim_split Pᵀ) from
one GEMM to the next. The main kernel (bwd_sm90.py) and the dQ postprocess
(bwd_pre_post.py), which reads the accumulator in dQ's MMA layout, share
them."""

from __future__ import annotations

from . import wgmma
from .config import BwdConfig


def dq_tiled_mma(dtype, config: BwdConfig, head_dim: int):
    """dQ = dS·K with dS (tile_m x tile_n) and Kᵀ read MN-major from shared
    memory, or with BwdConfig.dq_transposed dQᵀ = Kᵀ·dSᵀ (head_dim x tile_m),
    both operands MN-major. The postprocess partitions the dQ accumulator
    with this same MMA."""
    wgs = config.consumer_warpgroups
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


def sdp_tiled_mma(dtype, config: BwdConfig, tile_m: int):
    """Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (keys on M): each warpgroup its 64 keys and
    all tile_m queries, or with dim_split the shared 64 keys and its share of
    the queries."""
    if config.dim_split > 1:
        return wgmma.tiled_mma(dtype, True, True, (1, config.dim_split, 1),
                               tile_m // config.dim_split)
    return wgmma.tiled_mma_ss(dtype, config.consumer_warpgroups, tile_m)


def dkv_tiled_mma(dtype, config: BwdConfig, dim: int):
    """dK += dSᵀ·Q (dim = head_dim) or dV += Pᵀ·dO (dim = head_dim_v), Q and
    dO read MN-major: Pᵀ / dSᵀ from registers, each warpgroup its keys, or
    with dim_split from shared memory, each warpgroup its share of dim."""
    if config.dim_split > 1:
        return wgmma.tiled_mma(dtype, True, False, (1, config.dim_split, 1),
                               dim // config.dim_split)
    return wgmma.tiled_mma_rs(dtype, config.consumer_warpgroups, dim)


def ds_buffers(config: BwdConfig) -> int:
    """Stages of the (tile_n, tile_m) 16-bit ring: dSᵀ in two buffers (one
    step's dQ GEMMs may still read it while the next step writes), with
    dim_split Pᵀ in two more (pt_buffer)."""
    return 2 * (2 if config.dim_split > 1 else 1)


def pt_buffer(ds_buffer):
    """The stage of the ring that holds Pᵀ beside dSᵀ's stage ds_buffer."""
    return 2 + ds_buffer
