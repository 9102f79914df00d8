"""The on-disk kernel store: hits, misses, keys, concurrent writers, damaged
entries and the off switch (CPU; one test compiles a real kernel for sm_90a)."""

import itertools
import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cute_fa import kernel_store


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A private cache folder; export/load replaced by identity on bytes, so
    the mechanics are tested without compiling."""
    monkeypatch.setenv("CUTE_FA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(kernel_store.ENABLE_ENV_VAR, raising=False)
    monkeypatch.setattr(kernel_store, "export", lambda fn, name: fn)
    monkeypatch.setattr(kernel_store, "load", lambda name, data: data)
    return tmp_path


def _builder(calls, objects=None):
    def build():
        calls.append(1)
        return dict(objects or {"main": b"\x7fELF main", "post": b"\x7fELF post"})
    return build


def test_miss_then_hit(store):
    calls = []
    first, loaded = kernel_store.load_or_build(("fwd", 1), "sm_90a", _builder(calls))
    assert not loaded and calls == [1]
    second, loaded = kernel_store.load_or_build(("fwd", 1), "sm_90a", _builder(calls))
    assert loaded and calls == [1] and second == first


def test_every_key_part_makes_a_new_entry(store, monkeypatch):
    calls = []
    kernel_store.load_or_build(("fwd", "config A"), "sm_90a", _builder(calls))
    kernel_store.load_or_build(("fwd", "config B"), "sm_90a", _builder(calls))
    kernel_store.load_or_build(("fwd", "config A"), "sm_100a", _builder(calls))
    assert len(calls) == 3
    monkeypatch.setattr(kernel_store, "_versions", lambda: ("9.9", "x", "y"))
    kernel_store.load_or_build(("fwd", "config A"), "sm_90a", _builder(calls))
    monkeypatch.setattr(kernel_store, "source_digest", lambda: "edited sources")
    kernel_store.load_or_build(("fwd", "config A"), "sm_90a", _builder(calls))
    assert len(calls) == 5
    assert len(list(kernel_store.folder().glob("*.kernels"))) == 5


@pytest.mark.parametrize("installed, driver, chosen", [
    ((12, 13), None, 13),  # no driver (a CPU machine): the newest, as the DSL picks
    ((12, 13), 13, 13),
    ((12, 13), 12, 12),  # a CUDA 12 driver: the DSL loads its CUDA 12 libraries
    ((12,), 13, 12),
    ((13,), 12, None),  # no set the driver runs (the DSL refuses to load)
    ((), None, None)])
def test_the_dsl_toolkit_is_the_one_the_dsl_loads(monkeypatch, installed, driver, chosen):
    versions = {f"nvidia-cutlass-dsl-libs-cu{cuda}": "4.8.1" for cuda in installed}
    monkeypatch.setattr(kernel_store.user_cache, "installed_version", versions.get)
    monkeypatch.setattr(kernel_store, "_driver_cuda_major", lambda: driver)
    kernel_store.dsl_toolkit.cache_clear()
    try:
        assert kernel_store.dsl_toolkit() == chosen
        line = kernel_store.toolkit_line()  # what reports of spills name
        assert (f"CUDA {chosen} libraries" in line) if chosen else ("no library set" in line)
    finally:
        kernel_store.dsl_toolkit.cache_clear()


def test_entries_belong_to_the_dsl_toolkit_that_builds_them(store, monkeypatch):
    """The DSL's CUDA 12 and 13 libraries compile the same kernel differently
    and link their own runtime: an environment never loads the other
    set's entry from a shared cache folder."""
    calls = []
    for toolkit in (12, 13, 12):
        monkeypatch.setattr(kernel_store, "dsl_toolkit", lambda toolkit=toolkit: toolkit)
        kernel_store.load_or_build(("fwd", 1), "sm_90a", _builder(calls))
    assert len(calls) == 2
    assert len(list(kernel_store.folder().glob("*.kernels"))) == 2


def test_source_digest_covers_the_kernels():
    from cute_fa import kernels

    digest = kernel_store.source_digest()
    assert len(digest) == 64
    assert os.path.exists(os.path.join(os.path.dirname(kernels.__file__), "fwd_sm90.py"))


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "other_key", "garbage", "empty"])
def test_a_damaged_entry_is_rebuilt_not_loaded(store, damage):
    calls = []
    key = ("bwd", 2)
    kernel_store.load_or_build(key, "sm_90a", _builder(calls))
    path = kernel_store.entry_path(kernel_store.describe(key, "sm_90a"))
    blob = path.read_bytes()
    if damage == "truncate":
        blob = blob[:-3]
    elif damage == "flip_byte":
        blob = blob[:-1] + bytes([blob[-1] ^ 1])
    elif damage == "other_key":
        blob = blob.replace(b"bwd", b"fwd", 1)
    elif damage == "garbage":
        blob = os.urandom(len(blob))
    else:
        blob = b""
    path.write_bytes(blob)
    assert kernel_store.read(kernel_store.describe(key, "sm_90a")) is None
    fresh = {"main": b"rebuilt", "post": b"rebuilt too"}
    got, loaded = kernel_store.load_or_build(key, "sm_90a", _builder(calls, fresh))
    assert not loaded and got == fresh and len(calls) == 2
    assert kernel_store.read(kernel_store.describe(key, "sm_90a")) == fresh


def test_off_switch_reads_and_writes_nothing(store, monkeypatch):
    monkeypatch.setenv(kernel_store.ENABLE_ENV_VAR, "0")
    calls = []
    for _ in range(2):
        _, loaded = kernel_store.load_or_build(("fwd", 3), "sm_90a", _builder(calls))
        assert not loaded
    assert len(calls) == 2
    assert not list(store.rglob("*.kernels"))


def test_unwritable_cache_costs_the_cache_not_the_call(tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CUTE_FA_CACHE_DIR", str(blocker))
    monkeypatch.setattr(kernel_store, "export", lambda fn, name: fn)
    with pytest.warns(UserWarning, match="kernel cache"):
        got, loaded = kernel_store.load_or_build(("fwd", 4), "sm_90a",
                                                 _builder([], {"main": b"x"}))
    assert got == {"main": b"x"} and not loaded


def _write_many(folder: str, payload: bytes, rounds: int) -> None:
    os.environ["CUTE_FA_CACHE_DIR"] = folder
    for _ in range(rounds):
        kernel_store.write("shared key", {"main": payload})


def test_processes_writing_one_entry_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_FA_CACHE_DIR", str(tmp_path))
    payload = os.urandom(1 << 20)  # large enough for writes to interleave
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_write_many, args=(str(tmp_path), payload, 20))
               for _ in range(4)]
    for w in workers:
        w.start()
    seen = 0
    while any(w.is_alive() for w in workers):
        got = kernel_store.read("shared key")
        assert got in (None, {"main": payload})  # never a partial entry
        seen += got is not None
    for w in workers:
        w.join()
        assert w.exitcode == 0
    assert kernel_store.read("shared key") == {"main": payload}
    assert not list(tmp_path.rglob("*.partial"))


def test_a_new_process_loads_a_compiled_kernel(tmp_path):
    """A real forward kernel: compiled and stored by one process, loaded (not
    compiled, and without importing the DSL) by the next; a config change is a
    new entry; without a C compiler the DSL's object file is stored and loaded."""
    script = textwrap.dedent("""
        import sys, torch
        from cute_fa import compile_cache
        from cute_fa.kernels.config import default_fwd_config
        config = default_fwd_config(64, False).replace(tile_n=int(sys.argv[1]))
        k = compile_cache.get_fwd(torch.bfloat16, 64, False, config)
        print("FROM_DISK", k.from_disk, type(k.fn).__name__, "cutlass" in sys.modules)
    """)

    def run(tile_n, cache, **env_changes):
        env = dict(os.environ, CUTE_FA_CACHE_DIR=str(tmp_path / cache), **env_changes)
        env.pop(kernel_store.ENABLE_ENV_VAR, None)
        out = subprocess.run([sys.executable, "-c", script, str(tile_n)], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return [l for l in out.stdout.splitlines() if l.startswith("FROM_DISK")][0]

    from cute_fa.kernels.config import default_fwd_config

    tile_n = default_fwd_config(64, False).tile_n
    assert run(tile_n, "a").startswith("FROM_DISK False")
    assert run(tile_n, "a") == "FROM_DISK True Function False"
    assert run(tile_n // 2, "a").startswith("FROM_DISK False")
    assert len(list((tmp_path / "a").rglob("*.kernels"))) == 2
    # no C compiler: the object file, loaded through the DSL
    assert run(tile_n, "b", CC="false").startswith("FROM_DISK False")
    assert run(tile_n, "b", CC="false") == "FROM_DISK True Function True"


_GPU_SCRIPT = textwrap.dedent("""
    import sys, torch
    from cute_fa import flash_attn_func, compile_cache
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g,
                           requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    from_disk = sorted(str(c.from_disk) for c in compile_cache._cache.values())
    torch.save({"out": out.detach().cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(),
                "dv": v.grad.cpu(), "from_disk": from_disk}, sys.argv[1])
""")


@pytest.mark.gpu
def test_stored_kernels_compute_what_compiled_ones_do(tmp_path):
    """Forward and backward in a process that compiles them and in one that
    loads them from the store: the same bits."""
    env = dict(os.environ, CUTE_FA_CACHE_DIR=str(tmp_path / "cache"))
    env.pop(kernel_store.ENABLE_ENV_VAR, None)
    results = []
    for run in ("compiled", "loaded"):
        path = tmp_path / f"{run}.pt"
        out = subprocess.run([sys.executable, "-c", _GPU_SCRIPT, str(path)], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        results.append(torch.load(path))
    compiled, loaded = results
    assert set(compiled["from_disk"]) == {"False"} and set(loaded["from_disk"]) == {"True"}
    for name in ("out", "dq", "dk", "dv"):
        assert torch.equal(compiled[name], loaded[name]), name


def test_precompile_command_line():
    from cute_fa import precompile

    parser = precompile.build_parser()
    for action in parser._actions:
        if action.dest != "help":
            assert action.help, action.dest
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--head-dims", "80"])
    assert exc.value.code == 2
    todo = precompile.variants([64, 128], ["bf16"], (False, True), ["fwd", "bwd"], False)
    assert len(todo) == 2 * 2 * (1 + 4)  # fwd + bwd x deterministic x split_gqa
    assert len({v.label() for v in todo}) == len(todo)
    # with the short tiles: those whose configs differ, the two-CTA ones of a
    # grid of few tiles (head dim 64, whose short tiles are three CTAs an SM,
    # or three tile streams non-causal), the narrow ones of a batch-1 grid and the tiny ones of the
    # shortest rows included, and the
    # causal ones with tiles dealt by index, as a grid of one wave takes them
    # (config.fwd_config_for_problem)
    short = precompile.variants([64, 128], ["bf16"], (False, True), ["fwd"], False,
                                length_tiles=True)
    # and those with a Q ring with one Q stage, as a grid of one round takes them
    assert [v.label() for v in short] == [
        "fwd bf16 d64 full", "fwd bf16 d64 full short", "fwd bf16 d64 full short few_tiles",
        "fwd bf16 d64 full short few_tiles one_round",
        "fwd bf16 d64 causal", "fwd bf16 d64 causal short", "fwd bf16 d64 causal short few_tiles",
        "fwd bf16 d64 causal short tiny", "fwd bf16 d64 causal by_index",
        "fwd bf16 d64 causal short few_tiles by_index", "fwd bf16 d64 causal short tiny by_index",
        "fwd bf16 d64 causal one_round by_index",
        "fwd bf16 d64 causal short few_tiles one_round by_index", "fwd bf16 d128 full",
        "fwd bf16 d128 full short", "fwd bf16 d128 full short narrow",
        "fwd bf16 d128 full short one_round", "fwd bf16 d128 full short narrow one_round",
        "fwd bf16 d128 causal", "fwd bf16 d128 causal short", "fwd bf16 d128 causal short narrow",
        "fwd bf16 d128 causal short tiny", "fwd bf16 d128 causal by_index",
        "fwd bf16 d128 causal short by_index", "fwd bf16 d128 causal short narrow by_index",
        "fwd bf16 d128 causal short tiny by_index",
        "fwd bf16 d128 causal short one_round by_index",
        "fwd bf16 d128 causal short narrow one_round by_index"]
    narrow_one_round = precompile.config_of(short[-1])
    assert (narrow_one_round.tile_m, narrow_one_round.q_stages) == (64, 1)
    assert not narrow_one_round.dynamic_tiles
    # head dim 96: the long tiles of a causal problem, claimed and dealt by index
    d96 = precompile.variants([96], ["bf16"], (False, True), ["fwd"], False, length_tiles=True)
    assert [v.label() for v in d96] == [
        "fwd bf16 d96 full", "fwd bf16 d96 full short", "fwd bf16 d96 full short wide",
        "fwd bf16 d96 full short one_round", "fwd bf16 d96 causal", "fwd bf16 d96 causal long_rows",
        "fwd bf16 d96 causal long_rows by_index", "fwd bf16 d96 causal short",
        "fwd bf16 d96 causal by_index", "fwd bf16 d96 causal short by_index",
        "fwd bf16 d96 causal short one_round by_index"]
    assert precompile.config_of(d96[2]).tile_m == precompile.config_of(d96[5]).tile_m == 192
    # every config the op picks for these is among them
    from cute_fa.kernels.config import PLAIN_FEATURES, fwd_config_for_problem
    configs = {precompile.config_of(v) for v in short + d96}
    for head_dim, causal, seqlen, query_heads in itertools.product(
            (64, 96, 128), (False, True), (128, 256, 512, 1024, 4096, 8192, 16384),
            (1, 16, 21, 64, 4096)):
        assert fwd_config_for_problem(head_dim, causal, None, PLAIN_FEATURES, seqlen, seqlen,
                                      query_heads, 132) in configs
    # the large head dims and a narrower v: forward and backward of each pair
    large = precompile.variants([128, 192, 256], ["bf16"], (False,), ["fwd", "bwd"], False,
                                head_dims_v=[128, 192])
    flavours = ("", " deterministic", " split_gqa", " deterministic split_gqa")
    assert sorted(v.label() for v in large) == sorted(
        label for dims in ("d128", "d192 dv128", "d192", "d256 dv128", "d256 dv192")
        for label in [f"fwd bf16 {dims} full"] + [f"bwd bf16 {dims} full{f}" for f in flavours])
    assert precompile.config_of(next(v for v in large if v.label() == "bwd bf16 d256 dv192 full"
                                     )).dim_split == 2
    assert precompile.config_of(next(v for v in large if v.label() == "bwd bf16 d192 dv128 full"
                                     )).keys_on_n
    large = [v for v in large if v.direction == "fwd"]
    assert precompile.config_of(large[-1]).o_in_v_smem


def test_precompile_builds_the_decode_kernels_the_op_picks(monkeypatch):
    """--directions decode: split and not, per page size (0: contiguous),
    steps of one query tile per KV head and of more, each with the 64-key
    steps of short parts (decode.SHORT_PART_KEYS), the (config, features)
    decode.py asks for at run time; the ops' AOT export keeps its fwd and
    bwd."""
    from cute_fa import aot, decode, precompile

    args = precompile.build_parser().parse_args(
        ["--directions", "decode", "--head-dims", "128", "--dtypes", "bf16", "--causal", "no",
         "--page-sizes", "0,16,256"])
    todo = precompile.chosen_variants(args)
    # groups 4 and 8 (the default --query-groups) divide the tile: several
    # tokens' rows are read in place, a kernel per group, causal or not
    assert sorted(v.label() for v in todo) == sorted(
        f"decode bf16 d128 full{s}{m}{short}{p}{g}" for s in ("", " split_kv")
        for m in ("", " many_q_tiles") for p in ("", " pages16", " pages256")
        for g in ("", " group4", " group8") for short in ("", " short_parts"))
    asked = []
    monkeypatch.setattr("cute_fa.compile_cache.get_fwd", lambda *a: asked.append(a))
    for v in todo:
        precompile.kernels_of(v)
    for page, split, group, one_tile, short in itertools.product(
            (None, 16, 256), (False, True), (1, 4, 8), (False, True), (False, True)):
        key = (torch.bfloat16, 128, False,
               decode.kernel_config(128, 128, page, short_parts=short), 128,
               decode.kernel_features(split, page is not None, group, one_tile))
        assert key in asked
    assert decode.kernel_config(128, 128, 16).kv_load_rows == 16
    # head dim 256 steps 64 keys and pages of 48 one page either way: no twin
    for dims, pages, twins in (("256", "0", 0), ("128", "48", 0), ("128", "0", 4)):
        args = precompile.build_parser().parse_args(
            ["--directions", "decode", "--head-dims", dims, "--dtypes", "bf16", "--causal",
             "no", "--page-sizes", pages, "--query-groups", "1"])
        labels = [v.label() for v in precompile.chosen_variants(args)]
        assert len(labels) == 4 + twins and sum("short_parts" in x for x in labels) == twins
    # causal: one kernel per group size (each token's g rows share its mask row)
    args = precompile.build_parser().parse_args(
        ["--directions", "decode", "--head-dims", "128", "--dtypes", "bf16", "--causal", "yes",
         "--page-sizes", "0", "--query-groups", "1,4"])
    todo = precompile.chosen_variants(args)
    assert sorted(v.label() for v in todo) == sorted(
        f"decode bf16 d128 causal{s}{m}{short}{g}" for s in ("", " split_kv")
        for m in ("", " many_q_tiles") for g in ("", " group4") for short in ("", " short_parts"))
    asked.clear()
    for v in todo:
        precompile.kernels_of(v)
    for split in (False, True):
        key = (torch.bfloat16, 128, True, decode.kernel_config(128, 128, None), 128,
               decode.kernel_features(split, False, 4))
        assert key in asked
    # e4m3 caches: bf16 out, each kernel also with the small grid's stages, the e4m3 append
    args = precompile.build_parser().parse_args(
        ["--directions", "decode_fp8", "--head-dims", "128", "--dtypes", "bf16,fp16",
         "--causal", "no", "--page-sizes", "0,48", "--query-groups", "1"])
    todo = precompile.chosen_variants(args)
    assert sorted(v.label() for v in todo) == sorted(  # fp16: no e4m3 output; 48: gathered
        f"decode_fp8 bf16 d128 full{s}{g}{m}" for s in ("", " split_kv")
        for g in ("", " small_grid") for m in ("", " many_q_tiles"))
    asked.clear()
    for v in todo:
        precompile.kernels_of(v)
    for split, small in ((False, False), (True, True)):
        config = decode.kernel_config(128, 128, None, True, small)
        assert config.kv_stages == (decode.E4M3_SMALL_GRID_STAGES if small else 2)
        assert (torch.float8_e4m3fn, 128, False, config, 128,
                decode.kernel_features(split, False), torch.bfloat16) in asked
    with pytest.raises(SystemExit):
        precompile.build_parser().parse_args(["--query-groups", "0"])
    with pytest.raises(SystemExit):
        precompile.build_parser().parse_args(["--page-sizes", "24"])
    with pytest.raises(SystemExit):
        aot.build_parser().parse_args(["--directions", "decode", "--out", "x"])


def test_precompile_builds_the_fp8_forwards_the_op_picks(monkeypatch):
    """--directions fp8: the e4m3 forwards, keyed as the op asks for them
    (--dtypes names the output's), whatever the row length."""
    from cute_fa import precompile
    from cute_fa.kernels.config import FP8_HEAD_DIMS, PLAIN_FEATURES, fp8_config_for_problem

    args = precompile.build_parser().parse_args(
        ["--directions", "fp8", "--dtypes", "bf16,fp16", "--causal", "both"])
    todo = precompile.chosen_variants(args)
    assert {v.head_dim for v in todo} == set(FP8_HEAD_DIMS)
    assert len({v.label() for v in todo}) == len(todo) < 4 * 2 * 2 * len(FP8_HEAD_DIMS)
    asked = []
    monkeypatch.setattr("cute_fa.compile_cache.get_fwd", lambda *a: asked.append(a))
    for v in todo:
        precompile.kernels_of(v)
    for head_dim, causal, keys, out_dtype in itertools.product(
            FP8_HEAD_DIMS, (False, True), (1, 300, 1024, 1025, 2048, 4095, 4096, 9000, 16383,
                                           16384, 1 << 20), (torch.bfloat16, torch.float16)):
        config = fp8_config_for_problem(head_dim, causal, PLAIN_FEATURES, keys)
        assert (torch.float8_e4m3fn, head_dim, causal, config, head_dim, PLAIN_FEATURES,
                out_dtype) in asked, (head_dim, causal, keys)
    # a narrower v has no e4m3 kernel: nothing to build for it
    assert not precompile.variants([128], ["bf16"], (False,), ["fp8"], False, head_dims_v=[64])


def test_precompile_builds_the_block_sparse_kernels_the_op_picks(monkeypatch):
    """--directions block_sparse: the forward and the backward (split_gqa and
    not) with the (config, features) the block-sparse op asks for; no causal
    variants (the mask holds every limit)."""
    from cute_fa import precompile
    from cute_fa.kernels.config import Features, default_fwd_config
    from cute_fa.kernels.bwd_config import bwd_config_for_problem

    args = precompile.build_parser().parse_args(
        ["--directions", "block_sparse", "--head-dims", "128", "--dtypes", "bf16",
         "--causal", "both"])
    todo = precompile.chosen_variants(args)
    assert sorted(v.label() for v in todo) == sorted(
        ["fwd bf16 d128 full block_sparse", "bwd bf16 d128 full block_sparse",
         "bwd bf16 d128 full split_gqa block_sparse"])
    asked = []
    monkeypatch.setattr("cute_fa.compile_cache.get_fwd", lambda *a: asked.append(("fwd", *a)))
    monkeypatch.setattr("cute_fa.compile_cache.get_bwd",
                        lambda *a, **k: asked.append(("bwd", *a, k.get("head_dim_v"))))
    for v in todo:
        precompile.kernels_of(v)
    features = Features(block_sparse=True)
    fwd = default_fwd_config(128, False, 128, features)
    assert ("fwd", torch.bfloat16, 128, False, fwd, 128, features) in asked
    for heads_kv, batch in ((8, 8), (2, 1)):  # one CTA per KV head, or split_gqa
        bwd = bwd_config_for_problem(128, False, False, batch, 8192, 8, heads_kv, 132, features)
        assert ("bwd", torch.bfloat16, 128, False, bwd, False, features, 128) in asked
