"""Shared fixtures: the devices a test runs on (CPU always, GPUs when jax has them)."""

from __future__ import annotations

import os

# Eight host CPU devices for the sharding tests (tests/test_sharding.py). XLA reads the flag
# once, when jax starts its CPU backend, so it must be set before jax is imported. It only adds
# host devices: every other test keeps using the first device. Left alone if the caller set it.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

# Every kernel run in the tests first fills its output with NaN (csrc/common/debug.h), and the
# checks reject NaN: an element the kernel forgot to write cannot pass. Set before jaxfuse loads.
os.environ.setdefault("JAXFUSE_POISON_OUTPUTS", "1")

# The tests check jaxfuse's own kernels, so plans run them rather than whichever of them and
# XLA measures faster (tests/test_solvers.py covers that choice, asking for it per plan).
os.environ.setdefault("JAXFUSE_SOLVER", "fused")

import jax
import pytest

# Child processes the tests start run with `python -P` (Python >= 3.11): without it, `-c`/`-m`
# put the working directory (the source tree) first on sys.path, and the children would import
# the uncompiled sources instead of the installed package.


def _gpu_devices() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """Plans compiled and measured afresh: a disk cache of the test's own, no plans in memory."""
    import jaxfuse as jf

    monkeypatch.setenv("JAXFUSE_CACHE_DIR", str(tmp_path / "cache"))
    jf._extension.extension().gpu_configure(str(tmp_path / "cache" / "kernels"), [])
    jf.clear_cache()
    yield
    jf.clear_cache()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # `device` parametrizes over the CPU and, marked `gpu`, the first GPU.
    if "device" in metafunc.fixturenames:
        params = [pytest.param(jax.devices("cpu")[0], id="cpu")]
        gpus = _gpu_devices()
        params.append(pytest.param(gpus[0] if gpus else None, id="gpu",
                                   marks=[pytest.mark.gpu]))
        metafunc.parametrize("device", params)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _gpu_devices():
        return
    skip = pytest.mark.skip(reason="no GPU visible to jax")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
