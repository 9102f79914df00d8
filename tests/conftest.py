import pytest
import torch

def has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an sm_90 (Hopper) GPU; skipped elsewhere")


def pytest_terminal_summary(terminalreporter):
    """The DSL's library set that built the kernels (also under -q): the
    compile tests' spill and register findings are that set's ptxas's."""
    from cute_fa.kernel_store import toolkit_line

    terminalreporter.write_line(toolkit_line())


def pytest_collection_modifyitems(config, items):
    if has_sm90():
        return
    skip = pytest.mark.skip(reason="needs an sm_90 (Hopper) CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """A toy source tree prepared into a parquet dataset: (path, token counts)."""
    from cute_fa.profiling import data

    root = tmp_path_factory.mktemp("lib")
    for i in range(60):
        (root / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 20)
    (root / "site-packages").mkdir()
    (root / "site-packages" / "skip.py").write_text("ignored = True\n")
    path = str(tmp_path_factory.mktemp("data") / "toy.parquet")
    counts = data.prepare(path, str(root))
    return path, counts
