"""Plans compiled and executed from many threads at once: correct results, one compilation per
signature, and different signatures compiling side by side (on the CPU and, marked gpu, a GPU).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

import jax
import numpy as np
import pytest
from cases import Case, relative_error

import jaxfuse as jf
from jaxfuse import compiled
from jaxfuse._extension import extension
from jaxfuse.reference import reference_float64

# Shapes no other test uses, so that every signature is new to the process.
THREAD_CASES = [
    Case(ops="CBNA", c=5, k=7, h=13, w=11, n=1),
    Case(ops="CBA", c=6, k=10, h=12, w=17, n=2, layout="NHWC", filter_layout="HWIO",
         dtype="float16"),
    Case(ops="NSA", c=9, h=14, w=15, n=1, activation="elu", dtype="bfloat16"),
    Case(ops="CNA", c=4, k=4, groups=4, h=16, w=13, n=1, strides=(2, 2), padding="SAME"),
]


def _run(case: Case, device: Any, seed: int) -> float:
    """Builds, compiles and executes `case` (jitted and eagerly); the worse relative error."""
    plan, handles = case.build()
    plan.compile(device)
    x, args, operands = case.random_args(plan, handles, np.random.default_rng(seed))
    x, args = jax.device_put((x, args), device)
    ref = reference_float64(plan.signature, *operands)
    errors = [relative_error(jax.jit(plan.execute)(x, args), ref),
              relative_error(plan.execute(x, args), ref)]
    assert max(errors) <= case.tolerance(device), (case, errors)
    return max(errors)


def test_many_threads_compile_and_execute(device) -> None:
    before = compiled.cache_info()["compilations"]
    gpu_before = _gpu_builds(device)
    work = [(THREAD_CASES[i % len(THREAD_CASES)], i) for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        errors = list(pool.map(lambda item: _run(item[0], device, item[1]), work))
    assert len(errors) == len(work)
    # One compilation per signature, however many threads asked for it at once.
    assert compiled.cache_info()["compilations"] - before == len(THREAD_CASES)
    if device.platform != "cpu":  # and one kernel build (compiled or from disk) per plan
        assert _gpu_builds(device) - gpu_before == len(THREAD_CASES)


def _gpu_builds(device: Any) -> int:
    if device.platform == "cpu":
        return 0
    stats = extension().gpu_stats()
    return stats["compilations"] + stats["disk_hits"]


@pytest.fixture
def slow_compiler(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replaces the backend compile with a slow fake that records how many run at once."""
    record = {"calls": [], "running": 0, "most": 0, "fail": set()}
    lock = threading.Lock()

    def fake(signature: jf.PlanSignature, platform: str, device: Any,
             mode: str) -> compiled.CompiledPlan:
        with lock:
            record["calls"].append(signature)
            record["running"] += 1
            record["most"] = max(record["most"], record["running"])
        try:
            time.sleep(0.2)
            if signature in record["fail"]:
                record["fail"].discard(signature)
                raise jf.FusionError("compiler failed (once)")
            return compiled.CompiledPlan(signature, platform, device.id, "fake")
        finally:
            with lock:
                record["running"] -= 1

    monkeypatch.setattr(compiled, "_compile", fake)
    return record


def _signature(width: int) -> jf.PlanSignature:
    return Case(ops="A", c=3, h=2, w=width, n=1).build()[0].signature


def test_one_signature_compiles_once(slow_compiler) -> None:
    sig = _signature(1001)
    device = jax.devices("cpu")[0]
    hits = compiled.cache_info()["hits"]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: compiled.compile_signature(sig, device), range(8)))
    assert slow_compiler["calls"] == [sig]
    assert all(r is results[0] for r in results)
    assert compiled.cache_info()["hits"] - hits == 7


def test_different_signatures_compile_side_by_side(slow_compiler) -> None:
    sigs = [_signature(1002 + i) for i in range(4)]
    device = jax.devices("cpu")[0]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda s: compiled.compile_signature(s, device), sigs))
    assert sorted(s.width for s in slow_compiler["calls"]) == [s.width for s in sigs]
    assert slow_compiler["most"] >= 2
    assert time.perf_counter() - start < 4 * 0.2


def test_a_failed_compile_is_not_memoized(slow_compiler) -> None:
    sig = _signature(1010)
    device = jax.devices("cpu")[0]
    slow_compiler["fail"].add(sig)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(lambda _: _try(sig, device), range(2)))
    assert outcomes.count("failed") == 1  # the other thread retried, and succeeded
    assert compiled.compile_signature(sig, device).kernel == "fake"


def test_a_thread_arriving_after_a_failed_compile_waits_for_the_retry(slow_compiler) -> None:
    """A fails; B, which waited for A, retries; C, arriving while B retries, waits for B's
    compile rather than compiling beside it."""
    sig = _signature(1011)
    device = jax.devices("cpu")[0]
    slow_compiler["fail"].add(sig)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = [pool.submit(_try, sig, device) for _ in range(2)]
        time.sleep(0.3)  # (A has failed; B compiles)
        late = pool.submit(_try, sig, device)
        outcomes = [f.result() for f in first] + [late.result()]
    assert sorted(outcomes) == ["failed", "ok", "ok"]
    assert slow_compiler["calls"] == [sig, sig] and slow_compiler["most"] == 1
    assert not compiled._compiling  # (every entry gone with its last user)


def _try(sig: jf.PlanSignature, device: Any) -> str:
    try:
        compiled.compile_signature(sig, device)
    except jf.FusionError:
        return "failed"
    return "ok"
