"""What a compiled kernel is, read from the PTX and cubin the DSL dumps.

    python -m cute_fa.profiling.kernel_info                          # every default kernel
    python -m cute_fa.profiling.kernel_info --kernel bwd --head-dim 64 --causal --dtype bf16
    python -m cute_fa.profiling.kernel_info --kernel fwd --head-dim 128 --dtype bf16 \\
        --causal no --config tile_n=128,kv_stages=3

Runs on a machine without a GPU: compiles kernels for sm_90a (each in a
temporary folder; nothing is written) and prints, per kernel, the summary
table of profiling.main (threads, registers at entry, the setmaxnreg split,
shared memory, TMA/WGMMA counts, whether ptxas kept the WGMMAs asynchronous,
spills), then every PTX instruction count (PTX_PATTERNS), the stack frame
and, where nvdisasm is installed (nvidia-cuda-nvdisasm, in the test extra),
the SASS counts (SASS_PATTERNS). Each of --kernel, --dtype, --head-dim,
--causal narrows the selection (give all four for one kernel); --config sets
config fields on the op's default config (needs --kernel).

Also the library of the main job (`python -m cute_fa.profiling.main`) and the
compile tests: the instruction counts prove TMA, WGMMA, setmaxnreg and
mbarrier waits are in the kernel; the cubin's .nv.info attributes give
registers and stack frame; its SASS (nvdisasm) shows whether ptxas kept the
WGMMAs asynchronous. When it runs short of registers ptxas serialises them
(warning C7512, which the DSL does not show): it then puts a warpgroup wait
after every HGMMA, so the kernel has as many waits as HGMMAs instead of the
few its PTX asks for.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass, field

PTX_PATTERNS = {
    "wgmma": r"wgmma\.mma_async",
    "tma_load": r"cp\.async\.bulk\.tensor\.\dd\.shared::(cta|cluster)\.global",
    "tma_store": r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta",
    "setmaxnreg": r"setmaxnreg\.(inc|dec)",
    "mbarrier_wait": r"mbarrier\.try_wait",
    "named_barrier": r"\bbar(rier)?\.(sync|arrive)",
    "ex2": r"ex2\.approx",
    "stmatrix": r"stmatrix",
    "local_memory": r"\b(ld|st)\.local",
    "dq_reduce": r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32",
    "acquire_load": r"ld\.acquire\.gpu",
    "release_add": r"red\.release\.gpu",
    "vote_any": r"vote\.sync\.any",
    "atomic_add": r"\batom\.(\w+\.)*add\b",
    "fence_gpu": r"\bfence\.(acq_rel|sc)\.gpu",
}
SASS_PATTERNS = {
    "hgmma": r"\bHGMMA\.",
    "qgmma": r"\bQGMMA\.",  # e4m3 operands
    "warpgroup_wait": r"\bWARPGROUP\.DEPBAR",
    "local_memory": r"\b(STL|LDL)\b",
    # the high half of a 64-bit vector add: descriptor arithmetic left in
    # vector registers when ptxas cannot prove it warp-uniform
    "vector_add64": r"\bIMAD\.X\b",
}
_EIATTR_REGCOUNT = 0x2F
_EIATTR_FRAME_SIZE = 0x12
_EIFMT_SVAL = 4


@dataclass
class KernelInfo:
    threads: int
    counts: dict = field(default_factory=dict)
    setmaxnreg: list = field(default_factory=list)  # [(inc|dec, regs)]
    registers: int | None = None
    stack_bytes: int | None = None
    sass: dict | None = None  # SASS_PATTERNS counts, None without nvdisasm

    @property
    def warpgroups(self) -> int:
        return self.threads // 128

    @property
    def wgmma_serialized(self) -> bool | None:
        """ptxas made every WGMMA synchronous (None: SASS not read)."""
        if self.sass is None:
            return None
        gmma = self.sass["hgmma"] + self.sass.get("qgmma", 0)
        return gmma > 0 and self.sass["warpgroup_wait"] >= gmma


def ptx_info(ptx: str) -> KernelInfo:
    m = re.search(r"\.reqntid\s+(\d+)", ptx) or re.search(r"\.maxntid\s+(\d+)", ptx)
    info = KernelInfo(threads=int(m.group(1)) if m else 0)
    info.counts = {name: len(re.findall(pat, ptx)) for name, pat in PTX_PATTERNS.items()}
    info.setmaxnreg = [(kind, int(n)) for kind, n in
                       re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)]
    return info


def cubin_resources(data: bytes) -> tuple[int | None, int | None]:
    """(registers, stack frame bytes) of the kernel from the cubin's .nv.info section."""
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    names_offset = sections[shstrndx][4]
    regs = stack = None
    for sec in sections:
        start = names_offset + sec[0]
        if data[start:data.index(b"\0", start)] != b".nv.info":
            continue
        pos, end = sec[4], sec[4] + sec[5]
        while pos < end:
            fmt, attr, size = struct.unpack_from("<BBH", data, pos)
            if fmt != _EIFMT_SVAL:
                pos += 4
                continue
            if attr == _EIATTR_REGCOUNT:
                regs = struct.unpack_from("<II", data, pos + 4)[1]
            elif attr == _EIATTR_FRAME_SIZE:
                stack = struct.unpack_from("<II", data, pos + 4)[1]
            pos += 4 + size
    return regs, stack


def nvdisasm_path() -> str | None:
    """nvdisasm of the nvidia-cuda-nvdisasm wheel, else the one on PATH."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(glob.glob(os.path.join(root, "*", "bin", "nvdisasm")))
        if found:
            return found[-1]
    return shutil.which("nvdisasm")


def sass_text(cubin_path: str) -> str | None:
    """The disassembled code of a cubin, None when nvdisasm is missing."""
    tool = nvdisasm_path()
    if tool is None:
        return None
    return subprocess.run([tool, "-c", cubin_path], check=True, capture_output=True,
                          text=True).stdout


def sass_counts(cubin_path: str) -> dict | None:
    """SASS_PATTERNS counts of a cubin's code, None when nvdisasm is missing."""
    sass = sass_text(cubin_path)
    if sass is None:
        return None
    return {name: len(re.findall(pat, sass)) for name, pat in SASS_PATTERNS.items()}


def dumped_kernel_info(dump_dir: str) -> KernelInfo:
    ptx_files = glob.glob(os.path.join(dump_dir, "*.ptx"))
    if len(ptx_files) != 1:
        raise RuntimeError(f"expected one .ptx in {dump_dir}, found {len(ptx_files)}")
    with open(ptx_files[0]) as f:
        info = ptx_info(f.read())
    cubins = glob.glob(os.path.join(dump_dir, "*.cubin"))
    if cubins:
        with open(cubins[0], "rb") as f:
            info.registers, info.stack_bytes = cubin_resources(f.read())
        info.sass = sass_counts(cubins[0])
    return info


# ------------------------------------------------------ the main loop in SASS

_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
# `BRA `(.L_x_2)`, and `@!P1 BRA P2, `(.L_x_26)`: a branch taken on two predicates.
_SASS_BRANCH = re.compile(r"\bBRA\s+(?:!?U?P[T\d]+,\s*)?`?\(?(\.L_x_\d+)")


def sass_instructions(sass: str) -> tuple[list[str], dict[str, int]]:
    """The instructions of a disassembly in order, and each label's index."""
    instructions, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = _SASS_LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        inst = _SASS_LINE.match(line)
        if inst:
            for name in pending:
                labels[name] = len(instructions)
            pending = []
            instructions.append(inst.group(2))
    return instructions, labels


def opcode(instruction: str) -> str:
    """`@!P0 SYNCS.ARRIVE.TRANS64 RZ, ...` -> `SYNCS`."""
    return re.sub(r"^@!?U?P[T\d]+\s+", "", instruction).split()[0].split(".")[0]


def _hgmma_loops(instructions: list[str], labels: dict[str, int]) -> list[tuple[int, int, int]]:
    loops = []
    for end, inst in enumerate(instructions):
        branch = _SASS_BRANCH.search(inst)
        if branch and labels.get(branch.group(1), end + 1) <= end:
            start = labels[branch.group(1)]
            count = sum("HGMMA" in i for i in instructions[start:end + 1])
            if count:
                loops.append((start, end, count))
    return sorted(loops, key=lambda loop: loop[1] - loop[0])


def hgmma_loops(sass: str) -> list[tuple[int, int, int]]:
    """(first, last, HGMMAs) of every loop (a backward branch and its target)
    that issues HGMMAs, innermost first."""
    return _hgmma_loops(*sass_instructions(sass))


def _step_loop(instructions: list[str], labels: dict[str, int], hgmmas_per_step: int):
    for start, end, count in _hgmma_loops(instructions, labels):
        if count == hgmmas_per_step:
            return start, end
    return None


def step_loop(sass: str, hgmmas_per_step: int):
    """(instructions, first, last) of the innermost loop issuing
    `hgmmas_per_step` HGMMAs (one main-loop step), None when none does."""
    instructions, labels = sass_instructions(sass)
    found = _step_loop(instructions, labels, hgmmas_per_step)
    return None if found is None else (instructions, *found)


def step_loop_spills(sass: str, hgmmas_per_step: int) -> tuple[int, int]:
    """(local memory instructions inside main-loop steps, in all): the steps
    are every loop issuing exactly `hgmmas_per_step` HGMMAs (masked and
    unmasked variants of the step)."""
    instructions, labels = sass_instructions(sass)
    spills = [i for i, inst in enumerate(instructions) if opcode(inst) in ("LDL", "STL")]
    steps = [(a, b) for a, b, n in _hgmma_loops(instructions, labels) if n == hgmmas_per_step]
    return sum(any(a <= i <= b for a, b in steps) for i in spills), len(spills)


def mask_regions(instructions: list[str], labels: dict[str, int], start: int,
                 end: int) -> list[tuple[int, int]]:
    """(first, last) of each stretch of the loop [start, end] that a
    predicated forward branch jumps over and that sets scores to -inf: the
    masking code, which runs only on the blocks that need it (the diagonal,
    the sequence edge), not on a steady step."""
    regions = []
    for i in range(start, end + 1):
        inst = instructions[i]
        branch = _SASS_BRANCH.search(inst)
        if not (branch and inst.startswith("@")):
            continue
        target = labels.get(branch.group(1))
        if target is None or not i < target <= end + 1:
            continue
        if any("-INF" in x for x in instructions[i + 1:target] if opcode(x) == "FSEL"):
            regions.append((i + 1, target - 1))
    return regions


def unmasked_step_count(sass: str, hgmmas_per_step: int) -> int | None:
    """Instructions of one main-loop step on a block that needs no mask: the
    step's loop without its masking stretches (mask_regions)."""
    instructions, labels = sass_instructions(sass)
    found = _step_loop(instructions, labels, hgmmas_per_step)
    if found is None:
        return None
    start, end = found
    skipped = sum(last - first + 1
                  for first, last in mask_regions(instructions, labels, start, end))
    return end - start + 1 - skipped


def main_loop_mix(sass: str, hgmmas_per_step: int):
    """The opcode counts of the innermost loop that issues `hgmmas_per_step`
    HGMMAs (one K/V step of the forward: S = Q·Kᵀ and O += P·V), and its
    instructions; None when no loop matches."""
    from collections import Counter

    found = step_loop(sass, hgmmas_per_step)
    if found is None:
        return None
    instructions, start, end = found
    body = instructions[start:end + 1]
    return Counter(opcode(i) for i in body), body


# ------------------------------------------- live registers through the loop

_LIVE_COUNT = re.compile(r";\s*//\s*\|\s*(\d*)\s*\|")


def ptxas_path() -> str | None:
    """A standalone ptxas: $CUDA_HOME/bin, else PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = os.path.join(home, "bin", "ptxas")
    return candidate if os.access(candidate, os.X_OK) else shutil.which("ptxas")


def live_register_listing(ptx_path: str) -> tuple[str, list[int]]:
    """(listing, live vector registers at each instruction) of a PTX file's code.

    nvdisasm's register life ranges need a cubin in the format ptxas writes,
    not the DSL's, so the PTX is assembled again here (same target, ptxas's
    defaults). The live count is the pressure ptxas allocated against: where
    it nears the setmaxnreg budget, ptxas spills or serialises WGMMAs.
    """
    ptxas, nvdisasm = ptxas_path(), nvdisasm_path()
    if ptxas is None or nvdisasm is None:
        raise RuntimeError("register liveness needs ptxas (CUDA toolkit; CUDA_HOME or PATH) "
                           "and nvdisasm (pip install nvidia-cuda-nvdisasm)")
    cubin = ptx_path + ".ptxas.cubin"
    subprocess.run([ptxas, "-arch=sm_90a", ptx_path, "-o", cubin], check=True,
                   capture_output=True)
    listing = subprocess.run([nvdisasm, "-c", "-plr", "-lrm", "count", cubin], check=True,
                             capture_output=True, text=True).stdout
    live = []
    for line in listing.splitlines():
        if _SASS_LINE.match(line):
            count = _LIVE_COUNT.search(line)
            live.append(int(count.group(1) or 0) if count else 0)
    return listing, live


def loop_liveness(ptx_path: str, hgmmas_per_step: int) -> tuple[int, int] | None:
    """(registers live on entering the loop that issues `hgmmas_per_step`
    HGMMAs, the most live anywhere in it): the first is what the loop carries
    from step to step (accumulators and bookkeeping), the second its peak."""
    listing, live = live_register_listing(ptx_path)
    found = step_loop(listing, hgmmas_per_step)
    if found is None:
        return None
    _, start, end = found
    return live[start], max(live[start:end + 1])


# ------------------------------------------------------------ command line

def build_parser():
    from .cli import KERNELS, add_kernel_option, command_parser
    from .problem import add_causal_option, add_dtype_option, add_head_dim_option

    p = command_parser("kernel_info", __doc__)
    add_kernel_option(p, None, help_default=f"each of {', '.join(KERNELS)}")
    add_dtype_option(p, None, help_default="each")
    add_head_dim_option(p, None, help_default="each")
    add_causal_option(p, "both", allow_both=True)
    p.add_argument("--config", default="", metavar="FIELD=VALUE,...",
                   help="config overrides on the op's default config (FwdConfig with "
                        "--kernel fwd, BwdConfig with --kernel bwd), e.g. "
                        "'tile_n=128,kv_stages=3' (booleans: 0/1) (default: none)")
    return p


def format_counts(kind: str, rows: list[dict]) -> str:
    """Every count of describe_kernels' rows of `kind`: one table per dtype,
    a column per kernel."""
    from .main import format_columns

    names = ([("stack bytes", lambda i: i.stack_bytes if i.stack_bytes is not None else "?")]
             + [(f"ptx {n}", lambda i, n=n: i.counts[n]) for n in PTX_PATTERNS]
             + [(f"sass {n}", lambda i, n=n: "-" if i.sass is None else i.sass[n])
                for n in SASS_PATTERNS])
    tables = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        kernels = [r for r in rows if r["dtype"] == dtype]
        columns = [(f"{kind} {dtype}", -20, lambda item: item[0])]
        for r in kernels:
            header = f"d{r['head_dim']}" + (" causal" if r["causal"] else "")
            columns.append((header, max(len(header), 6),
                            lambda item, info=r["info"]: item[1](info)))
        tables.append(format_columns(columns, names))
    sass_note = ("" if all(r["info"].sass is not None for r in rows)
                 else "\nsass: - (no nvdisasm: pip install nvidia-cuda-nvdisasm)")
    return "\n\n".join(tables) + sass_note


def main(argv=None) -> dict[str, list[dict]]:
    from cute_fa.kernels.config import SUPPORTED_HEAD_DIMS

    from .cli import KERNELS, config_overrides, config_with
    from .main import describe_kernels, print_kernels
    from .problem import CAUSAL_VALUES, DTYPES

    p = build_parser()
    args = p.parse_args(argv)
    kinds = [args.kernel] if args.kernel else list(KERNELS)
    dtypes = [args.dtype] if args.dtype else list(DTYPES)
    head_dims = [args.head_dim] if args.head_dim else list(SUPPORTED_HEAD_DIMS)
    causals = CAUSAL_VALUES[args.causal]
    overrides = {}
    if args.config:
        if not args.kernel:
            p.error("--config: needs --kernel fwd or bwd (each kernel has its own config "
                    "fields)")
        try:
            overrides = config_overrides([args.config], args.kernel)
        except ValueError as exc:
            p.error(f"--config: {exc}")
        for head_dim in head_dims:  # before any compile
            for causal in causals:
                config_with(p, "--config", args.kernel, head_dim, causal, overrides)
    out = {}
    for kind in kinds:
        rows = describe_kernels(kind, dtypes, head_dims, causals, overrides)
        print_kernels(kind, rows)
        print("\n" + format_counts(kind, rows))
        out[kind] = rows
    return out


if __name__ == "__main__":
    main()
