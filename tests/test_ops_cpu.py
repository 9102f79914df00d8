"""The torch op on the CPU: registration, opcheck, torch.compile, NVTX."""

import os

import pytest
import torch

import cute_fa
from cute_fa import flash_attn_func
from cute_fa.reference import attention_reference


def test_op_is_registered_under_cute_fa():
    assert hasattr(torch.ops.cute_fa, "fwd")


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_op_is_the_reference(causal):
    q = torch.randn(2, 33, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 20, 2, 64, dtype=torch.bfloat16)
    v = torch.randn(2, 20, 2, 64, dtype=torch.bfloat16)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    ref_out, ref_lse = attention_reference(q, k, v, None, causal)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert out.shape == q.shape and lse.shape == (2, 4, 33)


@pytest.mark.parametrize("head_dims", [(192, 128), (256, 256), (136, 72)])
def test_cpu_op_takes_every_head_dim_and_a_narrower_v(head_dims):
    head_dim, head_dim_v = head_dims
    q = torch.randn(1, 9, 4, head_dim, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 13, 2, head_dim, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 13, 2, head_dim_v, dtype=torch.bfloat16, requires_grad=True)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = attention_reference(q, k, v, None, True)
    assert out.shape == (1, 9, 4, head_dim_v)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    out.float().sum().backward()  # the reference backward has every head dim
    assert q.grad.shape == q.shape and v.grad.shape == v.shape
    fake = torch.compile(lambda a, b, c: flash_attn_func(a, b, c), fullgraph=True,
                         backend="eager")(q.detach(), k.detach(), v.detach())
    assert fake.shape == out.shape


def test_opcheck():
    q = torch.randn(1, 17, 4, 64, dtype=torch.float16)
    k = torch.randn(1, 9, 1, 64, dtype=torch.float16)
    v = torch.randn(1, 9, 1, 64, dtype=torch.float16)
    for causal in (False, True):
        torch.library.opcheck(torch.ops.cute_fa.fwd.default, (q, k, v, 0.125, causal))
    torch.library.opcheck(torch.ops.cute_fa.fwd.default, (q, k, v[..., :32], 0.125, True))


class TinyAttention(torch.nn.Module):
    def __init__(self, dim=128, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, dtype=torch.bfloat16)

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, dim // self.heads).unbind(2)
        return flash_attn_func(q, k, v, causal=True).reshape(b, s, dim)


def test_torch_compile_fullgraph_on_cpu():
    torch.manual_seed(0)
    model = TinyAttention()
    x = torch.randn(2, 24, 128, dtype=torch.bfloat16)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True, backend="eager")(x)
    assert torch.equal(eager, compiled)


def test_nvtx_range_name_carries_the_problem():
    from cute_fa.nvtx import range_name

    q = torch.empty(2, 100, 8, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 80, 2, 128, dtype=torch.bfloat16)
    assert range_name("fwd", q, k, True) == \
        "cute_fa.fwd[b=2,sq=100,sk=80,hq=8,hkv=2,d=128,causal=1,bf16]"
    v = torch.empty(2, 80, 2, 64, dtype=torch.bfloat16)  # v narrower than q: named
    assert range_name("fwd", q, v, False) == \
        "cute_fa.fwd[b=2,sq=100,sk=80,hq=8,hkv=2,d=128,dv=64,causal=0,bf16]"


def test_public_api():
    assert "flash_attn_func" in cute_fa.__all__


def test_autograd_kernel_routes_plain_tensors_straight_to_the_backend_kernel(monkeypatch):
    # cute_fa::fwd's Autograd kernel calls the CPU/CUDA kernel itself where a
    # redispatch would reach it anyway (host time), and redispatches otherwise:
    # fake tensors under torch.compile must reach the fake kernel.
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from cute_fa import ops

    calls = []
    cpu_kernel = ops._FWD_BACKENDS[torch._C.DispatchKey.CPU]
    monkeypatch.setitem(ops._FWD_BACKENDS, torch._C.DispatchKey.CPU,
                        lambda *args: calls.append(args[0].shape) or cpu_kernel(*args))
    q = torch.randn(1, 12, 2, 64, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, 10, 1, 64, dtype=torch.bfloat16).unbind(0)
    out, lse = torch.ops.cute_fa.fwd(q, k, v, None, True)
    assert len(calls) == 1
    q_grad = q.clone().requires_grad_(True)
    out_grad, _ = torch.ops.cute_fa.fwd(q_grad, k, v, None, True)
    assert len(calls) == 2 and out_grad.grad_fn is not None
    assert torch.equal(out_grad.detach(), out)
    out_grad.float().sum().backward()
    assert q_grad.grad is not None and torch.isfinite(q_grad.grad).all()
    with FakeTensorMode() as mode:
        fake_out, fake_lse = torch.ops.cute_fa.fwd(mode.from_tensor(q), mode.from_tensor(k),
                                                   mode.from_tensor(v), None, True)
    assert len(calls) == 2
    assert isinstance(fake_out, FakeTensor) and fake_lse.shape == lse.shape


def test_nvtx_range_names_are_cached_per_problem():
    from cute_fa.nvtx import range_name

    q = torch.empty(2, 128, 8, 64, dtype=torch.float16)
    names = {range_name(op, q, torch.empty(2, sk, hkv, 64), causal)
             for op in ("fwd", "bwd") for sk in (128, 256) for hkv in (8, 2)
             for causal in (False, True)}
    assert len(names) == 16
    assert range_name("bwd", q, torch.empty(2, 256, 2, 64), True) == \
        "cute_fa.bwd[b=2,sq=128,sk=256,hq=8,hkv=2,d=64,causal=1,fp16]"


def test_native_extension_builds():
    # The C++ host side of the CUDA kernels compiles here too (it needs no
    # CUDA toolkit beyond the NVTX 3 headers), so a compile error fails CI
    # rather than turning the GPU machine's ops back to the Python kernels.
    from cute_fa import native

    module = native.build()
    for name in ("fwd", "bwd", "register_cuda_kernels", "set_planners", "set_fallbacks",
                 "cached_plans"):
        assert callable(getattr(module, name))
    assert module.cached_plans() == 0


def test_native_build_removes_the_mark_of_a_killed_build(monkeypatch, tmp_path):
    """A build killed midway leaves torch's build-in-progress mark, on which
    the next build would wait forever; holding the folder's flock, the next
    build removes it (with a warning) and builds."""
    import torch.utils.cpp_extension as cpp_extension

    from cute_fa import native

    (tmp_path / native.TORCH_BUILD_MARK).write_text("")
    seen = []

    def load(**kwargs):
        seen.append(os.path.exists(os.path.join(kwargs["build_directory"],
                                                native.TORCH_BUILD_MARK)))
        return "module"

    monkeypatch.setattr(native, "build_folder", lambda: str(tmp_path))
    monkeypatch.setattr(native, "_nvtx_include", lambda: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", load)
    with pytest.warns(UserWarning, match="did not finish"):
        assert native.build() == "module"
    assert seen == [False]
    assert native.build() == "module" and seen == [False, False]  # no mark: no warning


def test_native_is_not_built_without_cuda_or_when_switched_off(monkeypatch):
    from cute_fa import native, ops

    assert ops._native is None  # no CUDA device here: the Python kernels serve the CUDA key
    native.load.cache_clear()
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    try:
        assert native.load() is None
    finally:
        native.load.cache_clear()
