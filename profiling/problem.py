"""The benchmark problem every profiling command builds the same way, and the
command-line options that describe it (one definition, one help text, for
every command that takes them)."""

from __future__ import annotations

import argparse
import math

import torch

from cute_fa.kernels.config import HEAD_DIM_MULTIPLE, SUPPORTED_HEAD_DIMS

from .cli import brace, choice_list, csv_list, one_of, positive_int

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODEL_DIM = 2048  # query heads default to MODEL_DIM // head_dim
CAUSAL_VALUES = {"no": [False], "yes": [True], "both": [False, True]}


def default_heads(head_dim: int, model_dim: int = MODEL_DIM) -> int:
    return max(1, model_dim // head_dim)


def problem_shape(head_dim: int, seqlen: int, total_tokens: int,
                  heads: int | None = None) -> tuple[int, int]:
    """(batch, query heads) of a benchmark problem: batch · seqlen = total_tokens,
    heads = MODEL_DIM // head_dim unless given."""
    from .flops import batch_for
    return batch_for(total_tokens, seqlen), heads or default_heads(head_dim)


def make_qkv(batch: int, seqlen_q: int, seqlen_k: int, heads: int, heads_kv: int, head_dim: int,
             dtype: torch.dtype, seed: int | None = None, device="cuda",
             head_dim_v: int | None = None):
    """Random q (b, sq, h, d), k (b, sk, h_kv, d) and v (b, sk, h_kv, dv), dv
    head_dim_v or d; seed None draws from the global RNG."""
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    q = torch.randn(batch, seqlen_q, heads, head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device=device, dtype=dtype,
                    generator=gen)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim_v or head_dim, device=device,
                    dtype=dtype, generator=gen)
    return q, k, v


# ------------------------------------------------------------ the options

def quantized_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """[q8, q_descale, k8, k_descale, v8, v_descale]: q, k, v in e4m3 with a
    descale per (batch, KV head), as our FP8 forward takes them."""
    from cute_fa.fp8 import quantize_fp8

    return [*quantize_fp8(q, k.shape[2]), *quantize_fp8(k), *quantize_fp8(v)]


def add_dtype_option(p, default: str | list[str] | None = "bf16", multiple: bool = False,
                     help_default: str | None = None) -> None:
    """--dtype (one) or --dtypes (a comma-separated list) of DTYPES."""
    if multiple:
        p.add_argument("--dtypes", type=choice_list(DTYPES), default=default,
                       metavar="LIST", help=f"input dtypes, comma-separated, from "
                       f"{', '.join(DTYPES)} (default: {help_default or ','.join(default)})")
    else:
        p.add_argument("--dtype", choices=list(DTYPES), default=default,
                       help=f"input dtype (default: {help_default or default})")


# What the ops take: the kernels' head dims as they are, other multiples of 8
# zero-padded to the next of them (kernels.config.kernel_head_dim).
OP_HEAD_DIMS = tuple(d for d in range(HEAD_DIM_MULTIPLE, SUPPORTED_HEAD_DIMS[-1] + 1,
                                      HEAD_DIM_MULTIPLE))


def add_head_dim_option(p, default: int | list[int] | None = 128, multiple: bool = False,
                        help_default: str | None = None, padded: bool = False) -> None:
    """--head-dim (one) or --head-dims (a comma-separated list) of the head
    dims the kernels support; padded: also those the op pads to them."""
    dims = ", ".join(map(str, SUPPORTED_HEAD_DIMS))
    if padded:
        dims = (f"multiples of {HEAD_DIM_MULTIPLE} up to {SUPPORTED_HEAD_DIMS[-1]} ({dims} run "
                f"as they are, the others zero-padded to the next of those)")
    if multiple:
        choices = OP_HEAD_DIMS if padded else SUPPORTED_HEAD_DIMS
        p.add_argument("--head-dims", type=choice_list(choices), default=default,
                       metavar="LIST", help=f"head dims, comma-separated, from {dims} (default: "
                       f"{help_default or ','.join(map(str, default))})")
    else:
        p.add_argument("--head-dim", type=one_of(SUPPORTED_HEAD_DIMS), default=default,
                       metavar=brace(SUPPORTED_HEAD_DIMS),
                       help=f"head dim, one of {dims} (default: {help_default or default})")


def add_head_dim_v_option(p, help_text: str | None = None) -> None:
    """--head-dim-v: v's head dim where it is narrower than q's (None: the same)."""
    p.add_argument("--head-dim-v", type=positive_int, default=None, metavar="DV",
                   help=help_text or "v's head dim, no larger than --head-dim (forward only; "
                                     "default: --head-dim)")


def resolve_head_dim_v(parser, args) -> None:
    """args.head_dim_v: --head-dim where not given; a usage error where it is
    wider than --head-dim."""
    if args.head_dim_v is None:
        args.head_dim_v = args.head_dim
    elif args.head_dim_v > args.head_dim:
        parser.error(f"--head-dim-v: expected at most --head-dim ({args.head_dim}), got "
                     f"{args.head_dim_v}")


def add_causal_option(p, default: str = "no", allow_both: bool = False) -> None:
    """--causal, --causal yes, --causal no (and --causal both where allowed):
    the value is a key of CAUSAL_VALUES."""
    choices = list(CAUSAL_VALUES) if allow_both else ["no", "yes"]
    p.add_argument("--causal", nargs="?", const="yes", choices=choices, default=default,
                   help="causal mask (bottom-right aligned): yes or no"
                        + (", or both: each" if allow_both else "")
                        + f"; a bare --causal means yes (default: {default})")


def add_size_options(p, seqlen: int | list[int] = 8192, multiple: bool = False,
                     model_dim: bool = False) -> None:
    """The problem's size: --seqlen (or --seqlens), --total-tokens, --heads,
    --gqa (and --model-dim where asked)."""
    if multiple:
        p.add_argument("--seqlens", type=csv_list(positive_int), default=seqlen, metavar="LIST",
                       help="sequence lengths (queries = keys), comma-separated "
                            f"(default: {','.join(map(str, seqlen))})")
    else:
        p.add_argument("--seqlen", type=positive_int, default=seqlen,
                       help=f"sequence length, queries = keys (default: {seqlen})")
    p.add_argument("--total-tokens", type=positive_int, default=16384,
                   help="tokens per call: batch = total_tokens // seqlen, at least 1 "
                        "(default: 16384)")
    if model_dim:
        p.add_argument("--model-dim", type=positive_int, default=MODEL_DIM,
                       help="query heads = model_dim // head_dim unless --heads "
                            f"(default: {MODEL_DIM})")
    p.add_argument("--heads", type=positive_int, default=None,
                   help=f"query heads (default: {MODEL_DIM} // head dim"
                        + (", or --model-dim // head dim" if model_dim else "") + ")")
    p.add_argument("--gqa", type=positive_int, default=1,
                   help="query heads per K/V head; must divide the query heads (default: 1)")


def add_dense_shape_options(p, batch: int, seqlen: int, heads: int, heads_kv: int) -> None:
    """One dense problem's shape: --batch, --seqlen (queries = keys), --heads,
    --heads-kv (check_heads_kv checks them)."""
    p.add_argument("--batch", type=positive_int, default=batch,
                   help=f"batch size (default: {batch})")
    p.add_argument("--seqlen", type=positive_int, default=seqlen,
                   help=f"sequence length, queries = keys (default: {seqlen})")
    p.add_argument("--heads", type=positive_int, default=heads,
                   help=f"query heads (default: {heads})")
    p.add_argument("--heads-kv", type=positive_int, default=heads_kv,
                   help=f"K/V heads, a divisor of --heads (default: {heads_kv})")


def check_heads_kv(parser, args) -> None:
    """parser.error unless --heads-kv divides --heads."""
    if args.heads % args.heads_kv:
        parser.error(f"--heads-kv: expected a divisor of --heads={args.heads}, got "
                     f"{args.heads_kv}")


def heads_for(args, head_dim: int) -> int:
    """The query heads of add_size_options' arguments at one head dim."""
    return args.heads or default_heads(head_dim, getattr(args, "model_dim", MODEL_DIM))


def check_gqa(parser, args, head_dims) -> None:
    """parser.error unless --gqa divides the query heads at every head dim."""
    for head_dim in head_dims:
        heads = heads_for(args, head_dim)
        if heads % args.gqa:
            parser.error(f"--gqa: expected a divisor of the {heads} query heads at head dim "
                         f"{head_dim}, got {args.gqa}")


def _window(text: str) -> tuple[int, int]:
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (ints, -1: unbounded), "
                                         f"got {text!r}") from None
    if min(left, right) < -1:
        raise argparse.ArgumentTypeError(f"expected sizes >= -1, got {text!r}")
    return left, right


def add_score_options(p, window_note: str | None = None) -> None:
    """--window, --softcap, --sink: the score modifications of every problem,
    as flash_attn_func takes them (check_score_options after parsing)."""
    note = f"; {window_note}" if window_note else ""
    p.add_argument("--window", type=_window, default=(-1, -1), metavar="LEFT,RIGHT",
                   help=f"sliding window of every problem, flash_attn_func's window_size "
                        f"(-1: unbounded side){note} (default: -1,-1, none)")
    p.add_argument("--softcap", type=float, default=0.0, metavar="C",
                   help="soft-cap every problem's scores at C (default: 0, none)")
    p.add_argument("--sink", action="store_true",
                   help="learnable sinks in every problem (one fp32 logit per query head, "
                        "flash_attn_func's learnable_sink; the backward computes their "
                        "gradient too) (default: none)")


def check_score_options(parser, args) -> None:
    if not (args.softcap >= 0):
        parser.error(f"--softcap: expected a value >= 0, got {args.softcap}")


def make_sinks(heads: int, device) -> torch.Tensor:
    """The learnable sinks of a problem with --sink: fp32 normal, seed 1."""
    gen = torch.Generator(device=device).manual_seed(1)
    return torch.randn(heads, device=device, generator=gen)


THROUGHPUT_DIRECTIONS = ("fwd", "fwd_bwd")


def add_throughput_options(p) -> None:
    """The options of the commands that report useful TFLOP/s of one
    implementation against another (varlen_bench, sparse_bench): the heads
    per head dim, the directions, the repeats."""
    p.add_argument("--heads-dim-total", type=positive_int, default=2048,
                   help="heads x head dim, the heads of each head dim (default: 2048)")
    p.add_argument("--directions", type=choice_list(THROUGHPUT_DIRECTIONS),
                   default=list(THROUGHPUT_DIRECTIONS),
                   help="fwd and/or fwd_bwd, comma-separated (default: both)")
    p.add_argument("--repeats", type=positive_int, default=20,
                   help="timed calls per implementation, the median reported (default: 20)")


def check_heads_dim_total(parser, args) -> None:
    """Every --head-dims value divides --heads-dim-total."""
    for d in args.head_dims:
        if d <= 0 or args.heads_dim_total % d:
            parser.error(f"--head-dims: expected divisors of --heads-dim-total "
                         f"{args.heads_dim_total}, got {d}")


def packed_lengths(tokens: int, min_len: int, max_len: int, seed: int) -> list[int]:
    """Sequence lengths drawn log-uniform from min_len to max_len (seeded)
    until they fill `tokens`, the last one cut to fit."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        u = torch.empty(1).uniform_(math.log(min_len), math.log(max_len), generator=gen)
        lengths.append(min(int(math.exp(u.item())), tokens - sum(lengths)))
    return lengths


def input_gradients(out, inputs: tuple, grad_out: torch.Tensor, retain_graph: bool = False):
    """The backward a benchmark times: the gradients of `inputs` from `out`
    (the first element of an output tuple), returned as an attention layer's
    backward hands them to the projections before it. out.backward would
    also add each into its input's .grad: three elementwise adds of q's,
    k's and v's size a call, no part of attention (docs/findings.md,
    Backward). An input a backend leaves out of its graph gets None, as
    .backward would leave its .grad unset."""
    out = out[0] if isinstance(out, tuple) else out
    return torch.autograd.grad(out, inputs, grad_out, retain_graph=retain_graph,
                               allow_unused=True)


def timed_step(fn, grad_out: torch.Tensor | None = None, inputs: tuple = ()):
    """What a benchmark times: fn(), and with grad_out the gradients of
    `inputs` from its output too (input_gradients)."""
    if grad_out is not None and not inputs:
        raise ValueError("inputs: expected the tensors to differentiate with grad_out, got none")

    def call():
        out = fn()
        if grad_out is not None:
            input_gradients(out, inputs, grad_out)
    return call
