"""The combinations of features and config the forward kernel
(fwd_sm90.FlashAttentionForwardSm90) is built for. Any other is a
ValueError naming the field, what it takes and what came, raised when the
kernel object is made, before anything is traced."""

from __future__ import annotations


def check_forward(kernel) -> None:
    """The checks of a FlashAttentionForwardSm90 beside those every kernel
    makes (kernel_base.Sm90AttentionKernel)."""
    features, config, causal = kernel.features, kernel.cfg, kernel.causal
    if kernel.fp8:
        _check_fp8(kernel)
    if (causal or features.local or features.varlen or features.split_kv) \
            and config.split_tail:
        raise ValueError(f"FwdConfig.split_tail: expected False for a causal, local, "
                         f"varlen or split_kv kernel (its tiles differ in length or start, "
                         f"or are split already; dynamic_tiles balances them), got True "
                         f"(head_dim={kernel.head_dim}, config={config})")
    if features.paged_kv and not features.varlen:
        raise ValueError("features.paged_kv: expected a varlen kernel (the sequences' "
                         "lengths come from seqused_k), got a dense one")
    if config.kv_load_rows and not features.paged_kv:
        raise ValueError(f"FwdConfig.kv_load_rows: expected 0 for a kernel without "
                         f"paged_kv (only pages come in pieces of a block), got "
                         f"{config.kv_load_rows} (config={config})")
    if features.split_kv and features.sink:
        raise ValueError("features.sink: expected False for a split_kv kernel (the "
                         "combine of the key ranges takes no sink), got True")
    if features.one_q_tile and not features.varlen:
        raise ValueError("features.one_q_tile: expected a varlen kernel (a dense batch's "
                         "tiles need no scan), got a dense one")
    if features.rows_per_query < 1:
        raise ValueError(f"features.rows_per_query: expected at least 1, got "
                         f"{features.rows_per_query}")
    if features.heads_in_rows and (not features.varlen or features.sink
                                   or kernel.tile_m % features.rows_per_query):
        raise ValueError(f"features.heads_in_rows: expected a varlen kernel without sinks "
                         f"whose rows_per_query divides tile_m {kernel.tile_m} (a TMA box of "
                         f"whole groups), got {features}")
    if config.concurrent_tiles > 1 and (features.varlen or features.split_kv):
        raise ValueError(f"FwdConfig.concurrent_tiles: expected 1 for a varlen or split_kv "
                         f"kernel (their tiles are dealt by the packed batch's scheduler), "
                         f"got {config.concurrent_tiles} ({features})")
    if features.block_sparse and (causal or features.local or features.varlen
                                  or features.split_kv or features.paged_kv
                                  or features.rows_per_query != 1 or config.split_tail):
        raise ValueError(f"features.block_sparse: expected a dense, non-causal kernel "
                         f"without a window, split_kv, paged_kv or split_tail (the block "
                         f"mask holds every limit), got causal={causal}, {features}, "
                         f"split_tail={config.split_tail}")


def _check_fp8(kernel) -> None:
    """What the e4m3 kernel builds on: a 16-bit O, K steps of 32 (the
    e4m3 WGMMA's K), O in a slab of its own (the V ring holds bytes),
    and no feature whose scores the descales would have to reach."""
    if kernel.out_dtype.width != 16:
        raise ValueError(f"out_dtype: expected bf16 or fp16 for e4m3 inputs, got "
                         f"{kernel.out_dtype}")
    if kernel.tile_n % 32 or kernel.head_dim % 32:
        raise ValueError(f"FwdConfig.tile_n and head_dim: expected multiples of 32 for e4m3 "
                         f"(the WGMMA's K), got {kernel.tile_n} and {kernel.head_dim}")
    if kernel.cfg.o_in_v_smem:
        raise ValueError(f"FwdConfig.o_in_v_smem: expected False for e4m3 inputs (O is "
                         f"16-bit, the V ring holds bytes), got True (config={kernel.cfg})")
    if kernel.features.softcap:
        raise ValueError(f"features.softcap: expected False with e4m3 inputs, got "
                         f"{kernel.features}")
