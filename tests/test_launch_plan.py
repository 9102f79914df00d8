"""The launch plans (csrc/launch_plan.cpp, read through python_api/launch_plan.py)
on the CPU: the forward's split tail, the buffers and launches of each
variant, and the planner library's build."""

import os
import subprocess
import sys

import pytest
import torch

from cute_fa import launch_plan
from cute_fa.kernels import tail_plan
from cute_fa.kernels.config import Features, default_fwd_config
from cute_fa.kernels.bwd_config import bwd_config_for_problem, default_bwd_config
from cute_fa.launch_plan import tail_parts


def test_benchmark_tails_split_where_the_model_saves():
    # d128 non-causal, 16 heads, 16k tokens: 2048 tiles on 132 SMs, 68 in the
    # last round. 8k keys are 52 blocks of 160: three parts each, two rounds
    # of units on every SM instead of one round of whole tiles on 68.
    assert tail_parts(2048, 132, 52) == 3
    assert tail_parts(2048, 132, 103) == 5  # 16k
    # 2k and 4k keys (13, 26 blocks): the units' overhead eats the saving
    assert tail_parts(2048, 132, 13) == 1 and tail_parts(2048, 132, 26) == 1
    # d64 8k / 16k (192-row tiles): 112 of 132 SMs busy in the last round
    assert tail_parts(2752, 132, 64) == 1
    # d64 2k: 44 tiles in the last round, a third of the SMs
    assert tail_parts(2816, 132, 16) == 3


def test_full_rounds_and_tiny_problems():
    assert tail_parts(2640, 132, 64) == 1  # 20 full rounds
    assert tail_parts(5, 132, 1) == 1      # one block: nothing to split
    assert tail_parts(64, 132, 40) == 2    # fewer tiles than SMs: all of them split
    assert tail_parts(64, 132, 7) == 1     # ... unless they are short
    for tiles, blocks in ((70, 3), (1, 8), (200, 2)):
        assert tail_parts(tiles, 132, blocks) <= blocks  # every part has a block
    for blocks in (9, 40, 1000):
        assert tail_parts(1, 132, blocks) <= tail_plan.MAX_PARTS  # what the merge holds


def test_a_split_has_parts():
    assert tail_plan.TailPlan(full_tiles=1980, parts=5).split
    assert not tail_plan.NO_SPLIT.split


def test_non_causal_defaults_split_their_tail():
    for head_dim in (64, 96, 128):
        assert default_fwd_config(head_dim, False).split_tail
        assert not default_fwd_config(head_dim, True).split_tail


def _workspace(plan, index):
    return next(w for w in plan.workspaces if w.index == index)


def test_fp8_forward_plan_takes_descales_and_gives_the_output_dtype():
    from cute_fa.kernels.config import fp8_fwd_config

    config = fp8_fwd_config(128, True)
    shape = (2, 1000, 1000, 8, 2, 128, 128)
    plan = launch_plan.plan_fwd(config, shape, 132, fp8=True)
    assert plan.num_inputs == 6  # q, k, v, then their descales
    _, args = plan.launches[0]
    buffers = [index for kind, index, _ in args if kind == launch_plan.ARG_BUFFER]
    assert buffers[-4:-1] == [3, 4, 5]  # the descales, before the block mask's stand-in
    assert _workspace(plan, plan.outputs[0]).dtype == launch_plan.OUTPUT_DTYPE
    with pytest.raises(ValueError, match="no forward launch plan"):  # dense batches only
        launch_plan.plan_fwd(config, shape, 132, varlen=(2000, 2000, 0, 0), fp8=True)


def test_block_sparse_plans_take_the_tile_lists():
    from cute_fa.kernels.config import Features, block_sparse_fwd_config
    from cute_fa.kernels.bwd_config import bwd_config_for_problem

    shape = (2, 1000, 1000, 8, 2, 128, 128)
    fwd = launch_plan.plan_fwd(block_sparse_fwd_config(128, 128), shape, 132,
                               block_sparse=(1, 8 * 8, 132))
    assert fwd.num_inputs == 4  # q, k, v, then the lists
    _, args = fwd.launches[0]
    buffers = [index for kind, index, _ in args if kind == launch_plan.ARG_BUFFER]
    assert buffers[-1] == 3  # the kernel's last tensor: the lists
    config = bwd_config_for_problem(128, False, False, 2, 1000, 8, 2, 132,
                                    Features(block_sparse=True))
    bwd = launch_plan.plan_bwd(config, shape, 132, sink=True, block_sparse=(2, 8 * 8, 132))
    assert bwd.num_inputs == 9  # grad_out, q, k, v, out, lse, grad_lse, sinks, lists
    _, main_args = bwd.launches[1]
    assert [index for kind, index, _ in main_args if kind == launch_plan.ARG_BUFFER][-1] == 8
    with pytest.raises(ValueError, match="no forward launch plan"):  # dense batches only
        launch_plan.plan_fwd(block_sparse_fwd_config(128, 128), shape, 132,
                             varlen=(2000, 2000, 0, 0), block_sparse=(1, 64, 132))
    with pytest.raises(ValueError, match="no backward launch plan"):  # no kept order
        launch_plan.plan_bwd(config.replace(deterministic=True, dynamic_tiles=False), shape,
                             132, block_sparse=(1, 64, 132))


def test_forward_plan():
    config = default_fwd_config(128, False)
    shape = (2, 8192, 8192, 16, 4, 128, 128)
    plan = launch_plan.plan_fwd(config, shape, 132)
    assert plan.tail == tail_plan.TailPlan(full_tiles=1980, parts=3)
    assert plan.num_inputs == 3 and len(plan.launches) == 1
    kernel, args = plan.launches[0]
    buffers = [index for kind, index, _ in args if kind == launch_plan.ARG_BUFFER]
    # q, k, v, out, lse, counters, partials, the four sequence-length tensors
    # (a dense batch: one stand-in), the sinks (none: a stand-in), the page
    # table (a stand-in), the e4m3 descales (one stand-in), a block mask's tile
    # lists (a stand-in), then scale·log2(e), SMs, the tail, the window
    # (unbounded: every key on the left, every query on the right), scale /
    # softcap and the seqused bits
    assert buffers == list(range(7)) + [7] * 4 + [8, 11, 9, 9, 9, 10]
    assert plan.outputs == (3, 4)
    assert {_workspace(plan, i).init for i in (7, 8, 9, 10, 11)} == {launch_plan.UNUSED}
    assert _workspace(plan, 8).dtype == launch_plan.F32
    assert _workspace(plan, 9).dtype == launch_plan.F32
    assert _workspace(plan, 10).dtype == launch_plan.I32
    assert _workspace(plan, 11).dtype == launch_plan.I32
    assert _workspace(plan, 3).dtype == launch_plan.INPUT_DTYPE
    assert [(kind, value) for kind, _, value in args[17:]] == [
        (launch_plan.ARG_SCALE_LOG2, 0), (launch_plan.ARG_INT, 132),
        (launch_plan.ARG_INT, 1980), (launch_plan.ARG_INT, 3), (launch_plan.ARG_INT, 8192),
        (launch_plan.ARG_INT, 8192), (launch_plan.ARG_PRE_TANH, 0), (launch_plan.ARG_INT, 0)]
    assert _workspace(plan, 3).shape == (2, 8192, 16, 128)
    assert _workspace(plan, 3).dtype == launch_plan.INPUT_DTYPE
    assert _workspace(plan, 4).shape == (2, 16, 8192)
    # a counter per split tile and consumer warpgroup after the tile counter,
    # zeroed per call; per unit, each consumer thread's 64 O values and its
    # two rows' LSE
    counters, partials = _workspace(plan, 5), _workspace(plan, 6)
    assert counters.shape == (1, 1, tail_plan.FIRST_COUNTER + 68 * 2)
    assert counters.init == launch_plan.ZERO and counters.dtype == launch_plan.I32
    assert partials.shape == (68 * 3, 64 + 2, 256) and partials.init == launch_plan.EMPTY

    assert launch_plan.plan_fwd(config, shape, 128).tail == tail_plan.NO_SPLIT  # full rounds
    plain = launch_plan.plan_fwd(config.replace(split_tail=False), shape, 132)
    assert _workspace(plain, 5).init == _workspace(plain, 6).init == launch_plan.UNUSED
    causal = launch_plan.plan_fwd(default_fwd_config(128, True), shape, 132)
    assert _workspace(causal, 5).shape == (1, 1, 1)  # the tile counter alone
    assert _workspace(causal, 5).init == launch_plan.ZERO


def test_forced_tail_plans():
    config = default_fwd_config(128, False)
    shape = (2, 8192, 8192, 16, 4, 128, 128)
    forced = launch_plan.plan_fwd(config, shape, 132, tail_plan.TailPlan(0, 2))
    assert forced.tail == tail_plan.TailPlan(0, 2)
    assert _workspace(forced, 6).shape[0] == 2048 * 2
    assert launch_plan.plan_fwd(config, shape, 132, tail_plan.NO_SPLIT).tail == tail_plan.NO_SPLIT
    for bad in (tail_plan.TailPlan(0, tail_plan.MAX_PARTS + 1), tail_plan.TailPlan(4096, 2)):
        with pytest.raises(ValueError, match="no forward launch plan"):
            launch_plan.plan_fwd(config, shape, 132, bad)
    with pytest.raises(ValueError, match="no forward launch plan"):
        launch_plan.plan_fwd(config.replace(split_tail=False), shape, 132,
                             tail_plan.TailPlan(0, 2))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("split_gqa", [False, True])
def test_backward_plan(deterministic, split_gqa):
    config = default_bwd_config(128, True, deterministic, split_gqa)
    batch, seqlen, heads, heads_kv, d = 2, 1000, 8, 2, 128
    plan = launch_plan.plan_bwd(config, (batch, seqlen, seqlen, heads, heads_kv, d, d), 132)
    padded = -(-seqlen // config.tile_m) * config.tile_m
    assert plan.num_inputs == 7
    assert [kernel for kernel, _ in plan.launches] == list(range(4 if split_gqa else 3))
    shapes = {w.index: w.shape for w in plan.workspaces}
    lse2, dsum, dq_accum, semaphore = 7, 8, 9, 10
    assert shapes[lse2] == shapes[dsum] == (batch, heads, padded)
    assert shapes[dq_accum] == (batch, heads, padded * d)
    sem = _workspace(plan, semaphore)
    assert config.dq_first_store  # nothing zeroes the dQ accumulator
    if deterministic:  # turns per query tile and dQ warpgroup; the first stores
        assert sem.init == launch_plan.ZERO
        assert sem.shape == (batch, heads, padded // config.tile_m * config.consumer_warpgroups)
    else:  # the tile counter, then a first-touch slot per query tile (the preprocess zeroes)
        assert sem.init == launch_plan.EMPTY
        assert sem.shape == (batch, heads, 1 + padded // config.tile_m)
    grad_q, grad_k, grad_v = plan.outputs
    # the postprocess reads the slots: a tile no key block wrote gets zeros
    post = [i for kind, i, _ in plan.launches[2][1] if kind == launch_plan.ARG_BUFFER]
    assert post[:3] == [dq_accum, grad_q, semaphore]
    assert shapes[grad_q] == (batch, seqlen, heads, d)
    assert shapes[grad_k] == shapes[grad_v] == (batch, seqlen, heads_kv, d)
    main_tensors = [i for kind, i, _ in plan.launches[1][1] if kind == launch_plan.ARG_BUFFER]
    assert main_tensors[7] == grad_q  # written by the main kernel with convert_dq
    dk_main, dv_main = main_tensors[8:10]
    if split_gqa:  # fp32 per query head, summed into the outputs by the fourth launch
        assert shapes[dk_main] == (batch, seqlen, heads, d)
        assert _workspace(plan, dk_main).dtype == launch_plan.F32
        group_sum = [i for _, i, _ in plan.launches[3][1]]
        assert group_sum == [dk_main, dv_main, grad_k, grad_v]
    else:
        assert (dk_main, dv_main) == (grad_k, grad_v)


def test_sink_plans():
    """Learnable sinks: an fp32 (1, 1, h) input of the forward and of the
    backward's preprocess, which also writes d(sink)'s partials (one per
    warp of its 16-row CTAs: 4 per 16 padded rows), the fourth output."""
    shape = (2, 1000, 1000, 8, 2, 128, 128)
    fwd = launch_plan.plan_fwd(default_fwd_config(128, False), shape, 132, sink=True)
    assert fwd.num_inputs == 4
    fwd_tensors = [i for kind, i, _ in fwd.launches[0][1] if kind == launch_plan.ARG_BUFFER]
    assert fwd_tensors[11] == 3
    config = default_bwd_config(128, True)
    bwd = launch_plan.plan_bwd(config, shape, 132, sink=True)
    assert bwd.num_inputs == 8 and len(bwd.outputs) == 4
    pre = [i for kind, i, _ in bwd.launches[0][1] if kind == launch_plan.ARG_BUFFER]
    assert pre[11:] == [7, bwd.outputs[3]]
    padded = -(-1000 // config.tile_m) * config.tile_m
    partials = _workspace(bwd, bwd.outputs[3])
    assert partials.shape == (2, 8, padded // 16 * 4) and partials.dtype == launch_plan.F32
    packed = launch_plan.plan_bwd(config.replace(dynamic_tiles=True), shape, 132,
                                  varlen=(5000, 5000, False, False), sink=True)
    assert packed.num_inputs == 12 and _workspace(packed, packed.outputs[3]).shape[0] == 2


def test_value_head_dim_plans():
    # v and the output carry v's head dim, the split tail's partials too;
    # in the backward also dO, dV and split_gqa's dV partials
    config = default_fwd_config(192, False, 128).replace(split_tail=True)
    shape = (2, 1000, 1000, 8, 2, 192, 128)
    plan = launch_plan.plan_fwd(config, shape, 132, tail_plan.TailPlan(0, 2))
    assert _workspace(plan, 3).shape == (2, 1000, 8, 128)  # out
    assert _workspace(plan, 6).shape[1] == tail_plan.partial_floats(128)
    native = launch_plan.fwd_variant(config, 128)
    assert native.partial_floats == tail_plan.partial_floats(128)
    bwd_shape = (2, 1000, 900, 8, 2, 128, 64)
    bwd = launch_plan.plan_bwd(default_bwd_config(128, False), bwd_shape, 132)
    assert [_workspace(bwd, i).shape for i in bwd.outputs] == [
        (2, 1000, 8, 128), (2, 900, 2, 128), (2, 900, 2, 64)]  # dq, dk, dv
    split = launch_plan.plan_bwd(default_bwd_config(128, False, split_gqa=True), bwd_shape, 132)
    partials = [w.shape for w in split.workspaces if w.dtype == launch_plan.F32
                and len(w.shape) == 4]
    assert partials == [(2, 900, 8, 128), (2, 900, 8, 64)]  # dK, dV per query head
    with pytest.raises(ValueError, match="no backward launch plan"):  # v wider than q
        launch_plan.plan_bwd(default_bwd_config(64, False), (1, 64, 64, 2, 2, 64, 128), 132)


def test_bad_shapes_are_not_planned():
    config = default_fwd_config(64, False)
    for shape in ((0, 8, 8, 2, 2, 64, 64), (1, 8, 8, 3, 2, 64, 64), (1, 8, 0, 2, 2, 64, 64),
                  (1, 8, 8, 2, 2, 64, 0)):
        with pytest.raises(ValueError, match="no forward launch plan"):
            launch_plan.plan_fwd(config, shape, 132)


def test_planner_library_is_built_once_per_source(tmp_path):
    # a fresh cache: built there on first use, then loaded
    env = dict(os.environ, CUTE_FA_CACHE_DIR=str(tmp_path))
    code = ("from cute_fa import launch_plan; launch_plan.library(); "
            "print(launch_plan.library_path())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True)
    path = out.stdout.strip()
    assert path.startswith(str(tmp_path)) and os.path.isfile(path)
    assert not [p for p in os.listdir(os.path.dirname(path)) if p.endswith(".partial")]


def test_no_compiler_is_a_clear_error(tmp_path):
    env = dict(os.environ, CUTE_FA_CACHE_DIR=str(tmp_path), CXX="false")
    code = "from cute_fa import launch_plan; launch_plan.library()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "could not build its launch planner with false" in out.stderr
    env["CXX"], env["PATH"] = "", str(tmp_path)  # no compiler on the PATH either
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "needs a C++ compiler" in out.stderr


def test_the_op_module_does_not_import_the_dsl():
    # The plan runs on the op's per-call path, which the CPU and fake kernels
    # share; importing cutlass there would also fix the DSL's target before
    # compile_cache sets it for a machine without a GPU.
    code = "import sys, cute_fa.ops; print('cutlass' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("window,expected", [((-1, -1), (300, 100)), ((5, 0), (5, 0)),
                                             ((1000, 7), (300, 7)), ((2, 5000), (2, 100))])
def test_window_arguments_are_clamped_to_the_shape(window, expected):
    """A side wider than any row reaches is the unbounded one, in int32 range."""
    shape = (1, 100, 300, 4, 4, 64, 64)
    for plan, launch, first in ((launch_plan.plan_fwd(default_fwd_config(64, False), shape, 132,
                                              window=window), 0, 21),
                        (launch_plan.plan_bwd(default_bwd_config(64, False), shape, 132,
                                              window=window), 1, 19)):
        args = dict(enumerate(plan.launches[launch][1]))
        assert (args[first][2], args[first + 1][2]) == expected
        assert args[first + 2][0] == launch_plan.ARG_PRE_TANH


def test_execute_scalars_fold_the_softcap():
    """scale·log2(e) becomes softcap·log2(e), and scale / softcap goes to the kernel."""
    seen = []
    plan = launch_plan.Plan(0, (), ((0, ((launch_plan.ARG_SCALE_LOG2, 0, 0),
                                         (launch_plan.ARG_SCALE, 0, 0),
                                         (launch_plan.ARG_PRE_TANH, 0, 0))),), (), 0, 1)
    launch_plan.execute(plan, [lambda *a: seen.append(a)], [torch.zeros(1)], 0.5, 30.0)
    launch_plan.execute(plan, [lambda *a: seen.append(a)], [torch.zeros(1)], 0.5)
    log2e = launch_plan.LOG2_E
    assert seen[0] == pytest.approx((30.0 * log2e, 0.5, 0.5 / 30.0))
    assert seen[1] == pytest.approx((0.5 * log2e, 0.5, 0.0))


def test_packed_forward_plan():
    """A packed batch: q, k, v as batches of one of their totals, the four
    int32 sequence-length inputs after them, out and LSE packed too; its
    window bounds from the longest sequences; no split tail."""
    config = default_fwd_config(128, True, 128, Features(varlen=True))
    shape = (6, 1000, 900, 8, 2, 128, 128)  # 6 sequences, the longest 1000 / 900
    plan = launch_plan.plan_fwd(config, shape, 132, None, (-1, -1), (3000, 2500, True, False))
    assert plan.num_inputs == 7 and plan.tail == tail_plan.NO_SPLIT
    _, args = plan.launches[0]
    buffers = [index for kind, index, _ in args if kind == launch_plan.ARG_BUFFER]
    # then the sinks, the page table, the descales and the tile lists (stand-ins)
    assert buffers[7:] == [3, 4, 5, 6, 11, 14, 12, 12, 12, 13]
    assert [value for _, _, value in args[-4:-1]] == [900, 1000, 0]  # window, pre-tanh
    assert args[-1] == (launch_plan.ARG_INT, 0, 1)  # seqused_q read, seqused_k not
    assert _workspace(plan, plan.outputs[0]).shape == (1, 3000, 8, 128)
    assert _workspace(plan, plan.outputs[1]).shape == (1, 8, 3000)
    with pytest.raises(ValueError):  # a packed batch's tail is never split
        launch_plan.plan_fwd(config.replace(split_tail=True, dynamic_tiles=False), shape, 132,
                             None, (-1, -1), (3000, 2500, False, False))


def test_packed_backward_plan():
    """Per-row buffers hold each sequence in whole query tiles (total +
    batch · tile_m rows); the pre- and postprocess get the longest query
    sequence; the gradients are not zeroed whole, a last launch zeroes
    their rows outside every sequence (7 gaps over about a wave of CTAs)."""
    config = bwd_config_for_problem(128, True, False, 6, 900, 8, 2, 132, Features(varlen=True))
    assert config.dynamic_tiles and not config.split_gqa
    shape = (6, 1000, 900, 8, 2, 128, 128)
    plan = launch_plan.plan_bwd(config, shape, 132, (-1, -1), (3000, 2500, False, True))
    assert plan.num_inputs == 11
    padded = -(-(3000 + 6 * config.tile_m) // config.tile_m) * config.tile_m
    assert _workspace(plan, 11).shape == (1, 8, padded)
    assert all(_workspace(plan, i).init == launch_plan.EMPTY for i in plan.outputs)
    assert [k for k, _ in plan.launches] == [0, 1, 2, 3]
    pre, main, post, gaps = (args for _, args in plan.launches)
    assert pre[-1] == (launch_plan.ARG_INT, 0, 1000) and post[-1] == (launch_plan.ARG_INT, 0, 1000)
    assert [i for _, i, _ in gaps[:7]] == list(plan.outputs) + [7, 8, 9, 10]
    assert gaps[7:] == ((launch_plan.ARG_INT, 0, 2), (launch_plan.ARG_INT, 0, 19))
    with pytest.raises(ValueError):  # no split_gqa partials for a packed batch
        launch_plan.plan_bwd(config.replace(split_gqa=True), shape, 132, (-1, -1),
                             (3000, 2500, False, False))
