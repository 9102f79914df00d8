"""Decode benchmark: a few query tokens per sequence against a KV cache, the
memory-bound half of inference. Ours (flash_attn_with_kvcache) beside the
peers and a copy of the same bytes, in one process, on the same caches.

    python -m cute_fa.profiling.decode_bench --out docs/results/decode/decode
    python -m cute_fa.profiling.decode_bench --shapes llama3_8b --batches 1,16 \\
        --caches 8192,32768 --pages 0,16,256 --seqlens-q 1,4 --out d

Throughput is the bytes of K and V a call must read (batch · cache length ·
KV heads · head dim · 2 bytes, for K and for V) over its time, beside the
GPU's HBM peak (hbm_peak_tbps: the H100 SXM's 3.35 TB/s, the H200's 4.8)
and a device copy of a buffer of those bytes measured in the same run
(reported as its read rate). Every cache is full (cache_seqlens = its
length) so that every backend computes the same problem; causal with more
than one query aligns them to the end. Peers:
flash-attn-4 (flash_attn.cute: dense, and paged through its page_table),
PyTorch SDPA pinned to each backend (dense caches, one query: its causal
mask is top-left aligned), FlashInfer's batch decode where installed.
cute_e4m3: ours on the same tokens cast to e4m3 caches (and q), descales given (1):
half the bytes, its TB/s counted on its own bytes; beside the 16-bit rows,
not a peer.
Timing: timing.time_interleaved (round-robin, L2 flushed, median); --l2-flush
read flushes it by reading a buffer instead of writing one (clean lines, as a
decode step finds them after layers that read their weights).
Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import itertools
import sys

import torch

from cute_fa.attention_backends import BackendUnavailable, attention

from . import report
from .cli import command_parser, csv_list, nonnegative_int, positive_int, require_cuda
from .timing import L2_FLUSH_BYTES, L2_FLUSHES

# HBM peaks (TB/s) by the GPU name torch reports ("NVIDIA H100 80GB HBM3" is
# the SXM5 part), first match wins
HBM_PEAK_TBPS = {"H100 80GB HBM3": 3.35, "H100 SXM": 3.35, "H100 NVL": 3.9, "H100 PCIe": 2.0,
                 "H200": 4.8}
# (query heads, KV heads) at head dim 128: Llama-3-8B, a 70B model's tensor-
# parallel slice on 8 GPUs, multi-query attention
SHAPES = {"llama3_8b": (32, 8), "70b_tp8": (8, 1), "mqa": (32, 1)}
HEAD_DIM = 128
PEERS = ("fa4", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flashinfer")
OURS = ("cute", "cute_e4m3")


def hbm_peak_tbps(gpu: str | None) -> float | None:
    """The HBM peak of the GPU named `gpu` (None: a GPU the table lacks)."""
    return next((tbps for name, tbps in HBM_PEAK_TBPS.items() if gpu and name in gpu), None)


def backend_bytes(problem: dict, backend: str) -> int:
    """The K and V bytes a backend's call reads: half for e4m3 caches."""
    return problem["kv_bytes"] // 2 if backend == "cute_e4m3" else problem["kv_bytes"]


def kv_bytes(batch: int, cache: int, heads_kv: int, head_dim: int = HEAD_DIM,
             element_bytes: int = 2) -> int:
    """The bytes of K and V one decode call reads."""
    return 2 * batch * cache * heads_kv * head_dim * element_bytes


def problems(args) -> list[dict]:
    """The grid, without problems whose caches (K and V) pass --max-gib."""
    out = []
    for shape, batch, cache, seqlen_q, page in itertools.product(
            args.shapes, args.batches, args.caches, args.seqlens_q, args.pages):
        heads, heads_kv = SHAPES[shape]
        nbytes = kv_bytes(batch, cache, heads_kv)
        if nbytes > args.max_gib * 2 ** 30 or (page and cache % page):
            continue
        out.append(dict(shape=shape, heads=heads, heads_kv=heads_kv, batch=batch, cache=cache,
                        seqlen_q=seqlen_q, page_size=page, kv_bytes=nbytes))
    return out


def _caches(problem, device):
    """q, dense K/V (batch, cache, h_kv, d) and, for a paged problem, the same
    tokens as pages (in a shuffled page order) with their page table."""
    gen = torch.Generator(device=device).manual_seed(0)
    b, n, hkv, h = problem["batch"], problem["cache"], problem["heads_kv"], problem["heads"]

    def randn(*shape):
        return torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)

    q = randn(b, problem["seqlen_q"], h, HEAD_DIM)
    k, v = randn(b, n, hkv, HEAD_DIM), randn(b, n, hkv, HEAD_DIM)
    page = problem["page_size"]
    if not page:
        return q, k, v, None
    pages = n // page
    order = torch.randperm(b * pages, device=device, generator=gen)
    table = order.view(b, pages).int()
    paged = [torch.empty(b * pages, page, hkv, HEAD_DIM, device=device, dtype=torch.bfloat16)
             for _ in range(2)]
    for cache, dense in zip(paged, (k, v)):
        cache[order] = dense.reshape(b * pages, page, hkv, HEAD_DIM)
    return q, paged[0], paged[1], table


def callables(problem, backends, device) -> tuple[dict, dict]:
    """({backend: zero-argument call}, {backend: why it cannot run})."""
    q, k, v, table = _caches(problem, device)
    lengths = torch.full((problem["batch"],), problem["cache"], dtype=torch.int32,
                         device=device)
    fns, missing = {}, {}
    for name in backends:
        try:
            fns[name] = _callable(name, q, k, v, table, lengths)
        except BackendUnavailable as exc:
            missing[name] = str(exc)
    nbytes = problem["kv_bytes"]
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    fns["copy"] = lambda: target.copy_(source)
    return fns, missing


def _callable(name, q, k, v, table, lengths):
    causal = q.shape[1] > 1
    if name in OURS:
        from cute_fa import flash_attn_with_kvcache

        descales = {}
        if name == "cute_e4m3":  # descales given, as a quantized model's are (all 1 here)
            q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
            ones = torch.ones(lengths.shape[0], k.shape[2], device=q.device)
            descales = dict(q_descale=ones, k_descale=ones, v_descale=ones)
        return lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, page_table=table,
                                               causal=causal, **descales)
    if name == "fa4":
        try:
            from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
        except Exception as exc:
            raise BackendUnavailable(f"flash_attn.cute not importable: {exc}") from None
        if table is None:
            return lambda: flash_attn_func(q, k, v, causal=causal)
        return lambda: flash_attn_varlen_func(q, k, v, seqused_k=lengths, page_table=table,
                                              causal=causal)
    if name.startswith("sdpa_"):
        if table is not None:
            raise BackendUnavailable("SDPA has no paged KV cache")

        def run():  # pinned to the backend; its causal mask (top-left) refused for q len > 1
            return attention(q, k, v, causal, backend=name)
        run()  # a backend that refuses the shape says so here
        return run
    if name == "flashinfer":
        return _flashinfer(q, k, v, table, lengths)
    raise ValueError(f"backend: expected one of {OURS + PEERS}, got {name!r}")


# FlashInfer's recommended workspace for its split-KV decode
FLASHINFER_WORKSPACE_BYTES = 128 << 20
# the pages a contiguous cache is viewed as for FlashInfer (its split-KV
# decode splits sequences at page boundaries; docs/findings.md, "Decode")
FLASHINFER_PAGE_SIZE = 64


def _flashinfer(q, k, v, table, lengths, page_size=FLASHINFER_PAGE_SIZE):
    """FlashInfer's batch decode (BatchDecodeWithPagedKVCacheWrapper, one
    query token) on the same cache: a paged one through its page table, a
    contiguous one (b, n, h_kv, d) viewed as pages of `page_size` tokens (the
    same memory, no copy). Planned once here, as a server plans a step's
    batch; tensor cores where the GQA group is 4 or more, as its
    documentation advises for large groups."""
    try:
        import flashinfer
    except Exception as exc:
        raise BackendUnavailable(f"flashinfer not importable here: {type(exc).__name__}: "
                                 f"{exc}") from None
    batch, seqlen_q, heads, head_dim = q.shape
    if seqlen_q != 1:
        raise BackendUnavailable("flashinfer: its batch decode takes one query token")
    heads_kv = k.shape[2]
    device = q.device
    if table is None:
        capacity = k.shape[1]
        if capacity % page_size:
            raise BackendUnavailable(f"flashinfer: a contiguous cache of {capacity} tokens is no "
                                     f"whole number of {page_size}-token pages")
        k, v = (t.view(batch * capacity // page_size, page_size, heads_kv, t.shape[3])
                for t in (k, v))
        pages_per_sequence = capacity // page_size
        indices = torch.arange(batch * pages_per_sequence, dtype=torch.int32, device=device)
    else:
        page_size, pages_per_sequence = k.shape[1], table.shape[1]
        indices = table.reshape(-1).int()
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * pages_per_sequence
    last_page_len = (lengths - (pages_per_sequence - 1) * page_size).int()
    workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=heads // heads_kv >= 4)
    wrapper.plan(indptr, indices, last_page_len, heads, heads_kv, head_dim, page_size,
                 q_data_type=q.dtype, kv_data_type=k.dtype)
    tokens = q[:, 0]
    return lambda: wrapper.run(tokens, (k, v))


def build_parser():
    p = command_parser("decode_bench", __doc__)
    p.add_argument("--shapes", type=csv_list(str), default=list(SHAPES),
                   help=f"head shapes, from {', '.join(SHAPES)} (default: all)")
    p.add_argument("--batches", type=csv_list(int), default=[1, 4, 16, 64, 256],
                   help="sequences per call, comma-separated (default: 1,4,16,64,256)")
    p.add_argument("--caches", type=csv_list(int), default=[1024, 8192, 32768, 131072],
                   help="cache lengths, tokens per sequence (default: 1024,8192,32768,131072)")
    p.add_argument("--seqlens-q", type=csv_list(int), default=[1, 4],
                   help="query tokens per sequence (default: 1,4)")
    p.add_argument("--pages", type=csv_list(int), default=[0, 16, 256],
                   help="page sizes, 0: a contiguous cache (default: 0,16,256)")
    p.add_argument("--backends", type=csv_list(str), default=["cute", *PEERS],
                   help=f"ours (cute; cute_e4m3: e4m3 caches) and peers from "
                        f"{', '.join(PEERS)} (default: cute and every peer)")
    p.add_argument("--max-gib", type=float, default=24.0,
                   help="skip problems whose K and V pass this many GiB (default: 24)")
    p.add_argument("--repeats", type=positive_int, default=30,
                   help="timed calls per backend and problem, the median reported (default: 30)")
    p.add_argument("--warmup", type=nonnegative_int, default=3,
                   help="untimed calls first (default: 3)")
    p.add_argument("--l2-flush", choices=L2_FLUSHES, default="write",
                   help="how the L2 is flushed before each call: by writing a buffer larger "
                        "than it (dirty lines) or by reading one (clean lines) (default: write)")
    report.add_out_option(p)
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    for shape in args.shapes:
        if shape not in SHAPES:
            p.error(f"--shapes: expected names from {', '.join(SHAPES)}, got {shape!r}")
    for name in args.backends:
        if name not in OURS and name not in PEERS:
            p.error(f"--backends: expected names from {', '.join(OURS + PEERS)}, got "
                    f"{name!r}")
    for option, values in (("--batches", args.batches), ("--caches", args.caches),
                           ("--seqlens-q", args.seqlens_q)):
        if min(values) < 1:
            p.error(f"{option}: expected values >= 1, got {values}")
    if min(args.pages) < 0:
        p.error(f"--pages: expected page sizes >= 0 (0: contiguous), got {args.pages}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    require_cuda("decode_bench")
    from .timing import time_interleaved

    rows = []
    for problem in problems(args):
        fns, missing = callables(problem, args.backends, torch.device("cuda"))
        times = time_interleaved(fns, warmup=args.warmup, repeats=args.repeats,
                                 l2_flush=args.l2_flush)
        for name in [*args.backends, "copy"]:
            row = dict(problem, backend=name, l2_flush=args.l2_flush)
            if name in times:
                ms = times[name][0]
                row.update(status="ok", us=ms * 1e3,
                           tbps=backend_bytes(problem, name) / ms / 1e9)
            else:
                row.update(status=f"unavailable: {missing.get(name, '?')}")
            rows.append(row)
        del fns
        torch.cuda.empty_cache()
    report.write_command_report("decode_bench", argv, args, rows, format_markdown)
    return 0


def format_markdown(rows: list[dict], env: dict, command: str) -> str:
    """One row per problem: each backend's µs and TB/s, the copy's, ours over
    the best peer."""
    backends = list(dict.fromkeys(r["backend"] for r in rows if r["backend"] != "copy"))
    peak_tbps = hbm_peak_tbps(env.get("gpu"))
    peak = f"HBM peak {peak_tbps} TB/s" if peak_tbps else "HBM peak not known for this GPU"
    read = bool(rows) and rows[0].get("l2_flush") == "read"
    flushed = (f"{'reading' if read else 'writing'} {L2_FLUSH_BYTES >> 20} MB "
               f"({'clean' if read else 'dirty'} lines)")
    lines = ["# Decode: attention against a KV cache", "", *report.machine_lines(env),
             f"- command: `{command}`",
             f"- TB/s: bytes of K and V read per call / time; {peak}; "
             "copy: a device copy of those bytes (its read rate)",
             f"- L2 flushed before every call by {flushed}", "",
             "| heads (q/kv) | batch | cache | q len | pages | "
             + " | ".join(f"{b} µs (TB/s)" for b in backends)
             + " | copy TB/s | ours / best peer |",
             "|" + "---|" * (7 + len(backends))]

    def key(r):
        return r["shape"], r["batch"], r["cache"], r["seqlen_q"], r["page_size"]

    for _, group in itertools.groupby(rows, key):
        by = {r["backend"]: r for r in group}
        first = next(iter(by.values()))

        def cell(name):
            r = by.get(name)
            return f"{r['us']:.1f} ({r['tbps']:.2f})" if r and r["status"] == "ok" else "n/a"

        peers = [r["tbps"] for name, r in by.items()
                 if name not in (*OURS, "copy") and r["status"] == "ok"]
        ours = by.get("cute")
        ratio = (f"{ours['tbps'] / max(peers):.2f}" if ours and ours["status"] == "ok" and peers
                 else "n/a")
        copy = by.get("copy")
        copy_cell = f"{copy['tbps']:.2f}" if copy and copy["status"] == "ok" else "n/a"
        lines.append(f"| {first['heads']}/{first['heads_kv']} | {first['batch']} | "
                     f"{first['cache']} | {first['seqlen_q']} | {first['page_size'] or '-'} | "
                     + " | ".join(cell(b) for b in backends) + f" | {copy_cell} | {ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
