"""Harness logic on the CPU: FLOP counts, grids, reports from recorded rows."""

import json

import pytest
import torch

from cute_fa.profiling import bench, flops, report
from cute_fa.profiling.backends import BACKENDS, make_callable
from cute_fa.profiling.cli import config_overrides, config_vary
from cute_fa.profiling.sweep import variants
from cute_fa.kernels.config import FwdConfig


def test_flop_counts():
    assert flops.attention_flops(2, 16, 4096, 4096, 128, False) == 4 * 2 * 16 * 4096 ** 2 * 128
    assert flops.attention_flops(2, 16, 4096, 4096, 128, True) == 2 * 2 * 16 * 4096 ** 2 * 128
    fwd = flops.attention_flops(1, 1, 8, 8, 64, False)
    assert flops.attention_flops(1, 1, 8, 8, 64, False, "bwd") == 2.5 * fwd
    assert flops.attention_flops(1, 1, 8, 8, 64, False, "fwd_bwd") == 3.5 * fwd
    assert flops.tflops(1e12, 1000.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="direction"):
        flops.attention_flops(1, 1, 1, 1, 1, False, "sideways")


def test_batch_derivation():
    assert flops.batch_for(16384, 1024) == 16
    assert flops.batch_for(16384, 16384) == 1
    assert flops.batch_for(16384, 32768) == 1
    with pytest.raises(ValueError):
        flops.batch_for(0, 1)


def test_default_grid():
    args = bench.parse_args([])
    problems = bench.problems(args)
    assert {p["head_dim"] for p in problems} == {64, 128}
    assert {p["causal"] for p in problems} == {False, True}
    assert all(p["batch"] * p["seqlen_q"] == 16384 for p in problems)
    assert {p["heads"] for p in problems if p["head_dim"] == 64} == {32}


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        bench.parse_args(["--backends", "cute,nope"])
    with pytest.raises(ValueError, match="backend: expected one of"):
        make_callable("nope", None, None, None, False, 1.0, "fwd")
    assert set(BACKENDS) >= {"cute", "fa4", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient",
                             "sdpa_math"}


def _rows():
    base = dict(direction="fwd", dtype="bf16", head_dim=128, causal=False, seqlen_q=4096,
                seqlen_k=4096, batch=4, heads=16, heads_kv=16, first_call_ms=1.0,
                peak_mem_bytes=64 * 2**20)
    return [dict(base, backend="cute", status="ok", median_ms=1.0, tflops=600.0),
            dict(base, backend="fa4", status="ok", median_ms=1.1, tflops=550.0),
            dict(base, backend="sdpa_cudnn", status="ok", median_ms=0.9, tflops=650.0),
            dict(base, backend="sdpa_math", status="failed: OutOfMemoryError: CUDA out of memory",
                 median_ms=None, tflops=None, peak_mem_bytes=None)]


def test_ratios_and_table_with_a_failure_row():
    rows = report.add_ratios(_rows())
    ours = rows[0]
    assert ours["best_peer"] == "sdpa_cudnn"
    assert ours["ratio_to_best_peer"] == pytest.approx(600 / 650)
    assert rows[3]["ratio_to_best_peer"] is None
    table = report.format_table(rows)
    assert "0.923x" in table and "failed: OutOfMemoryError" in table


def test_json_and_plots(tmp_path):
    rows = report.add_ratios(_rows() + [dict(_rows()[0], seqlen_q=8192, seqlen_k=8192,
                                             batch=2, tflops=640.0)])
    path = tmp_path / "b.json"
    report.write_json(str(path), rows, {"gpu": "H100"}, {"seqlens": [4096]})
    data = json.loads(path.read_text())
    assert data["environment"]["gpu"] == "H100" and len(data["rows"]) == 5
    pytest.importorskip("matplotlib")
    written = report.write_plots(str(tmp_path / "b"), rows)
    assert [p.split("_")[-1] for p in written] == ["tflops.png", "memory.png"]
    assert all((tmp_path / p.split("/")[-1]).stat().st_size > 1000 for p in written)


def test_markdown_report_with_a_failure_row(tmp_path):
    import datetime

    rows = report.add_ratios(_rows() + [dict(r, causal=True) for r in _rows()]
                             + [dict(r, direction="bwd") for r in _rows()])
    env = {"gpu": "NVIDIA H100 80GB HBM3", "sms": 132, "sm_clock_max_mhz": "1980",
           "driver": "570.86.15", "cuda": "12.8", "torch": "2.8.0",
           "nvidia-cutlass-dsl": "4.8.1", "flash-attn-4": None}
    command = bench.command_line(["--head-dims", "128", "--report", "my run"])
    path = tmp_path / "README.md"
    report.write_markdown(str(path), rows, env, command, {"repeats": 30},
                          [str(tmp_path / "bench_tflops.png")],
                          date=datetime.datetime(2025, 1, 2, 3, 4,
                                                 tzinfo=datetime.timezone.utc))
    text = path.read_text()
    # The exact command that produced it, quoted for the shell.
    assert "python -m cute_fa.profiling.bench --head-dims 128 --report 'my run'" in text
    assert "2025-01-02 03:04 UTC" in text
    assert "NVIDIA H100 80GB HBM3, 132 SMs" in text and "570.86.15" in text
    assert "4.8.1" in text and "flash-attn-4 not installed" in text
    assert "median of 30" in text and "L2" in text and "round-robin" in text
    # One table per (direction, dtype), a column per backend, ours first.
    assert text.count("| head dim | causal | batch×heads×seqlen | cute | fa4 | sdpa_cudnn | "
                      "sdpa_math | ours / best peer |") == 2
    assert "### fwd, bf16" in text and "### bwd, bf16" in text
    table = [line for line in text.splitlines() if line.startswith("| 128 | no |")][0]
    cells = [c.strip() for c in table.strip("|").split("|")]
    assert cells[2] == "4×16×4096" and cells[3:6] == ["600.0", "550.0", "650.0"]
    assert cells[6] == "failed: OutOfMemoryError: CUDA out of memory"  # its status
    assert cells[7] == "0.923 (sdpa_cudnn)"
    assert "(bench_tflops.png)" in text  # plots linked beside the report


def test_sweep_variants_are_the_cartesian_product():
    from cute_fa.profiling import sweep

    vary = config_vary(["persistent=0,1", "kv_stages=2,3"])
    configs = variants(FwdConfig(), vary)
    assert len(configs) == 4
    assert {(c.persistent, c.kv_stages) for c in configs} == {(False, 2), (False, 3),
                                                              (True, 2), (True, 3)}
    with pytest.raises(ValueError, match="unknown FwdConfig field 'tile_k'"):
        config_vary(["tile_k=1"])
    # On the command line the same mistake is an argparse error, not a traceback.
    assert sweep.parse_args(["--vary", "kv_stages=2,3"]).vary_values == {"kv_stages": [2, 3]}
    with pytest.raises(SystemExit):
        sweep.parse_args(["--vary", "tile_k=1"])


def test_ncu_summary_from_recorded_csv(monkeypatch):
    import subprocess

    from cute_fa.profiling import ncu

    header = ["Kernel Name", "gpu__time_duration.sum", "launch__registers_per_thread",
              "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"]
    units = ["", "ms", "register/thread", "", ""]
    row = ["kernel_cutlass_fwd", "1.69", "168", "0.77", "1.58"]
    csv_text = "\n".join(",".join(f'"{x}"' for x in r) for r in (header, units, row))

    class Done:
        stdout = csv_text
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Done())
    text = ncu.summarize("report.ncu-rep")
    assert "duration                         1.69 ms" in text
    assert text.index("wait") < text.index("barrier")  # stalls sorted, largest first
    assert "168" in text


def test_ncu_source_hotspots_from_a_recorded_source_page():
    from cute_fa.profiling.ncu import source_hotspots, source_kernels

    header = ["Address", "Source", "Warp Stall Sampling (All Samples)",
              "Instructions Executed", "stall_short_sb", "stall_wait",
              "stall_wait (Not Issued)"]
    rows = [["0x10", "LDS.64 R18, [R11+0x20400]", "5", "100", "0", "5", "5"],
            ["0x20", "FFMA R184, R184, UR20, -R18", "90", "100", "88", "2", "2"],
            ["0x30", "@!P0 BRA 0x10", "5", "100", "0", "5", "5"]]
    page = "\n".join(",".join(f'"{x}"' for x in r) for r in
                     [["Kernel Name", "pre"], header, rows[0],
                      ["Kernel Name", "main"], header] + rows)
    kernels = source_kernels(page)
    assert list(kernels) == ["pre", "main"] and len(kernels["main"]) == 3
    text = source_hotspots(kernels["main"], top=2)
    assert "short_sb" in text.splitlines()[1]  # reasons, largest first
    hot = text[text.index("top 2"):].splitlines()[1:]
    assert "FFMA" in hot[0] and "short_sb:88" in hot[0] and "90.0%" in hot[0]
    assert len(hot) == 2
    assert "BRA" in text  # predicated instructions counted under their opcode
    ffma = next(l for l in text.splitlines() if l.startswith("FFMA"))
    assert ffma.split()[1] == "90" and ffma.endswith("short_sb:88 wait:2")  # by opcode
    assert "(Not Issued)" not in text


def test_ncu_config_overrides_are_typed():
    from cute_fa.profiling import ncu

    assert config_overrides(["tile_n=160,pingpong=0"]) == {"tile_n": 160, "pingpong": False}
    with pytest.raises(ValueError, match="unknown FwdConfig field 'tile_k'"):
        config_overrides(["tile_k=3"])
    assert config_overrides(["qdo_stages=3,deterministic=1"], "bwd") == {
        "qdo_stages": 3, "deterministic": True}
    with pytest.raises(ValueError, match="unknown BwdConfig field 'pingpong'"):
        config_overrides(["pingpong=0"], "bwd")
    # ncu --config reads the same assignments, checked before anything runs.
    assert ncu.parse_args(["--config", "tile_n=160,pingpong=0"]).overrides == {
        "tile_n": 160, "pingpong": False}
    with pytest.raises(SystemExit):
        ncu.parse_args(["--config", "tile_k=3"])
    # e4m3: over the FP8 forward's config for the problem, not the 16-bit one's
    args = ncu.parse_args(["--dtype", "e4m3", "--seqlen", "1024", "--config", "kv_stages=2"])
    assert ncu._fp8_config(args).tile_n == 128 and ncu._fp8_config(args).transpose_warps > 0


@pytest.mark.parametrize("direction", ["fwd", "bwd", "fwd_bwd"])
def test_directions_run_on_cpu_through_sdpa_math(direction):
    import torch

    q = torch.randn(1, 16, 2, 64)
    k = torch.randn(1, 16, 1, 64)
    fn = make_callable("sdpa_math", q, k, k.clone(), True, 0.125, direction)
    out = fn()
    if direction == "fwd":
        assert out.shape == q.shape  # every backend answers in (b, s, h, d)


def test_timed_backward_returns_gradients_without_accumulating():
    """A timed step's backward is attention's alone: the inputs' gradients,
    not adds into their .grad (which would time three elementwise adds per
    call)."""
    import torch
    from cute_fa.profiling.problem import input_gradients, timed_step

    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(1, 8, 2, 16)

    def attend():
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    step = timed_step(attend, grad_out, (q, k, v))
    step()
    step()
    assert q.grad is None and k.grad is None and v.grad is None
    grads = input_gradients(attend(), (q, k, v), grad_out)
    attend().backward(grad_out)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want)
    for direction in ("bwd", "fwd_bwd"):
        fn = make_callable("sdpa_math", q.detach(), k.detach(), v.detach(), False, 0.25,
                           direction)
        assert [g.shape for g in fn()] == [q.shape, k.shape, v.shape]
    with pytest.raises(ValueError, match="inputs"):
        timed_step(attend, grad_out)


def test_our_fwd_bwd_row_runs_on_cpu():
    import torch

    q = torch.randn(1, 16, 2, 64, dtype=torch.bfloat16)
    make_callable("cute", q, q, q, False, 0.125, "fwd_bwd")()
    make_callable("cute", q, q, q, True, 0.125, "bwd")()


def test_breakdown_arguments():
    from cute_fa.profiling import breakdown
    args = breakdown.parse_args(["--backends", "cute,fa4", "--direction", "fwd_bwd"])
    assert args.backends == ["cute", "fa4"] and args.direction == "fwd_bwd"
    with pytest.raises(SystemExit):
        breakdown.parse_args(["--backends", "cute,nope"])
    with pytest.raises(SystemExit):
        breakdown.parse_args(["--repeats", "0"])


def test_wgmma_serialisation_from_sass_counts():
    from cute_fa.profiling.kernel_info import KernelInfo
    info = KernelInfo(threads=384)
    assert info.wgmma_serialized is None  # no SASS read
    info.sass = {"hgmma": 32, "warpgroup_wait": 4, "local_memory": 0}
    assert info.wgmma_serialized is False
    info.sass = {"hgmma": 32, "warpgroup_wait": 32, "local_memory": 12}
    assert info.wgmma_serialized is True
    info.sass = {"hgmma": 0, "qgmma": 16, "warpgroup_wait": 16, "local_memory": 0}  # e4m3
    assert info.wgmma_serialized is True
    info.sass = {"hgmma": 0, "qgmma": 16, "warpgroup_wait": 3, "local_memory": 0}
    assert info.wgmma_serialized is False


def test_problem_shape():
    from cute_fa.profiling.problem import problem_shape
    assert problem_shape(128, 8192, 16384) == (2, 16)
    assert problem_shape(64, 1024, 16384) == (16, 32)
    assert problem_shape(128, 4096, 4096, heads=8) == (1, 8)


def test_host_arguments_and_table():
    from cute_fa.profiling import host

    args = host.parse_args([])
    assert args.backends[0] == "cute" and args.modes == list(host.MODES)
    assert (args.window, args.softcap, args.sink) == ((-1, -1), 0.0, False)
    mods = host.parse_args(["--window", "1024,0", "--softcap", "30", "--sink"])
    assert (mods.window, mods.softcap, mods.sink) == ((1024, 0), 30.0, True)
    for bad, match in ((["--modes", "sideways"], "--modes"), (["--backends", "nope"], "--backends"),
                       (["--heads", "8", "--heads-kv", "3"], "--heads-kv"),
                       (["--window", "-2,0"], "--window"), (["--softcap", "-1"], "--softcap")):
        with pytest.raises(SystemExit):
            host.parse_args(bad)
    rows = [dict(mode="fwd", backend="cute", host_us=40.0, status="ok"),
            dict(mode="fwd", backend="sdpa_cudnn", host_us=60.0, status="ok"),
            dict(mode="fwd", backend="fa4", host_us=None, status="failed: X")]
    table = host.format_table(rows)
    assert "1.50" in table and "failed: X" in table


def test_host_calls_run_on_cpu_through_sdpa_math():
    from cute_fa.profiling import host

    q, k, v = (torch.randn(1, 16, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    for mode in ("fwd", "fwd_bwd"):
        host.make_call("sdpa_math", mode, q, k, v, causal=True)()
        # ours on the CPU is the reference math, with the score modifications
        host.make_call("cute", mode, q, k, v, True, (8, 0), 20.0, torch.zeros(2))()


def test_step_arguments():
    from cute_fa.profiling import step

    args = step.parse_args([])
    assert args.backends[0] == "cute" and not args.compile
    for bad in (["--backends", "cute,nope"], ["--rounds", "0"], ["--profile-steps", "-1"],
                ["--profile-rounds", "0"]):
        with pytest.raises(SystemExit):
            step.parse_args(bad)


def test_step_measures_each_backend_on_cpu(dataset, capsys):
    # The tiny model on the CPU: our op (reference math there) and SDPA's math
    # backend, through profiling.train's Trainer; the attention ops are found
    # in the profile and every profiled field is filled.
    from cute_fa.profiling import step

    path, _ = dataset
    results = step.main(["--backends", "cute,sdpa_math", "--config", "tiny", "--seq", "64",
                         "--rounds", "2", "--steps-per-round", "2", "--profile-steps", "2",
                         "--profile-rounds", "2",
                         "--warmup-steps", "1", "--data", path, "--device", "cpu", "--top", "3"])
    assert [r.backend for r in results] == ["cute", "sdpa_math"]
    for r in results:
        assert r.status == "ok" and r.ms_per_step > 0 and r.host_ms > 0
        assert r.allocations > 0 and "Self CPU" in r.top_table
    ours = {op.name: op for op in results[0].attention_ops}
    # Two layers, one forward and one backward call each per step.
    assert ours["cute_fa::fwd"].calls_per_step == 2 and ours["cute_fa::bwd"].calls_per_step == 2
    assert ours["cute_fa::fwd"].host_us > 0
    out = capsys.readouterr().out
    assert "cute_fa::bwd" in out and "sdpa_math" in out


def test_step_table_without_measurements():
    from cute_fa.profiling.step import OpCost, StepCost, format_table

    table = format_table([StepCost("cute", 50.0, 40.0, 28.0, 700, 900,
                                   [OpCost("cute_fa::fwd", 24, 60.0, 56.0)]),
                          StepCost("fa4", status="failed: X")])
    assert "1.000" in table and "failed: X" in table and "cute_fa::fwd" in table


def test_step_profile_rounds_take_medians():
    from cute_fa.profiling.step import OpCost, median_profile

    rounds = [dict(host_ms=h, gpu_ms=1.0, launches=10, allocations=5, top_table=f"t{h}",
                   attention_ops=[OpCost("cute_fa::fwd", 2, h * 10, 5.0)]) for h in (3.0, 1.0, 2.0)]
    m = median_profile(rounds)
    assert m["host_ms"] == 2.0 and m["launches"] == 10 and m["top_table"] == "t2.0"
    assert m["attention_ops"] == [OpCost("cute_fa::fwd", 2, 20.0, 5.0)]


def test_sass_loop_finds_one_kv_step_of_the_forward():
    # Compiles the d=64 forward for sm_90a here: its innermost loop issuing
    # d/16 + tile_n/16 HGMMAs is one K/V step, with the softmax's ex2 in it.
    import importlib.util

    from cute_fa.profiling import sass_loop

    if importlib.util.find_spec("flash_attn") is None:
        columns = sass_loop.main(["--head-dim", "64"])["mix"]
    else:
        columns = sass_loop.main(["--head-dim", "64", "--fa4"])["mix"]
    mix = columns["ours 192x128"]
    assert mix["HGMMA"] == 64 // 16 + 128 // 16
    # 64 rows x 128 columns per warpgroup: 64 scores a thread, one ex2 each,
    # plus one per row for the O rescale factor (2 rows a thread).
    assert mix["MUFU"] == 64 + 2
    assert "total" in sass_loop.format_mix(columns)


def test_sass_loop_backward_step_and_its_live_registers():
    # The d=64 backward (128 queries x 128 keys, two consumer warpgroups):
    # one query-block step issues Sᵀ, dPᵀ (64/16 each), dV, dK (128/16 each)
    # and dQ (128/16) HGMMAs and one ex2 per Pᵀ element (64 keys x 128
    # queries per warpgroup: 64 a thread).
    from cute_fa.profiling import sass_loop
    from cute_fa.profiling.kernel_info import ptxas_path

    liveness = ptxas_path() is not None
    out = sass_loop.main(["--kernel", "bwd", "--head-dim", "64"]
                         + (["--liveness"] if liveness else []))
    mix = out["mix"]["ours 128x128"]
    assert mix["HGMMA"] == 32 and mix["MUFU"] == 64
    # The sequence-edge mask (a -inf select per score) is branched over on
    # a steady step.
    assert out["unmasked"]["ours 128x128"] <= sum(mix.values()) - mix["FSEL"]
    if liveness:
        entry, peak = out["liveness"]["ours 128x128"]
        # dK and dV stay in registers across steps (2 x 64 keys x 64 dims /
        # 128 threads); the peak adds Sᵀ and dPᵀ in flight (2 x 64) and
        # stays within the consumers' setmaxnreg budget.
        assert 64 <= entry < 64 + 24
        assert entry + 128 <= peak <= 240


def test_hgmma_loops_on_a_synthetic_listing():
    from cute_fa.profiling.kernel_info import hgmma_loops, main_loop_mix, opcode

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ ;
.L_x_2:
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0030*/              @!P0 SYNCS.ARRIVE.TRANS64 RZ, [UR8+0x20], R18 ;
        /*0040*/               @P1 BRA `(.L_x_2) ;
        /*0050*/               @P2 BRA `(.L_x_1) ;
        /*0060*/                   EXIT ;
"""
    assert hgmma_loops(sass) == [(2, 4, 1), (1, 5, 2)]
    mix, body = main_loop_mix(sass, 2)
    assert mix["HGMMA"] == 2 and mix["BRA"] == 2 and len(body) == 5
    assert main_loop_mix(sass, 3) is None
    assert opcode("@!P0 SYNCS.ARRIVE.TRANS64 RZ, [UR8+0x20], R18") == "SYNCS"


def test_unmasked_step_skips_the_masking_branch_on_a_synthetic_listing():
    # A step whose masking code (-inf selects) sits behind a forward branch
    # taken on two predicates, as ptxas emits it: the unmasked step is the
    # loop without that stretch. A skipped stretch without -inf stays in.
    from cute_fa.profiling.kernel_info import unmasked_step_count

    sass = """
.L_x_1:
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ ;
        /*0010*/              @!P1 BRA P2, `(.L_x_3) ;
        /*0020*/                   ISETP.GE.AND P6, PT, R216, R217, PT ;
        /*0030*/                   FSEL R185, R185, -INF , P6 ;
.L_x_3:
        /*0040*/                   MUFU.EX2 R184, R184 ;
        /*0050*/               @P3 BRA `(.L_x_4) ;
        /*0060*/                   FADD R1, R1, R2 ;
.L_x_4:
        /*0070*/               @P0 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
"""
    assert unmasked_step_count(sass, 1) == 8 - 2
    assert unmasked_step_count(sass, 2) is None


def test_fp8_error_report(tmp_path):
    """profiling.fp8_error writes its table: incoherent processing lowers the
    emulated FP8 error on outlier-heavy inputs."""
    from cute_fa.profiling import fp8_error

    prefix = str(tmp_path / "fp8")
    assert fp8_error.main(["--head-dims", "64", "--seqlen", "128", "--out", prefix]) == 0
    rows = json.load(open(prefix + ".json"))["rows"]
    assert len(rows) == 3 * 2 * 2
    for causal in (False, True):
        plain, rotated = (next(r for r in rows if r["kind"] == "outliers" and
                               r["causal"] == causal and r["incoherent"] == flag)
                          for flag in (False, True))
        assert rotated["rmse"] < plain["rmse"]
    assert "| outliers | 64 | 1 |" in open(prefix + ".md").read()
    with pytest.raises(SystemExit):
        fp8_error.main(["--heads", "8", "--heads-kv", "3", "--out", prefix])


def test_decode_bench_grid_bytes_and_table():
    """profiling.decode_bench without a GPU: its grid (caches past --max-gib
    and pages that do not divide a cache left out), the bytes it counts, its
    argument errors and its table from recorded rows."""
    from cute_fa.profiling import decode_bench

    assert decode_bench.kv_bytes(1, 8192, 8) == 2 * 8192 * 8 * 128 * 2  # 32 MiB
    args = decode_bench.parse_args(["--shapes", "llama3_8b,mqa", "--batches", "1,256",
                                    "--caches", "1000,131072", "--pages", "0,16",
                                    "--seqlens-q", "1", "--max-gib", "8", "--out", "x"])
    grid = decode_bench.problems(args)
    assert all(p["kv_bytes"] <= 8 * 2 ** 30 for p in grid)
    assert not any(p["cache"] == 1000 and p["page_size"] == 16 for p in grid)
    assert {"shape": "llama3_8b", "heads": 32, "heads_kv": 8, "batch": 256, "cache": 1000,
            "seqlen_q": 1, "page_size": 0, "kv_bytes": 256 * 1000 * 8 * 128 * 4} in grid
    assert args.l2_flush == "write"
    assert decode_bench.parse_args(["--l2-flush", "read", "--out", "x"]).l2_flush == "read"
    for bad in (["--shapes", "gpt5"], ["--backends", "cute,xformers"], ["--pages", "-1"],
                ["--l2-flush", "evict"]):
        with pytest.raises(SystemExit):
            decode_bench.parse_args([*bad, "--out", "x"])
    problem = dict(shape="llama3_8b", heads=32, heads_kv=8, batch=1, cache=8192, seqlen_q=1,
                   page_size=16, kv_bytes=2 ** 25)
    rows = [dict(problem, backend="cute", status="ok", us=20.0, tbps=1.68),
            dict(problem, backend="fa4", status="ok", us=40.0, tbps=0.84),
            dict(problem, backend="sdpa_cudnn", status="unavailable: SDPA has no paged KV cache"),
            dict(problem, backend="copy", status="ok", us=12.0, tbps=2.8)]
    table = decode_bench.format_markdown(rows, {}, "python -m cute_fa.profiling.decode_bench")
    assert "| 32/8 | 1 | 8192 | 1 | 16 | 20.0 (1.68) | 40.0 (0.84) | n/a | 2.80 | 2.00 |" in table
    assert "L2 flushed before every call by writing 256 MB (dirty lines)" in table
    read = decode_bench.format_markdown([dict(r, l2_flush="read") for r in rows], {}, "x")
    assert "L2 flushed before every call by reading 256 MB (clean lines)" in read
    # ours on e4m3 caches: half the bytes, its own column, not a peer of the ratio
    assert "HBM peak not known for this GPU" in table
    for gpu, peak in (("NVIDIA H100 80GB HBM3", "3.35"), ("NVIDIA H200", "4.8")):
        env_table = decode_bench.format_markdown(rows, {"gpu": gpu}, "decode_bench")
        assert f"HBM peak {peak} TB/s" in env_table
    assert decode_bench.backend_bytes(problem, "cute_e4m3") == 2 ** 24
    assert decode_bench.backend_bytes(problem, "fa4") == 2 ** 25
    rows.insert(1, dict(problem, backend="cute_e4m3", status="ok", us=10.0, tbps=1.68))
    table = decode_bench.format_markdown(rows, {}, "python -m cute_fa.profiling.decode_bench")
    assert ("| 32/8 | 1 | 8192 | 1 | 16 | 20.0 (1.68) | 10.0 (1.68) | 40.0 (0.84) | n/a | 2.80 "
            "| 2.00 |") in table


def test_decode_bench_pages_hold_the_dense_tokens():
    """The paged caches it builds hold the dense caches' tokens in their page
    order: ours reads the same attention from both (CPU reference path);
    peers that cannot run a problem say why."""
    from cute_fa import flash_attn_with_kvcache
    from cute_fa.profiling import decode_bench

    problem = dict(shape="llama3_8b", heads=32, heads_kv=8, batch=2, cache=64, seqlen_q=2,
                   page_size=16, kv_bytes=decode_bench.kv_bytes(2, 64, 8))
    q, k_pages, v_pages, table = decode_bench._caches(problem, torch.device("cpu"))
    _, k, v, none = decode_bench._caches(dict(problem, page_size=0), torch.device("cpu"))
    assert none is None and table.shape == (2, 4)
    paged = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=64, page_table=table,
                                    causal=True)
    dense = flash_attn_with_kvcache(q, k, v, cache_seqlens=64, causal=True)
    assert torch.equal(paged, dense)
    fns, missing = decode_bench.callables(problem, ["cute", "sdpa_flash", "flashinfer"],
                                          torch.device("cpu"))
    assert set(fns) == {"cute", "copy"}
    assert "no paged KV cache" in missing["sdpa_flash"] and "flashinfer" in missing


class _FakeDecodeWrapper:
    """Records what the decode benchmark plans and runs with FlashInfer."""

    def __init__(self, workspace, layout, use_tensor_cores):
        self.layout, self.use_tensor_cores = layout, use_tensor_cores

    def plan(self, indptr, indices, last_page_len, heads, heads_kv, head_dim, page_size,
             **kwargs):
        self.planned = (indptr.tolist(), indices.tolist(), last_page_len.tolist(), heads,
                        heads_kv, head_dim, page_size)

    def run(self, q, caches):
        self.ran = (q.shape, [t.shape for t in caches])


@pytest.mark.parametrize("page_size", [0, 16])
def test_decode_bench_flashinfer_sees_the_same_pages(monkeypatch, page_size):
    """FlashInfer's decode gets the benchmark's paged cache through its table,
    and a contiguous cache viewed as pages of FLASHINFER_PAGE_SIZE tokens,
    one query token per sequence; several are refused with the reason."""
    import sys
    import types

    from cute_fa.profiling import decode_bench
    from cute_fa.attention_backends import BackendUnavailable

    wrappers = []
    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=lambda *a, **kw: (
        wrappers.append(_FakeDecodeWrapper(*a, **kw)) or wrappers[-1]))
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    problem = dict(shape="70b_tp8", heads=8, heads_kv=1, batch=2, cache=256, seqlen_q=1,
                   page_size=page_size, kv_bytes=decode_bench.kv_bytes(2, 256, 1))
    q, k, v, table = decode_bench._caches(problem, torch.device("cpu"))
    lengths = torch.full((2,), 256, dtype=torch.int32)
    decode_bench._callable("flashinfer", q, k, v, table, lengths)()
    w = wrappers[-1]
    assert w.layout == "NHD" and w.use_tensor_cores  # a group of 8
    page = page_size or decode_bench.FLASHINFER_PAGE_SIZE
    pages = 256 // page
    indices = table.reshape(-1).tolist() if page_size else list(range(2 * pages))
    assert w.planned == ([0, pages, 2 * pages], indices, [page, page], 8, 1, 128, page)
    assert w.ran == ((2, 8, 128), [(2 * pages, page, 1, 128)] * 2)
    with pytest.raises(BackendUnavailable, match="one query token"):
        decode_bench._callable("flashinfer", torch.cat([q, q], 1), k, v, table, lengths)


def test_time_interleaved_names_a_bad_l2_flush_before_any_call():
    from cute_fa.profiling import timing

    calls = []
    with pytest.raises(ValueError, match="l2_flush: expected one of write, read, got 'zero'"):
        timing.time_interleaved({"fn": lambda: calls.append(1)}, l2_flush="zero")
    assert not calls
