"""The forward's split tail (FwdConfig.split_tail): the host's plan
(cute_kernels/tail_plan.py) and workspace, on the CPU."""

import pytest
import torch

from cute_fa.kernels import tail_plan
from cute_fa.kernels.config import default_fwd_config
from cute_fa.kernels.tail_plan import NO_SPLIT, TailPlan, plan, tail_cost


def test_benchmark_tails_split_where_the_model_saves():
    # d128 non-causal, 16 heads, 16k tokens: 2048 tiles on 132 SMs, 68 in the
    # last round. 8k keys are 52 blocks of 160: three parts each, two rounds
    # of units on every SM instead of one round of whole tiles on 68.
    assert plan(2048, 132, 52) == TailPlan(full_tiles=1980, parts=3)
    assert tail_cost(68, 132, 52, 3) == pytest.approx(2 * (52 / 3 + 4))
    assert plan(2048, 132, 103) == TailPlan(full_tiles=1980, parts=5)  # 16k
    # 2k and 4k keys (13, 26 blocks): the units' overhead eats the saving
    assert plan(2048, 132, 13) == NO_SPLIT and plan(2048, 132, 26) == NO_SPLIT
    # d64 8k / 16k (192-row tiles): 112 of 132 SMs busy in the last round
    assert plan(2752, 132, 64) == NO_SPLIT
    # d64 2k: 44 tiles in the last round, a third of the SMs
    assert plan(2816, 132, 16) == TailPlan(full_tiles=2772, parts=3)


def test_full_rounds_and_tiny_problems():
    assert plan(2640, 132, 64) == NO_SPLIT  # 20 full rounds
    assert plan(5, 132, 1) == NO_SPLIT      # one block: nothing to split
    small = plan(64, 132, 40)               # fewer tiles than SMs: all of them split
    assert small.full_tiles == 0 and small.parts == 2
    assert plan(64, 132, 7) == NO_SPLIT     # ... unless they are short
    for tiles, blocks in ((70, 3), (1, 8), (200, 2)):
        assert plan(tiles, 132, blocks).parts <= blocks  # every part has a block


def test_units_count_the_parts():
    split = TailPlan(full_tiles=1980, parts=5)
    assert split.split and split.split_tiles(2048) == 68 and split.units(2048) == 1980 + 340
    assert not NO_SPLIT.split and NO_SPLIT.split_tiles(2048) == 0
    assert NO_SPLIT.units(2048) == 2048


def test_non_causal_defaults_split_their_tail():
    for head_dim in (64, 96, 128):
        assert default_fwd_config(head_dim, False).split_tail
        assert not default_fwd_config(head_dim, True).split_tail


def test_workspace_sizes():
    from cute_fa.ops import fwd_tail_plan, fwd_workspace_sizes

    config = default_fwd_config(128, False)
    q = torch.empty(2, 8192, 16, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 8192, 4, 128, dtype=torch.bfloat16)
    tail = fwd_tail_plan(config, q, k, num_sms=132)
    assert tail == TailPlan(full_tiles=1980, parts=3)
    counters, partials = fwd_workspace_sizes(config, q, tail)
    # a counter per split tile and consumer warpgroup after the tile counter;
    # per unit, each consumer thread's 64 O values and its 2 rows' LSE
    assert counters == tail_plan.FIRST_COUNTER + 68 * 2
    assert partials == (68 * 3, 64 + 2, 256)
    assert fwd_tail_plan(config, q, k, num_sms=128) == NO_SPLIT  # 16 full rounds
    assert fwd_workspace_sizes(config.replace(split_tail=False), q, NO_SPLIT) == (0, None)
    causal = default_fwd_config(128, True)
    assert fwd_workspace_sizes(causal, q, NO_SPLIT) == (1, None)  # the tile counter


def test_the_op_module_does_not_import_the_dsl():
    # The plan runs on the op's per-call path, which the CPU and fake kernels
    # share; importing cutlass there would also fix the DSL's target before
    # compile_cache sets it for a machine without a GPU.
    import subprocess
    import sys

    code = "import sys, cute_fa.ops; print('cutlass' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
