"""Every forward and backward kernel the op serves compiles for sm_90a (no GPU needed) and
holds the instructions the FA3 design requires."""

import re

import pytest
import torch

from cute_fa.kernels.config import FwdConfig, default_bwd_config, default_fwd_config
from cute_fa.compile_cache import compile_bwd, compile_fwd, get_fwd
from cute_fa.profiling.kernel_info import dumped_kernel_info, opcode


def _assert_warp_specialised(info, config):
    """mbarrier-fed consumers, the config's setmaxnreg split, one producer
    warpgroup plus the config's consumer warpgroups, a legal register count."""
    assert info.counts["mbarrier_wait"] > 0
    assert ("dec", config.producer_regs) in info.setmaxnreg
    assert ("inc", config.consumer_regs) in info.setmaxnreg
    assert info.warpgroups == 1 + config.consumer_warpgroups
    assert info.registers is not None and info.registers <= 255
    # ptxas serialises WGMMAs when the consumers run short of registers
    # (silently: the DSL hides its warning), and the tensor cores would no
    # longer overlap the softmax / elementwise work.
    assert info.sass is not None, "nvdisasm not found (pip install nvidia-cuda-nvdisasm)"
    assert not info.wgmma_serialized, f"ptxas serialised the WGMMAs: {info.sass}"


def _step(kind: str, head_dim: int, causal: bool, config, tmp_path):
    """(opcode counts, instructions) of one main-loop step of the bf16 kernel
    (profiling.sass_loop)."""
    from cute_fa.profiling.kernel_info import main_loop_mix
    from cute_fa.profiling.sass_loop import hgmmas_per_step, ours

    sass, _ = ours(kind, head_dim, causal, config, str(tmp_path))
    return main_loop_mix(sass, hgmmas_per_step(kind, head_dim, config.tile_m, config.tile_n))


def _step_mix(kind: str, head_dim: int, causal: bool, config, tmp_path):
    """Opcode counts of one main-loop step of the bf16 kernel."""
    return _step(kind, head_dim, causal, config, tmp_path)[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_kernel_ptx(tmp_path, dtype, head_dim, causal):
    config = default_fwd_config(head_dim, causal)
    compile_fwd(dtype, head_dim, causal, config, dump_dir=str(tmp_path))
    info = dumped_kernel_info(str(tmp_path))
    assert info.counts["wgmma"] > 0
    assert info.counts["tma_load"] > 0 and info.counts["tma_store"] > 0
    _assert_warp_specialised(info, config)
    assert info.warpgroups >= 3  # one consumer warpgroup per 64 query rows
    assert info.counts["local_memory"] == 0
    # no spills in SASS either (mma_operand_view keeps WGMMA descriptors live
    # across the loop; they must fit)
    assert info.stack_bytes == 0 and info.sass["local_memory"] == 0


def test_head_dim_128_launches_three_warpgroups(tmp_path):
    compile_fwd(torch.bfloat16, 128, False, default_fwd_config(128, False), str(tmp_path))
    info = dumped_kernel_info(str(tmp_path))
    assert info.threads == 384 and info.warpgroups == 3
    assert info.counts["ex2"] > 0 and info.counts["stmatrix"] > 0


def _claimed_and_fixed(kind: str, head_dim: int, tmp_path):
    """({dynamic: kernel info}, {dynamic: step mix}) of the causal default
    (claimed tiles) and of the same config with the fixed order; checks that
    only the former claims (one atomic add)."""
    config = (default_fwd_config if kind == "fwd" else default_bwd_config)(head_dim, True)
    assert config.dynamic_tiles
    infos, steps = {}, {}
    for dynamic in (True, False):
        cfg = config.replace(dynamic_tiles=dynamic)
        where = tmp_path / str(dynamic)
        compile_fn = compile_fwd if kind == "fwd" else compile_bwd
        compile_fn(torch.bfloat16, head_dim, True, cfg, dump_dir=str(where))
        infos[dynamic] = dumped_kernel_info(str(where if kind == "fwd" else where / "main"))
        steps[dynamic] = _step_mix(kind, head_dim, True, cfg, tmp_path / f"step{dynamic}")
    assert infos[True].counts["atomic_add"] == 1 and infos[False].counts["atomic_add"] == 0
    return infos, steps


@pytest.mark.parametrize("head_dim", [64, 128])
def test_causal_forward_claims_its_tiles(tmp_path, head_dim):
    # FwdConfig.dynamic_tiles (on in the causal defaults): the producer warp
    # claims each further tile with one atomic add on the counter; the main
    # loop is the fixed deal's (ptxas may trade an IMAD for a MOV).
    infos, steps = _claimed_and_fixed("fwd", head_dim, tmp_path)
    assert abs(sum(steps[True].values()) - sum(steps[False].values())) <= 1
    for op in ("HGMMA", "MUFU", "FFMA", "SYNCS", "BAR"):
        assert steps[True][op] == steps[False][op]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_non_causal_forward_splits_its_tail(tmp_path, head_dim):
    # FwdConfig.split_tail (on in the non-causal defaults): a part counts in
    # with one atomic add behind a GPU-scope fence; the main loop is the
    # unsplit kernel's (ptxas may trade a few bookkeeping instructions).
    config = default_fwd_config(head_dim, False)
    assert config.split_tail
    infos, steps = {}, {}
    for split in (True, False):
        cfg = config.replace(split_tail=split)
        compile_fwd(torch.bfloat16, head_dim, False, cfg, dump_dir=str(tmp_path / str(split)))
        infos[split] = dumped_kernel_info(str(tmp_path / str(split)))
        steps[split] = _step_mix("fwd", head_dim, False, cfg, tmp_path / f"step{split}")
    assert infos[True].counts["atomic_add"] == 1 and infos[True].counts["fence_gpu"] >= 2
    assert infos[False].counts["atomic_add"] == 0 and infos[False].counts["fence_gpu"] == 0
    assert infos[True].stack_bytes == 0 and infos[True].sass["local_memory"] == 0
    assert abs(sum(steps[True].values()) - sum(steps[False].values())) <= 4
    for op in ("HGMMA", "MUFU", "FFMA", "SYNCS", "BAR"):
        assert steps[True][op] == steps[False][op]


@pytest.mark.parametrize("overrides", [dict(intra_wg_overlap=False), dict(pingpong=False),
                                       dict(tile_m=64), dict(kv_stages=3, tile_n=64)])
def test_config_variants_compile(tmp_path, overrides):
    config = FwdConfig().replace(**overrides)
    compile_fwd(torch.bfloat16, 64, True, config, dump_dir=str(tmp_path))
    assert dumped_kernel_info(str(tmp_path)).counts["wgmma"] > 0


@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_loop_bookkeeping_is_warp_uniform(tmp_path, head_dim):
    # The causal tile order divides the tile index (scheduler.decode), which
    # ptxas computes in vector registers; unless the results are marked
    # warp-uniform, the K/V stage index, the loop bounds and every WGMMA
    # descriptor derived from them stay there too: 64-bit descriptor adds
    # (IADD3 + IMAD.X) and R2UR moves before each HGMMA of the main loop.
    # (The once-per-tile descriptors before the loop may sit in vector
    # registers: with the DSL's consumer waits, d=64 causal, ptxas puts two
    # IMAD.X there.)
    from cute_fa.profiling.kernel_info import main_loop_mix
    from cute_fa.profiling.sass_loop import hgmmas_per_step, ours

    config = default_fwd_config(head_dim, True)
    sass, _ = ours("fwd", head_dim, True, config, str(tmp_path))
    mix, body = main_loop_mix(sass, hgmmas_per_step("fwd", head_dim, config.tile_m,
                                                    config.tile_n))
    assert mix["HGMMA"] > 0
    assert not any("IMAD.X" in inst for inst in body)
    assert mix["R2UR"] < mix["HGMMA"] // 4


@pytest.mark.parametrize("head_dim,causal,lean", [(64, False, True), (128, False, True),
                                                   (128, True, True), (128, False, False)])
def test_forward_loop_consumer_sync(tmp_path, head_dim, causal, lean):
    # FwdConfig.lean_consumer_sync: inside one K/V step of the main loop, no
    # suspend-time retry path on the K/V waits (NANOSLEEP.SYNCS) and no
    # thread-index read for a lane-0 release (S2R); the DSL pipeline's
    # wait and release have both.
    config = default_fwd_config(head_dim, causal).replace(lean_consumer_sync=lean)
    mix = _step_mix("fwd", head_dim, causal, config, tmp_path)
    assert mix["SYNCS"] >= 4  # two waits, two releases
    if lean:
        assert mix["NANOSLEEP"] == 0 and mix["S2R"] == 0
    else:
        assert mix["NANOSLEEP"] > 0 and mix["S2R"] > 0


def test_forward_epilogue_coords_stay_out_of_the_loop(tmp_path):
    # FwdConfig.rederive_epilogue_coords (d64 non-causal's default): the
    # epilogue's thread-derived addresses and the decoded tile are not held
    # through the main loop, which then needs fewer register moves per K/V
    # step (d64: 405 SASS instructions instead of 413), and the epilogue
    # reads the thread index through a shuffle of its own lane.
    config = default_fwd_config(64, False)
    assert config.rederive_epilogue_coords
    on = _step_mix("fwd", 64, False, config, tmp_path / "on")
    off = _step_mix("fwd", 64, False, config.replace(rederive_epilogue_coords=False),
                    tmp_path / "off")
    assert on["HGMMA"] == off["HGMMA"] and on["MUFU"] == off["MUFU"]
    assert sum(on.values()) < sum(off.values())


def test_forward_loop_bookkeeping_matches_fa4(tmp_path):
    # One K/V step at d=128, 128x128: 16 HGMMAs and 332 math instructions
    # (FFMA, FMNMX, FMUL, MUFU, FADD, F2FP), the rest bookkeeping. 500 in
    # all with the DSL's consumer waits and descriptors rebuilt every step,
    # 470 with lean_consumer_sync, 456 with mma_operand_view as well; fa4's
    # loop has 457.
    config = default_fwd_config(128, False).replace(tile_n=128)
    mix = _step_mix("fwd", 128, False, config, tmp_path)
    assert mix["HGMMA"] == 16 and mix["MUFU"] == 66
    assert sum(mix.values()) <= 460


@pytest.mark.parametrize("head_dim,causal", [(64, False), (64, True), (128, False)])
@pytest.mark.parametrize("rows", [0, 1, 2])
def test_forward_pv_wait_after_the_exponentials(tmp_path, head_dim, causal, rows):
    # FwdConfig.pv_wait_after_rows: in one K/V step, the wait for the previous
    # block's P·V (WARPGROUP.DEPBAR ... 0x0) comes after the exp2s of at least
    # that many of a thread's two rows (half the step's MUFU.EX2 each: the
    # row's probabilities and its O rescale factor; with 1, ptxas may still
    # schedule the other row's first: d=128 does); at 0 ptxas lifts it above
    # the first one.
    config = default_fwd_config(head_dim, causal).replace(pv_wait_after_rows=rows,
                                                          pv_wait_after_exp2=0)
    mix, body = _step("fwd", head_dim, causal, config, tmp_path)
    exp2_before_wait = _exp2_before_pv_wait(body)
    if rows == 0:
        assert exp2_before_wait == 0
    else:
        assert rows * mix["MUFU"] // 2 <= exp2_before_wait <= mix["MUFU"]
    assert not any("LDL" in inst or "STL" in inst for inst in body)


def _exp2_before_pv_wait(body) -> int:
    """MUFU.EX2s of a forward step ahead of the wait for the previous block's
    P·V (WARPGROUP.DEPBAR ... 0x0)."""
    pv_wait = next(i for i, inst in enumerate(body) if "DEPBAR.LE gsb0, 0x0" in inst)
    return sum("MUFU.EX2" in inst for inst in body[:pv_wait])


@pytest.mark.parametrize("head_dim,causal", [(64, False), (64, True), (96, False),
                                             (128, False), (128, True)])
def test_forward_pv_wait_follows_early_exp2s(tmp_path, head_dim, causal):
    # FwdConfig.pv_wait_after_exp2 (on in every default): the K stage's
    # release is an arrive predicated on one of row 0's probabilities, so
    # ptxas can no longer lift it, and the P·V wait it keeps behind it,
    # above the exponentials; at 0 it does. The wait then follows a few
    # exp2s (d64: 4-5, d96/d128: 16-19) for at most two instructions more
    # per step (no branch, no vote; d64 with split_tail: 404 against 402).
    config = default_fwd_config(head_dim, causal)
    assert config.pv_wait_after_exp2 > 0
    on, on_body = _step("fwd", head_dim, causal, config, tmp_path / "on")
    off, off_body = _step("fwd", head_dim, causal, config.replace(pv_wait_after_exp2=0),
                          tmp_path / "off")
    assert _exp2_before_pv_wait(off_body) == 0
    assert _exp2_before_pv_wait(on_body) >= 4
    assert on["HGMMA"] == off["HGMMA"] and on["MUFU"] == off["MUFU"]
    assert sum(on.values()) <= sum(off.values()) + 2
    assert not any("LDL" in inst or "STL" in inst for inst in on_body)


@pytest.mark.parametrize("head_dim,causal", [(64, False), (128, False), (128, True)])
def test_forward_o_rescale_moves_before_the_pv_gemm(tmp_path, head_dim, causal):
    # FwdConfig.rescale_o_before_pv: the O rescale's FMULs leave the end of
    # the softmax (where ptxas puts them after the last exp2) for the next
    # step, before P·V; the step keeps its instructions and its FMULs.
    config = default_fwd_config(head_dim, causal)
    on, on_body = _step("fwd", head_dim, causal, config.replace(rescale_o_before_pv=True),
                        tmp_path / "on")
    off, off_body = _step("fwd", head_dim, causal, config, tmp_path / "off")

    def fmul_after_last_exp2(body):
        last = max(i for i, inst in enumerate(body) if "MUFU.EX2" in inst)
        return sum(opcode(inst) == "FMUL" for inst in body[last:])

    assert fmul_after_last_exp2(off_body) >= head_dim // 2
    assert fmul_after_last_exp2(on_body) == 0
    assert on["FMUL"] == off["FMUL"] and on["HGMMA"] == off["HGMMA"]
    assert sum(on.values()) <= sum(off.values())
    assert not any("LDL" in inst or "STL" in inst for inst in on_body)


@pytest.mark.parametrize("rescale_threshold", [0, 8])
def test_lazy_rescale_compiles_to_a_warp_vote(tmp_path, rescale_threshold):
    config = default_fwd_config(64, True).replace(rescale_threshold=rescale_threshold)
    compile_fwd(torch.bfloat16, 64, True, config, dump_dir=str(tmp_path))
    info = dumped_kernel_info(str(tmp_path))
    # one vote per softmax step after the first (masked and unmasked loops)
    assert (info.counts["vote_any"] > 0) == (rescale_threshold > 0)
    assert info.counts["local_memory"] == 0 and not info.wgmma_serialized


def test_compiles_for_sm90a_when_cutlass_was_imported_first(tmp_path):
    # The DSL reads CUTE_DSL_ARCH once; a process that imported cutlass before
    # our compile cache (fa4's import does) had it fixed at the CPU default,
    # sm_100a, and the warpgroup MMA refused to build. A fresh interpreter,
    # since this one has imported the cache already.
    import os
    import subprocess
    import sys

    script = (
        "import cutlass, cutlass.cute\n"
        "import torch\n"
        "from cute_fa.compile_cache import compile_fwd\n"
        "from cute_fa.kernels.config import default_fwd_config\n"
        f"compile_fwd(torch.bfloat16, 64, False, default_fwd_config(64, False), {str(tmp_path)!r})\n"
        "from cute_fa.profiling.kernel_info import dumped_kernel_info\n"
        f"print('wgmma', dumped_kernel_info({str(tmp_path)!r}).counts['wgmma'])\n")
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split("wgmma")[-1]) > 0


def test_compile_cache_reuses_by_static_key():
    config = default_fwd_config(64, False)
    a = get_fwd(torch.bfloat16, 64, False, config)
    b = get_fwd(torch.bfloat16, 64, False, FwdConfig(**config.__dict__))
    assert a is b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_kernel_ptx(tmp_path, dtype, head_dim, causal):
    config = default_bwd_config(head_dim, causal)
    compile_bwd(dtype, head_dim, causal, config, dump_dir=str(tmp_path))
    info = dumped_kernel_info(str(tmp_path / "main"))
    # Sᵀ, dPᵀ, dV, dK, dQ: five GEMMs, each issued as WGMMA
    assert info.counts["wgmma"] >= 5
    assert info.counts["tma_load"] >= 6  # K, V, Q, dO, LSE₂, D
    _assert_warp_specialised(info, config)
    assert info.warpgroups == 3  # one consumer warpgroup per 64 keys
    # the bulk fp32 reduce-add of dQ partials, one per consumer warpgroup slab
    assert info.counts["dq_reduce"] == config.consumer_warpgroups
    # registers: the tile_m / dV-order choice of default_bwd_config fits
    # without spills, except fp16 at d=128 non-causal (80 rows, dV after dSᵀ,
    # LSE₂ read early), where ptxas keeps one register in local memory: one
    # STL and one LDL per step, around the mask branch. It is still the
    # fastest there (H100, fp16: 8k 657.8 vs 653.9 TFLOP/s with dV under dSᵀ,
    # 16k 672.4 vs 665.5; 670.5 vs 636.0 without the early LSE₂).
    known_spill = dtype == torch.float16 and head_dim == 128 and not causal
    assert info.stack_bytes == (8 if known_spill else 0)
    assert info.sass["local_memory"] == (2 if known_spill else 0)
    for helper in ("preprocess", "postprocess"):
        assert dumped_kernel_info(str(tmp_path / helper)).counts["local_memory"] == 0
    # the postprocess writes dQ through shared memory and a TMA store (one
    # box per swizzle atom of a warpgroup's slab), not from registers
    post = dumped_kernel_info(str(tmp_path / "postprocess"))
    assert post.counts["stmatrix"] > 0 and post.counts["tma_store"] >= 1
    post_ptx = "".join(p.read_text() for p in (tmp_path / "postprocess").glob("*.ptx"))
    assert not re.search(r"st\.global\.b32\s", post_ptx)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_stats_early_loads_statistics_before_the_gemm_issue(tmp_path, head_dim):
    """BwdConfig.stats_early: in the query-block step, LSE₂ is read from shared
    memory before the first HGMMA is issued (an LDS behind HGMMAs waits for
    them in the MIO queue); off, only after the first WGMMA wait."""
    def lds_before(config, where):
        _, body = _step("bwd", head_dim, False, config, where)
        ops = [opcode(i) for i in body]
        first_gemm = ops.index("HGMMA")
        first_wait = next(i for i, inst in enumerate(body) if "WARPGROUP.DEPBAR" in inst)
        return ops[:first_gemm].count("LDS"), ops[:first_wait].count("LDS")

    config = default_bwd_config(head_dim, False)
    before_gemm, _ = lds_before(config.replace(stats_early=True), tmp_path / "early")
    assert before_gemm == config.tile_m // 8  # LDS.64: two columns each, tile_m / 4 columns
    _, before_wait = lds_before(config.replace(stats_early=False), tmp_path / "lazy")
    assert before_wait == 0


@pytest.mark.parametrize("head_dim", [64, 128])
def test_stats_shuffle_reads_each_statistic_once_per_lane(tmp_path, head_dim):
    """BwdConfig.stats_shuffle: per query-block step, a lane reads
    2 · tile_m / 64 values of LSE₂ and of D (LDS.64 pairs) and shuffles one
    value per accumulator column pair of each (tile_m / 4 columns a thread),
    without ptxas serialising the WGMMAs."""
    config = default_bwd_config(head_dim, False).replace(stats_shuffle=True,
                                                          stats_early=False)
    if config.dq_transposed():  # d128's 80 rows: a lane holds whole 64-row slices only
        config = config.replace(tile_m=64)
    mix = _step_mix("bwd", head_dim, False, config, tmp_path)
    info = dumped_kernel_info(str(tmp_path / "main"))
    assert not info.wgmma_serialized and info.counts["local_memory"] == 0
    assert mix["SHFL"] == 2 * config.tile_m // 4
    assert mix["LDS"] == 2 * config.tile_m // 64


@pytest.mark.parametrize("head_dim,causal", [(64, False), (128, True)])
def test_backward_kv_with_first_block_and_dkv_tma_store(tmp_path, head_dim, causal):
    """BwdConfig.kv_with_first_block: K and V load on the first Q and dO
    stages' barriers, whose expected byte counts are raised for them (two
    mbarrier.expect_tx beside the rings' arrive-expect-tx); dkv_tma_store:
    dK and dV leave by two TMA stores and no 16-bit register stores, while
    split_gqa's fp32 partials still go from registers."""
    def ptx_of(config, where):
        compile_bwd(torch.bfloat16, head_dim, causal, config, dump_dir=str(where))
        info = dumped_kernel_info(str(where / "main"))
        assert info.stack_bytes == 0 and info.sass["local_memory"] == 0
        assert not info.wgmma_serialized
        return info, "".join(p.read_text() for p in (where / "main").glob("*.ptx"))

    def expect_tx(ptx):
        return len(re.findall(r"mbarrier\.expect_tx", ptx))

    # one CTA per key block: dynamic_tiles (the causal default) excludes
    # kv_with_first_block
    base = default_bwd_config(head_dim, causal).replace(kv_with_first_block=False,
                                                         dkv_tma_store=False,
                                                         dynamic_tiles=False)
    info, ptx = ptx_of(base, tmp_path / "base")
    assert info.counts["tma_store"] == 0 and re.search(r"st\.global\.b32\s", ptx)
    info_new, ptx_new = ptx_of(base.replace(kv_with_first_block=True, dkv_tma_store=True),
                               tmp_path / "new")
    assert expect_tx(ptx_new) == expect_tx(ptx) + 2
    assert info_new.counts["tma_load"] == info.counts["tma_load"]
    # one box per 64 columns (the 128-byte swizzle atom of K and V) of each
    assert info_new.counts["tma_store"] == 2 * head_dim // 64
    assert not re.search(r"st\.global\.b32\s", ptx_new)
    _, ptx_split = ptx_of(base.replace(dkv_tma_store=True, split_gqa=True), tmp_path / "split")
    assert re.search(r"st\.global\.v2\.b32\s", ptx_split)
    assert "cp.async.bulk.tensor.2d.global" not in ptx_split


@pytest.mark.parametrize("head_dim", [64, 128])
def test_causal_backward_claims_its_key_blocks(tmp_path, head_dim):
    # BwdConfig.dynamic_tiles (on in the causal defaults): the producer claims
    # key blocks with one atomic add, the preprocess zeroes the counter, and
    # the persistent loop around the tiles leaves the query-block step as it
    # was (ptxas: a few instructions either way), without spills.
    infos, steps = _claimed_and_fixed("bwd", head_dim, tmp_path)
    assert infos[True].stack_bytes == 0 and infos[True].sass["local_memory"] == 0
    assert not infos[True].wgmma_serialized
    assert steps[True]["HGMMA"] == steps[False]["HGMMA"]
    assert steps[True]["MUFU"] == steps[False]["MUFU"]
    assert sum(steps[True].values()) <= sum(steps[False].values()) + 4


def test_backward_transposed_dq_with_80_query_rows(tmp_path):
    """tile_m=80 (fa4's d=128 non-causal tile): dQᵀ = Kᵀ·dSᵀ as m64n80 WGMMAs,
    34 per step (Sᵀ, dPᵀ, dQᵀ: 8 each; dV, dK: 5 each), asynchronous and
    without spills when dSᵀ comes from the 16-bit Pᵀ; the postprocess stores
    the transposed accumulator with stmatrix .trans."""
    config = default_bwd_config(128, False).replace(tile_m=80, ds_from_16bit_p=True)
    mix = _step_mix("bwd", 128, False, config, tmp_path)
    assert mix["HGMMA"] == 34 and mix.get("LDL", 0) == 0 and mix.get("STL", 0) == 0
    info = dumped_kernel_info(str(tmp_path / "main"))
    assert not info.wgmma_serialized and info.stack_bytes == 0
    ptx = "".join(p.read_text() for p in (tmp_path / "main").glob("*.ptx"))
    assert "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16" in ptx
    post = "".join(p.read_text() for p in (tmp_path / "postprocess").glob("*.ptx"))
    assert "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in post
    assert dumped_kernel_info(str(tmp_path / "postprocess")).counts["tma_store"] >= 1


def test_backward_early_launch(tmp_path):
    """BwdConfig.early_launch: the preprocess lets the main kernel start
    early, and the main kernel's producer and dQ writer wait for it."""
    config = default_bwd_config(128, False)
    for on in (False, True):
        where = tmp_path / str(on)
        compile_bwd(torch.bfloat16, 128, False, config.replace(early_launch=on),
                    dump_dir=str(where))
        main = "".join(p.read_text() for p in (where / "main").glob("*.ptx"))
        pre = "".join(p.read_text() for p in (where / "preprocess").glob("*.ptx"))
        assert main.count("griddepcontrol.wait") == (2 if on else 0)
        assert "griddepcontrol.launch_dependents" in pre


def test_deterministic_backward_waits_on_semaphores(tmp_path):
    config = default_bwd_config(128, True, deterministic=True)
    compile_bwd(torch.bfloat16, 128, True, config, dump_dir=str(tmp_path))
    info = dumped_kernel_info(str(tmp_path / "main"))
    assert info.counts["acquire_load"] > 0 and info.counts["release_add"] > 0


@pytest.mark.parametrize("head_dim", [64, 128])
def test_split_gqa_backward_stores_fp32_partials(tmp_path, head_dim):
    config = default_bwd_config(head_dim, True, split_gqa=True)
    compile_bwd(torch.bfloat16, head_dim, True, config, dump_dir=str(tmp_path))
    info = dumped_kernel_info(str(tmp_path / "main"))
    _assert_warp_specialised(info, config)
    assert info.stack_bytes == 0 and info.sass["local_memory"] == 0
    ptx = "".join(p.read_text() for p in (tmp_path / "main").glob("*.ptx"))
    # dK and dV leave as fp32 column pairs (8 bytes) where the 16-bit path
    # from registers stores bf16 pairs (4 bytes), one store each
    plain = tmp_path / "plain"
    compile_bwd(torch.bfloat16, head_dim, True,
                config.replace(split_gqa=False, dkv_tma_store=False), dump_dir=str(plain))
    plain_ptx = "".join(p.read_text() for p in (plain / "main").glob("*.ptx"))

    def stores(text, kind):
        return len(re.findall(rf"st\.global\.{kind}\s", text))

    assert stores(ptx, r"v2\.b32") == stores(plain_ptx, "b32") > 0
    assert stores(plain_ptx, r"v2\.b32") == 0
    # the group sum reads the partials in 16-byte vectors and keeps no stack
    group_sum = tmp_path / "group_sum"
    sum_ptx = "".join(p.read_text() for p in group_sum.glob("*.ptx"))
    assert re.search(r"ld\.global(\.\w+)*\.v4\.[bf]32", sum_ptx)
    assert dumped_kernel_info(str(group_sum)).counts["local_memory"] == 0
    assert not (plain / "group_sum").exists()  # compiled only for split configs
