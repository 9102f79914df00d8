"""FP8 (e4m3) forward benchmark, one process, same inputs: ours in e4m3,
cuDNN's FP8 SDPA forward (nvidia-cudnn-frontend's graph API, where that is
installed; flash-attn-4 has no FP8 forward on SM90), our bf16 forward on
the unquantized inputs, and the dense FP8 GEMM roof.

    python -m cute_fa.profiling.fp8_bench --out docs/results/fp8/bench

Inputs: bf16 normal q, k, v, each quantized to e4m3 with one scale for the
whole tensor (cuDNN takes per-tensor descales; ours gets the same value for
every (batch, KV head)). Ours writes a bf16 O; cuDNN on SM90 writes only an
e4m3 O (its bf16/fp16 FP8 output is Blackwell-only), half the output
bytes: a small edge to cuDNN at short sequences. Timing: median of
round-robin calls with the L2 flushed (timing.time_interleaved). TFLOP/s =
4·b·h·s²·d (halved for causal) / time. The roof: torch._scaled_mm of two
8192² e4m3 matrices in the same run. Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import sys

import torch

from . import report
from .cli import command_parser, csv_list, require_cuda
from .flops import attention_flops, batch_for, tflops

BACKENDS = ("fp8", "cudnn_fp8", "bf16")


def _per_tensor_fp8(x: torch.Tensor, heads_kv: int):
    """x in e4m3 with one scale, and that descale as (batch, heads_kv) fp32."""
    descale = x.float().abs().amax().clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    x8 = (x.float() / descale).to(torch.float8_e4m3fn)
    return x8, descale.expand(x.shape[0], heads_kv).contiguous()


def cudnn_fp8_forward(q8, k8, v8, descales, causal: bool, scale: float):
    """A callable running cuDNN's FP8 SDPA forward on e4m3 (batch, seqlen,
    heads, d) q8, k8, v8 with per-tensor descales (three fp32 scalars on the
    GPU), writing an e4m3 O (scale 1) of q8's layout. P is quantized with scale 448
    (softmax values fill e4m3's range), descale 1/448. Raises ImportError
    without nvidia-cudnn-frontend, RuntimeError where cuDNN rejects it."""
    import cudnn

    out = torch.empty(q8.shape, dtype=torch.float8_e4m3fn, device=q8.device)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3,
                          intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    bhsd = [t.permute(0, 2, 1, 3) for t in (q8, k8, v8, out)]  # cuDNN's dims, our strides
    q_t, k_t, v_t = (graph.tensor_like(t).set_data_type(cudnn.data_type.FP8_E4M3)
                     for t in bhsd[:3])
    scalars = {name: torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=q8.device)
               for name, value in (("descale_q", descales[0]), ("descale_k", descales[1]),
                                   ("descale_v", descales[2]), ("descale_s", 1.0 / 448.0),
                                   ("scale_s", 448.0), ("scale_o", 1.0))}
    scalar_t = {name: graph.tensor_like(t) for name, t in scalars.items()}
    o_t, _, amax_s_t, amax_o_t = graph.sdpa_fp8(
        q=q_t, k=k_t, v=v_t, **scalar_t, is_inference=True, attn_scale=scale,
        use_causal_mask=causal)
    o_t.set_output(True).set_dim(list(bhsd[3].shape)).set_stride(
        list(bhsd[3].stride())).set_data_type(cudnn.data_type.FP8_E4M3)
    amax = {}
    for name, t in (("amax_s", amax_s_t), ("amax_o", amax_o_t)):
        amax[name] = torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=q8.device)
        t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(
            cudnn.data_type.FLOAT)
    try:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    except Exception as exc:  # cudnn raises its own types
        raise RuntimeError(f"cuDNN rejected the FP8 SDPA graph: {exc}") from exc
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=q8.device)
    pack = {q_t: bhsd[0], k_t: bhsd[1], v_t: bhsd[2], o_t: bhsd[3],
            amax_s_t: amax["amax_s"], amax_o_t: amax["amax_o"]}
    pack.update({scalar_t[name]: scalars[name] for name in scalars})

    def run():
        graph.execute(pack, workspace)
        return out

    return run


def _roof_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    from .timing import time_cuda

    t = time_cuda(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    return tflops(2 * n ** 3, t.median_ms)


def measure(d: int, causal: bool, seqlen: int, args) -> list[dict]:
    from cute_fa import flash_attn_func

    from .timing import first_call, time_interleaved

    heads = args.hidden // d
    batch = batch_for(args.total_tokens, seqlen)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16,
                           generator=gen) for _ in range(3))
    (q8, qs), (k8, ks), (v8, vs) = (_per_tensor_fp8(t, heads) for t in (q, k, v))
    fns = {"fp8": lambda: flash_attn_func(q8, k8, v8, causal=causal, q_descale=qs,
                                          k_descale=ks, v_descale=vs),
           "bf16": lambda: flash_attn_func(q, k, v, causal=causal)}
    flops = attention_flops(batch, heads, seqlen, seqlen, d, causal, "fwd")
    rows = {name: dict(head_dim=d, causal=causal, seqlen=seqlen, batch=batch, heads=heads,
                       backend=name, status="ok", median_ms=None, tflops=None)
            for name in BACKENDS}
    try:
        fns["cudnn_fp8"] = cudnn_fp8_forward(q8, k8, v8, [float(t[0, 0]) for t in (qs, ks, vs)],
                                             causal, d ** -0.5)
    except ImportError:
        rows["cudnn_fp8"]["status"] = "unavailable: nvidia-cudnn-frontend not installed"
    except RuntimeError as exc:
        rows["cudnn_fp8"]["status"] = f"unavailable: {str(exc)[:160]}"
    runnable = {}
    for name, fn in fns.items():
        try:
            first_call(fn)
            runnable[name] = fn
        except Exception as exc:  # a failing backend is a row
            rows[name]["status"] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
    for name, (median, _) in time_interleaved(runnable, repeats=args.repeats).items():
        rows[name].update(median_ms=median, tflops=tflops(flops, median))
    return list(rows.values())


def build_parser():
    p = command_parser("fp8_bench", __doc__)
    p.add_argument("--head-dims", type=csv_list(int), default=[64, 128],
                   help="head dims (default: 64,128)")
    p.add_argument("--seqlens", type=csv_list(int),
                   default=[512, 1024, 2048, 4096, 8192, 16384],
                   help="sequence lengths (default: 512 to 16384)")
    p.add_argument("--total-tokens", type=int, default=16384,
                   help="batch = total tokens / seqlen (default: 16384)")
    p.add_argument("--hidden", type=int, default=2048,
                   help="heads = hidden / head dim (default: 2048)")
    p.add_argument("--repeats", type=int, default=30, help="timed calls (default: 30)")
    report.add_out_option(p)
    return p


def format_markdown(rows, env, command, roof) -> str:
    lines = ["# FP8 (e4m3) forward", "", *report.machine_lines(env),
             f"- command: `{command}`",
             f"- dense FP8 GEMM roof in this run (torch._scaled_mm, 8192³): {roof:.0f} TFLOP/s",
             "", "| head dim | causal | seqlen | ours fp8 TFLOP/s | cuDNN fp8 TFLOP/s | ours / cuDNN "
             "| ours bf16 TFLOP/s | fp8 / bf16 | fp8 / roof |",
             "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["head_dim"], r["causal"], r["seqlen"], r["backend"]): r for r in rows}
    for d, causal, seqlen in dict.fromkeys((r["head_dim"], r["causal"], r["seqlen"])
                                           for r in rows):
        f8, cd, b16 = (by[d, causal, seqlen, b] for b in BACKENDS)
        lines.append(f"| {d} | {int(causal)} | {seqlen} | {_tflops(f8)} | {_tflops(cd)} | "
                     f"{_ratio(f8, cd)} | {_tflops(b16)} | {_ratio(f8, b16)} | "
                     f"{f8['tflops'] / roof:.2f} |" if f8["tflops"] else
                     f"| {d} | {int(causal)} | {seqlen} | {_tflops(f8)} | {_tflops(cd)} | - | "
                     f"{_tflops(b16)} | - | - |")
    return "\n".join(lines) + "\n"


def _tflops(row) -> str:
    return f"{row['tflops']:.0f}" if row["tflops"] else row["status"]


def _ratio(a, b) -> str:
    return f"{a['tflops'] / b['tflops']:.2f}" if a["tflops"] and b["tflops"] else "-"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    require_cuda("fp8_bench")
    roof = _roof_tflops()
    rows = []
    for d in args.head_dims:
        for causal in (False, True):
            for seqlen in args.seqlens:
                rows += measure(d, causal, seqlen, args)
    env = report.environment()
    argv = sys.argv[1:] if argv is None else argv
    markdown = format_markdown(rows, env, report.command_line("fp8_bench", argv), roof)
    report.write_table_report(args.out, rows, env, dict(vars(args), roof_tflops=roof), markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
