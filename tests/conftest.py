import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an sm_90 (Hopper) GPU; skipped elsewhere")


def pytest_collection_modifyitems(config, items):
    if has_sm90():
        return
    skip = pytest.mark.skip(reason="needs an sm_90 (Hopper) CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
