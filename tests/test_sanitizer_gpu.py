"""compute-sanitizer over every kernel family (sanitizer_cases.py): no
out-of-bounds or misaligned global or shared access (memcheck), no
shared-memory hazard between threads (racecheck), no barrier misuse
(synccheck). A control kernel with a planted race and a planted
out-of-bounds store shows that memcheck and racecheck instrument the DSL's
kernels. Skipped where compute-sanitizer is not on PATH."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

CASES = Path(__file__).with_name("sanitizer_cases.py")
FAMILIES = ["dense", "scores", "varlen", "kvcache", "fp8", "tile_streams", "block_sparse"]
TOOLS = ["memcheck", "racecheck", "synccheck"]
ERRORS_FOUND = 9  # --error-exitcode


def _sanitize(tool: str, family: str) -> subprocess.CompletedProcess:
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on PATH")
    # one allocation per tensor, so that an access past a tensor leaves its allocation
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    # API errors off: the DSL's driver bindings probe entry points that the
    # driver lacks, which the sanitizer would count as errors
    command = [sanitizer, "--tool", tool, "--report-api-errors", "no", "--print-limit", "20",
               "--error-exitcode", str(ERRORS_FOUND), sys.executable, str(CASES), family]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tool", TOOLS)
def test_kernels_are_clean_under_the_sanitizer(tool, family):
    run = _sanitize(tool, family)
    output = run.stdout + run.stderr
    assert run.returncode == 0 and f"family {family} done" in output, output[-6000:]


@pytest.mark.parametrize("tool,family,finding", [
    ("memcheck", "planted_store", "Invalid __global__ write"),
    ("racecheck", "planted_race", "Race reported")])
def test_the_sanitizer_finds_planted_errors(tool, family, finding):
    run = _sanitize(tool, family)
    output = run.stdout + run.stderr
    assert run.returncode == ERRORS_FOUND and finding in output, output[-6000:]
