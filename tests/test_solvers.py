"""Solver choice by measurement (jaxfuse.find): the fused kernel and XLA's composition compete
per plan signature and device; the faster correct one runs, a failing one is dropped, the
decision is memoized in memory and on disk, and the user can force either."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import Case, run_case

import jaxfuse as jf
from jaxfuse import compiled, find, solvers
from jaxfuse.activations import ActivationMode
from jaxfuse.errors import FusionError

# Each test compiles and measures its plans afresh (conftest.fresh_cache).
pytestmark = pytest.mark.usefixtures("fresh_cache")


SMALL = Case(ops="CBNA", dtype="float32", layout="NHWC", filter_layout="HWIO", n=2, c=8, h=10,
             w=10, k=16)


def test_auto_measures_both_and_keeps_the_faster(device) -> None:
    plan, _ = SMALL.build()
    plan.compile(device, solver="auto")
    info = plan.kernel_info
    assert info["mode"] == "auto" and info["decided"] == "measured"
    times = info["candidates_us"]
    assert set(times) == {"fused", "xla"} and all(t > 0 for t in times.values())
    fused_wins = times["fused"] <= (1 - find.margin(device.platform)) * times["xla"]
    assert (info["solver"] == "xla") == (not fused_wins)
    assert plan.solver == info["solver"]
    if device.platform == "gpu":  # device and launch times, both measured
        assert set(info["candidates_host_us"]) == {"fused", "xla"}
        assert all(0 < info["candidates_host_us"][k] <= times[k] for k in times)
    run_case(SMALL, device, solver="auto")


@pytest.mark.parametrize("mode", ["fused", "xla"])
def test_a_forced_solver_is_not_measured(mode, device) -> None:
    before = find.stats()["measured"]
    plan, _ = SMALL.build()
    plan.compile(device, solver=mode)
    info = plan.kernel_info
    assert info["mode"] == mode and info["decided"] == "forced"
    assert (info["solver"] == "xla") == (mode == "xla")
    assert "candidates_us" not in info
    assert find.stats()["measured"] == before


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
@pytest.mark.parametrize("times, failures, expected", [
    ({"fused": 85.0, "xla": 100.0}, {}, "fused"),
    ({"fused": 98.0, "xla": 100.0}, {}, "xla"),  # within the margin: XLA's composition
    ({"fused": 150.0, "xla": 100.0}, {}, "xla"),
    ({"fused": 150.0}, {"xla": "failed"}, "fused"),
    ({"xla": 100.0}, {"fused": "failed"}, "xla"),
    ({}, {"xla": "not measured"}, "fused"),
])
def test_the_fused_kernel_must_win_by_the_margin(times, failures, expected, platform) -> None:
    assert find._faster(times, failures, platform) == expected


def test_a_cpu_asks_a_wider_margin_than_a_gpu() -> None:
    # 7% faster: enough on a GPU, within a CPU's spread between runs of one program.
    times = {"fused": 93.0, "xla": 100.0}
    assert find._faster(times, {}, "gpu") == "fused"
    assert find._faster(times, {}, "cpu") == "xla"
    assert find.margin("CPU") == find.CPU_MARGIN > find.margin("cuda") == find.MARGIN
    # CPU loops without a convolution, at par where they are close: a wider margin still.
    assert find.margin("cpu", pointwise=True) == find.CPU_POINTWISE_MARGIN > find.CPU_MARGIN
    assert find.margin("gpu", pointwise=True) == find.MARGIN
    assert find._faster({"fused": 85.0, "xla": 100.0}, {}, "cpu", pointwise=True) == "xla"
    assert find._faster({"fused": 75.0, "xla": 100.0}, {}, "cpu", pointwise=True) == "fused"


@pytest.mark.parametrize("device_us, host_us, expected", [
    # The fused kernel device-bound: device time decides, XLA's launches notwithstanding.
    ({"fused": 27.6, "xla": 24.9}, {"fused": 12.0, "xla": 36.7}, "xla"),
    ({"fused": 20.0, "xla": 24.9}, {"fused": 12.0, "xla": 36.7}, "fused"),
    # Launch-bound (batch 1): the longer of the two parts, so a cheap launch wins.
    ({"fused": 7.0, "xla": 6.0}, {"fused": 9.0, "xla": 20.0}, "fused"),
])
def test_a_device_bound_fused_kernel_is_compared_on_device_time(device_us, host_us,
                                                                expected) -> None:
    times = {k: max(device_us[k], host_us[k]) for k in device_us}
    assert find._faster(times, {}, "gpu", device_us, host_us) == expected
    # Parts missing (CPUs, older records): the costs alone.
    assert find._faster(times, {}, "gpu") == ("fused" if times["fused"] < 0.97 * times["xla"]
                                              else "xla")


def test_gpu_plans_get_as_many_sets_as_cover_the_l2_cache(monkeypatch) -> None:
    """GPUs: sets beyond those that flush the L2 between two runs of one set buy nothing and
    cost the find step a load of XLA's candidate each (measure._GPU_CACHE_COVER)."""
    import types

    from jaxfuse import measure

    gpu = types.SimpleNamespace(platform="gpu")

    def signature(n):
        return Case(ops="NA", dtype="bfloat16", layout="NHWC", n=n, c=960, h=7,
                    w=7).build()[0].signature

    monkeypatch.setattr(measure, "gpu_l2_bytes", lambda device: 50 << 20)
    # 24 MB a set: 4 cover 1.5 times 50 MiB (the 256 MB budget alone gives 8); 48 MB: 2 (5).
    assert measure.set_count(signature(128), gpu) == 4
    assert measure.set_count(signature(256), gpu) == 2
    assert measure.set_count(signature(1), gpu) == measure._MAX_SETS  # small sets: all 8
    # Never fewer than 2 while 2 fit the budget (128 MB a set): 4 MiB of L2 would give 1.
    monkeypatch.setattr(measure, "gpu_l2_bytes", lambda device: 4 << 20)
    assert measure.set_count(signature(256), gpu) == measure._GPU_MIN_SETS
    monkeypatch.setattr(measure, "gpu_l2_bytes", lambda device: 0)  # unknown (ROCm): budget
    assert measure.set_count(signature(256), gpu) == 5


def test_the_l2_size_is_asked_once_a_device_and_a_failure_is_asked_again(monkeypatch) -> None:
    import types

    from jaxfuse import measure

    answers = iter([RuntimeError("no driver"), 50 << 20])
    asked = []

    class Extension:
        def gpu_l2_bytes(self, platform, ordinal):
            asked.append((platform, ordinal))
            answer = next(answers)
            if isinstance(answer, Exception):
                raise answer
            return answer

    monkeypatch.setattr(measure, "extension", Extension)
    monkeypatch.setattr(measure, "_l2_bytes", {})
    gpu = types.SimpleNamespace(platform="gpu", id=3, local_hardware_id=3, client=None)
    assert measure.gpu_l2_bytes(gpu) == 0  # (the budget's rule then)
    assert measure.gpu_l2_bytes(gpu) == 50 << 20 == measure.gpu_l2_bytes(gpu)
    assert asked == [("CUDA", 3), ("CUDA", 3)]


def test_cpu_plans_are_timed_on_several_sets() -> None:
    from jaxfuse import measure

    cpu = jax.devices("cpu")[0]
    small = Case(ops="NA", dtype="float32", layout="NHWC", n=1, c=64, h=56, w=56)
    large = Case(ops="NA", dtype="float32", layout="NHWC", n=8, c=64, h=112, w=112)
    conv = Case(ops="CBNA", dtype="float32", layout="NHWC", filter_layout="HWIO", n=1, c=64,
                h=56, w=56, k=64)
    assert measure.set_count(small.build()[0].signature, cpu) == 8
    assert measure.set_count(large.build()[0].signature, cpu) == 1  # 51 MB a set
    # With a convolution: 8 sets while they take at most 16 MB (1.6 MB a set here).
    assert measure.set_count(conv.build()[0].signature, cpu) == 8
    wide = Case(ops="CBNA", dtype="float32", layout="NHWC", filter_layout="HWIO", n=8, c=256,
                h=28, w=28, k=256)  # over 8 MB a set: one, as the 4 MB budget gives
    assert measure.set_count(wide.build()[0].signature, cpu) == 1
    # In sequence, each set's op after the last one's output: the same results as side by side.
    signature = small.build()[0].signature
    sets = measure.random_operands(signature, cpu, 3)
    outs = [measure.Harness.compile(solvers.xla_function(signature), sets, cpu,
                                    sequential=sequential).run_all(sets)[0]
            for sequential in (False, True)]
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def test_large_operands_are_drawn_on_the_device(monkeypatch) -> None:
    """GPUs draw operands above 2^20 elements on the device, hashed from their index (the CPU
    device stands in here): values in their ranges, distinct from set to set and operand to
    operand, in the plan's dtype and on the device; smaller ones come from the host."""
    from jaxfuse import measure

    cpu = jax.devices("cpu")[0]
    monkeypatch.setattr(measure, "_platform_kind", lambda device: "gpu")
    signature = Case(ops="CBNA", dtype="bfloat16", layout="NHWC", filter_layout="HWIO", n=4,
                     c=64, h=64, w=72, k=16).build()[0].signature
    drawn = []
    original = measure._device_uniform
    monkeypatch.setattr(measure, "_device_uniform",
                        lambda *args: drawn.append(args[1]) or original(*args))
    sets = measure.random_operands(signature, cpu, 2)
    assert drawn == [signature.operands[0].shape] * 2  # x alone (1.2 M elements)
    x0, x1 = (np.asarray(s[0], np.float32) for s in sets)
    assert sets[0][0].dtype == jnp.bfloat16 and sets[0][0].devices() == {cpu}
    assert -1.0 <= x0.min() < -0.99 and 0.99 < x0.max() <= 1.0 and abs(x0.mean()) < 0.01
    assert np.mean(x0 == x1) < 0.05  # (bfloat16 keeps 8 bits: some equal by chance)
    variance = np.asarray(sets[0][-1], np.float32)
    assert variance.min() >= 0.5 and variance.max() <= 2.0


def test_a_candidate_costs_the_longer_of_device_and_launch_time() -> None:
    from jaxfuse.measure import Timing

    assert Timing(device=5e-6, host=20e-6).cost == 20e-6  # launch-bound (tiny problems)
    assert Timing(device=50e-6, host=20e-6).cost == 50e-6  # device-bound
    assert Timing(device=3e-3).cost == 3e-3  # CPUs: wall time


@pytest.mark.gpu
def test_the_stopwatch_times_device_work_without_the_launches() -> None:
    """Host work between the marks that costs the device almost nothing (32 start and end
    marks of a second, gated stopwatch: each start mark starts a watchdog thread on the host,
    tens of microseconds, and each is its own step, never captured into a CUDA graph): with the
    device held until all is queued, the device time is below the host's, which a stopwatch
    started at once would have measured. (Marks of an ungated stopwatch are no such work: on
    an H100 the device records an event about as fast as the host queues one.)"""
    from jaxfuse.measure import _delete_stopwatch, _mark, _new_stopwatch

    gpu = jax.devices("gpu")[0]
    ext = jf._extension.extension()
    watch, busy = _new_stopwatch(gpu), _new_stopwatch(gpu)
    try:
        def program(x):
            token = _mark(watch, 0, x)
            for i in range(64):
                token = _mark(busy, i % 2, token)
            return _mark(watch, 1, token)

        run = jax.jit(program)
        x = jax.device_put(jnp.ones((8,), jnp.float32), gpu)
        jax.block_until_ready(run(x))
        times = {}
        for gate in (False, True):
            ext.stopwatch_gate(watch, gate)
            jax.block_until_ready(run(x))
            times[gate] = ext.stopwatch_read(watch)
        device_ms, host_ms, gated, timed_out = times[True]
        assert device_ms > 0 and host_ms > 0 and not timed_out
        # Stream gates work with every CUDA 12+ driver; elsewhere they may not (then timing
        # falls back to an ungated stopwatch).
        assert gated or jf.runtime.gpu_platform(gpu) != "CUDA"
        if gated:
            assert device_ms < 0.5 * times[False][0]  # ungated, the device waits for the host
    finally:
        _delete_stopwatch(watch)
        _delete_stopwatch(busy)


@pytest.mark.gpu
def test_a_stopwatch_gate_never_holds_the_stream_forever() -> None:
    """Host work between the marks that waits for the device (a host callback) would wait on
    the closed gate: the gate opens by itself after a timeout and the program completes."""
    from jaxfuse.measure import _delete_stopwatch, _mark, _new_stopwatch

    gpu = jax.devices("gpu")[0]
    watch = _new_stopwatch(gpu)
    try:
        def program(x):
            start = _mark(watch, 0, x)
            _, x = jax.lax.optimization_barrier((start, x))  # after the mark (never written)
            y = jax.pure_callback(lambda v: np.asarray(v) * 2,
                                  jax.ShapeDtypeStruct(x.shape, x.dtype), x)
            return y, _mark(watch, 1, y)

        x = jax.device_put(jnp.ones((256,), jnp.float32), gpu)
        y, _ = jax.block_until_ready(jax.jit(program)(x))
        np.testing.assert_allclose(np.asarray(y), 2.0)
        *_, timed_out = jf._extension.extension().stopwatch_read(watch)
        assert timed_out  # and the harness then times such a program ungated
    finally:
        _delete_stopwatch(watch)


# The xla solver computes the same function as the kernels: every activation, both batch-norm
# modes, every dtype and layout, strides, padding, dilation and groups, against float64.
XLA_CASES = (
    [Case(ops="CBNSA", dtype=dt, layout=layout, filter_layout=fl, activation=mode.value)
     for dt in ("float32", "float16", "bfloat16")
     for layout, fl in (("NCHW", "OIHW"), ("NHWC", "HWIO"))
     for mode in (ActivationMode.RELU, ActivationMode.ELU, ActivationMode.CLIPPED_RELU)]
    + [Case(ops="CBA", activation=mode.value) for mode in ActivationMode]
    + [Case(ops="BNA", activation=mode.value, dtype="bfloat16") for mode in ActivationMode]
    + [Case(ops=ops, bn_mode="per_activation", layout=layout)
       for ops in ("CNA", "NA") for layout in ("NCHW", "NHWC")]
    + [Case(ops="CBA", groups=4, c=8, k=12, strides=(2, 1), dilation=(1, 2), padding="SAME"),
       Case(ops="CA", filter_layout="OHWI", layout="NHWC", precision="highest"),
       Case(ops="S"), Case(ops="B"), Case(ops="N")]
)


@pytest.mark.parametrize("case", XLA_CASES, ids=str)
def test_the_xla_solver_matches_the_reference(case, device) -> None:
    run_case(case, device, solver="xla", seed=3)


@pytest.mark.parametrize("jit", [True, False])
def test_xla_solver_under_grad_and_vmap(jit) -> None:
    """Both solvers compute the same function, so their derivatives agree too."""
    runs = {}
    for mode in ("xla", "fused"):
        plan, handles = SMALL.build()
        x, args, _ = SMALL.random_args(plan, handles, np.random.default_rng(0))
        plan.compile(solver=mode)

        def loss(x, args, plan=plan):
            return jnp.sum(plan.execute(x, args) ** 2)

        grad = jax.grad(loss, argnums=(0, 1))
        runs[mode] = (plan, x, args, (jax.jit(grad) if jit else grad)(x, args))
    (gx_xla, ga_xla), (gx_fused, ga_fused) = runs["xla"][3], runs["fused"][3]
    np.testing.assert_allclose(gx_xla, gx_fused, rtol=2e-4, atol=2e-4)
    for a, b in zip(jax.tree.leaves(ga_xla), jax.tree.leaves(ga_fused)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)
    plan, x, args, _ = runs["xla"]
    out = jax.vmap(plan.execute, in_axes=(0, None))(jnp.stack([x, 2 * x]), args)
    np.testing.assert_allclose(out[1], plan.execute(2 * x, args), rtol=1e-5, atol=1e-5)


def test_the_environment_variable_sets_the_default(monkeypatch) -> None:
    monkeypatch.setenv("JAXFUSE_SOLVER", "XLA")
    plan, _ = SMALL.build()
    assert plan.compile().kernel_info["mode"] == "xla"
    monkeypatch.setenv("JAXFUSE_SOLVER", "fastest")
    with pytest.raises(ValueError, match="JAXFUSE_SOLVER must be one of auto, fused, xla"):
        SMALL.build()[0].compile()
    with pytest.raises(ValueError, match="solver must be one of"):
        SMALL.build()[0].compile(solver="cudnn")
    with pytest.raises(ValueError, match="solver must be one of"):
        jf.fuse(lambda x: x, solver=3)


def test_a_kernel_that_cannot_be_built_is_dropped(monkeypatch, caplog) -> None:
    def broken(signature, device):
        raise FusionError("compiling failed:\nconv_igemm.cuh(56): static assertion failed")

    monkeypatch.setattr(compiled, "prepare_forms", broken)
    plan, _ = SMALL.build()
    with caplog.at_level("DEBUG", logger="jaxfuse"):
        plan.compile(solver="auto")
    assert plan.solver == "xla" and plan.kernel_info["decided"] == "fallback"
    assert "static assertion failed" in plan.kernel_info["failed"]["fused"]
    assert "not available" in caplog.text
    run_case(SMALL, jax.devices("cpu")[0], solver="auto")  # runs, through XLA
    with pytest.raises(FusionError, match="static assertion"):
        SMALL.build()[0].compile(solver="fused")


def test_a_kernel_that_disagrees_with_xla_is_dropped(monkeypatch) -> None:
    real = find.fused_function

    def wrong(signature, filters=None, layout=None):
        run = real(signature, filters)
        return lambda *operands: run(*operands) * 1.5

    monkeypatch.setattr(find, "fused_function", wrong)
    plan, _ = SMALL.build()
    plan.compile(solver="auto")
    assert plan.solver == "xla"
    assert "disagrees with XLA" in plan.kernel_info["failed"]["fused"]
    # ... and no program may pick it either: its times are not offered.
    assert "fused" not in plan.kernel_info.get("candidates_device_us", {})


def test_a_comparison_that_fails_leaves_the_kernel_unchecked_and_xla_runs(monkeypatch
                                                                          ) -> None:
    """Comparing the outputs runs a program on the device too (out of memory, say): the fused
    kernel is then dropped, never the plan's compile."""
    def failing(a, b):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while comparing")

    monkeypatch.setattr(find, "relative_error", failing)
    plan, _ = SMALL.build()
    plan.compile(solver="auto")
    assert plan.solver == "xla"
    assert plan.kernel_info["failed"]["fused"] == (
        "not compared with XLA: RuntimeError: RESOURCE_EXHAUSTED: out of memory while comparing")


def test_a_far_slower_kernel_is_not_timed_further(monkeypatch) -> None:
    real = find.fused_function

    calls = []

    def slow(signature, filters=None, layout=None):
        run = real(signature, filters)

        def wait(*operands):
            y = run(*operands)
            return jax.pure_callback(lambda v: (calls.append(1), time.sleep(0.01), v)[2],
                                     jax.ShapeDtypeStruct(y.shape, y.dtype), y)
        return wait

    monkeypatch.setattr(find, "fused_function", slow)
    plan, _ = SMALL.build()
    plan.compile(solver="auto")
    assert plan.solver == "xla"
    assert plan.kernel_info["candidates_us"]["fused"] >= 10_000  # its wall-clocked run
    sets = find.set_count(plan.signature, jax.devices("cpu")[0])
    # A warm-up run and three wall-clocked runs of every input set on a CPU (one slow run
    # could be a hiccup of the host, or a run that faulted its output in), nothing more.
    assert len(calls) == 4 * sets


def test_a_candidate_that_fails_to_run_is_dropped(monkeypatch) -> None:
    def failing(signature):
        def run(*operands):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        return run

    working = find.xla_function
    monkeypatch.setattr(find, "xla_function", failing)
    plan, _ = SMALL.build()
    plan.compile(solver="auto")
    assert plan.solver == "cpu"
    assert "RESOURCE_EXHAUSTED" in plan.kernel_info["failed"]["xla"]
    # Not remembered on disk: the next process (here: an empty memo) measures again.
    monkeypatch.setattr(find, "xla_function", working)
    jf.clear_cache()
    plan.compile(solver="auto")
    assert plan.kernel_info["decided"] == "measured"
    assert set(plan.kernel_info["candidates_us"]) == {"fused", "xla"}


def test_compiling_inside_a_trace_measures_outside_it() -> None:
    """Plans compile while the caller's function is traced (jaxfuse.fuse, the functional
    API): the measurement must run real computations, not stage them into the trace."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8, 10, 10)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((16, 8, 3, 3)), jnp.float32)
    b = jnp.ones(16)

    @jax.jit
    def f(x, w, b):
        fn = jf.fuse(lambda x, w, b: jax.nn.relu(
            jax.lax.conv_general_dilated(x, w, (1, 1), "SAME") + b[None, :, None, None]),
            solver="auto")
        return fn(x, w, b)

    before = find.stats()["measured"]
    out = f(x, w, b)
    assert find.stats()["measured"] == before + 1
    ref = jax.nn.relu(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                   precision="highest") + 1.0)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_fuse_leaves_chains_xla_runs_faster_as_they_were() -> None:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 10, 10, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 3, 8, 16)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(16), jnp.float32)

    def block(x, w, b):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.nn.relu(y + b)

    plain = jax.make_jaxpr(block)(x, w, b)
    to_xla = jf.fuse(block, solver="xla")
    assert str(jax.make_jaxpr(to_xla)(x, w, b)) == str(plain)  # the program itself, untouched
    np.testing.assert_array_equal(to_xla(x, w, b), block(x, w, b))
    report = jf.fusion_report(to_xla, x, w, b)
    assert len(report.fused) == 0 and len(report.to_xla) == 1 and report.fused_calls == 0
    assert "1 left to XLA" in report.summary()

    fused = jf.fuse(block, solver="fused")
    report = jf.fusion_report(fused, x, w, b)
    assert len(report.fused) == 1 and report.fused_calls == 1
    assert report.fused[0].solver == "cpu"

    report = jf.fusion_report(jf.fuse(block, solver="auto"), x, w, b)
    group = (report.fused or report.to_xla)[0]
    assert dict(group.times_us).keys() == {"fused", "xla"}
    assert "measured chains:" in report.summary()
    assert len(report.fused) + len(report.to_xla) == 1


def _costs(key, fused, xla, own="xla", count=1):
    """A chain measured at fused = (device, host) and xla = (device, host) microseconds."""
    from jaxfuse.rewrite.choice import ChainCosts

    return ChainCosts(key, count, own, {"fused": fused[0], "xla": xla[0]},
                      {"fused": fused[1], "xla": xla[1]})


def test_a_device_bound_program_chooses_by_device_time() -> None:
    from jaxfuse.rewrite.choice import choose_for_program

    # Batch 64: XLA's launches (cuDNN host work) are long, but its kernels are faster and the
    # device work outweighs all launches (a sixth of it), so the launches hide.
    chains = [_costs("a", (44, 3), (39, 50), count=3), _costs("b", (84, 4), (68, 49)),
              _costs("stem", (507, 16), (613, 97)), _costs("tie", (99, 3), (100, 40)),
              _costs("body", (200, 10), (260, 30), count=5)]
    assert choose_for_program(chains) == {"a": "xla", "b": "xla", "stem": "fused",
                                          "tie": "xla", "body": "fused"}
    # A choice that saves under 3% of the program on paper leaves every chain to XLA.
    small = [_costs("a", (44, 3), (39, 30), count=50), _costs("gemm", (123, 4), (140, 30))]
    assert choose_for_program(small) == {"a": "xla", "gemm": "xla"}


def test_a_program_near_launch_bound_fuses_chains_that_save_more_launch_than_device() -> None:
    from jaxfuse.rewrite.choice import choose_for_program

    # Batch 8: launches three tenths of the device work or more (the program's other host work,
    # about as much again, is not in the sums). A 3x3 chain 3% faster fused on the device, a
    # quarter of the launch work: fused, although within the margin. So is one a little
    # slower on the device that saves more launch work than that (ResNet-50 fp32 on an H200,
    # 2026-11-28: 15 such chains left to XLA cost the program 23%); one slower by more than
    # it saves stays XLA's.
    def program(big_device: float) -> list:
        return [_costs("3x3", (13.6, 7.8), (14.0, 32.2), count=5),
                _costs("slower", (30.1, 4.3), (19.4, 20.3)),
                _costs("much slower", (40.0, 4.3), (19.4, 20.3)),
                _costs("big", (big_device, 8.0), (big_device * 1.3, 30.0), count=10)]

    assert choose_for_program(program(30.0)) == {"3x3": "fused", "slower": "fused",
                                                 "much slower": "xla", "big": "fused"}
    # Batch 64: the device work far outweighs every launch; the margin alone decides.
    assert choose_for_program(program(300.0)) == {"3x3": "xla", "slower": "xla",
                                                  "much slower": "xla", "big": "fused"}
    # The moves add device time the estimate cannot weigh against launch work it undercounts:
    # the gain of the device-time choice before them is enough, and keeps `big` fused.
    moved = [_costs("big", (90, 10), (100, 10)), _costs("slower", (12, 2), (10, 10), count=5)]
    assert choose_for_program(moved) == {"big": "fused", "slower": "fused"}


def test_a_launch_bound_program_moves_chains_to_cheap_launches() -> None:
    from jaxfuse.rewrite.choice import choose_for_program

    # Batch 1: each XLA chain is 2-3 us on the device behind 40 us of launches.
    chains = [_costs(i, (4.0, 3.0), (3.0, 40.0)) for i in range(10)]
    chains.append(_costs("unmeasured", (1.0, 1.0), (1.0, 1.0), own="fused"))
    chains[-1] = dataclasses.replace(chains[-1], device_us={}, host_us={})
    choice = choose_for_program(chains)
    assert all(choice[i] == "fused" for i in range(10)) and choice["unmeasured"] == "fused"
    # ... but only as far as the launches are the longer sum.
    mixed = [_costs("big", (900, 5), (1000, 60)), _costs("small", (10, 3), (5, 40))]
    assert choose_for_program(mixed) == {"big": "fused", "small": "xla"}


def test_fuse_follows_the_program_choice_over_the_plans_own(monkeypatch, tmp_path) -> None:
    """Chains the plans gave to XLA but the program runs fused get the fused kernel, and the
    reverse; results are unchanged."""
    fuse_module = importlib.import_module("jaxfuse.rewrite.fuse")
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 10, 10, 8)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((3, 3, 8, 8)) / 8, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((1, 1, 8, 16)) / 3, jnp.float32)

    def net(x, w1, w2):
        dn = ("NHWC", "HWIO", "NHWC")
        y = jax.nn.relu(jax.lax.conv_general_dilated(x, w1, (1, 1), "SAME",
                                                     dimension_numbers=dn))
        return jax.nn.relu(jax.lax.conv_general_dilated(y, w2, (1, 1), "SAME",
                                                        dimension_numbers=dn))

    expected = net(x, w1, w2)
    for own, program in (("xla", "fused"), ("fused", "xla")):
        cache = tmp_path / own  # each measures afresh, the plans' own choice as patched
        monkeypatch.setenv("JAXFUSE_CACHE_DIR", str(cache))
        jf._extension.extension().gpu_configure(str(cache / "kernels"), [])
        jf.clear_cache()
        monkeypatch.setattr(find, "_faster", lambda *_, own=own, **__: own)
        monkeypatch.setattr(fuse_module, "choose_for_program",
                            lambda chains, program=program: {c.key: program for c in chains})
        fused = jf.fuse(net, solver="auto")
        report = jf.fusion_report(fused, x, w1, w2)
        assert all(dict(g.times_us) for g in (*report.fused, *report.to_xla))  # measured
        if program == "fused":
            assert report.fused_calls == 2 and [g.solver for g in report.fused] == ["cpu"] * 2
        else:
            assert report.fused_calls == 0 and len(report.to_xla) == 2
        np.testing.assert_allclose(fused(x, w1, w2), expected, rtol=1e-5, atol=1e-5)


def test_an_empty_output_is_not_measured() -> None:
    case = Case(ops="CBA", n=0)
    plan, _ = case.build()
    plan.compile(solver="auto")
    assert plan.kernel_info["solver"] == "cpu"
    assert "output is empty" in plan.kernel_info["failed"]["xla"]


def test_decisions_are_read_back_safely() -> None:
    good = find.Decision("xla", (("fused", 3.0), ("xla", 2.0)), (("fused", "why"),),
                         device_us=(("fused", 3.0), ("xla", 1.5)),
                         host_us=(("fused", 1.0), ("xla", 2.0)))
    back = find.Decision.from_json(good.to_json())
    assert back is not None and back.solver == "xla" and back.origin == "disk cache"
    assert back.times_us == good.times_us and back.failures == good.failures
    assert back.device_us == good.device_us and back.host_us == good.host_us
    for bad in (b"", b"{", b"[]", b'{"solver": "rm -rf"}',
                json.dumps({"solver": "fused", "times_us": [], "failures": {}}).encode(),
                b"\xff\xfe", json.dumps({"solver": "xla", "times_us": {"a": "x"},
                                         "failures": {}}).encode(),
                b'{"solver": "xla", "times_us": {"xla": 1' + b"0" * 400 + b'}, "failures": {}}',
                b"[" * 100_000 + b"]" * 100_000,
                b'{"solver": "xla", "times_us": {"xla": NaN, "fused": 1.0}, "failures": {}}',
                b'{"solver": "xla", "times_us": {"a": 1.0}, "failures": {}}'):
        assert find.Decision.from_json(bad) is None, bad[:80]


def test_a_malformed_forms_record_is_measured_again() -> None:
    device = jax.devices("cpu")[0]
    signature = SMALL.build()[0].signature
    kernels = [solvers.prepare_fused(signature, device)]
    labels = [kernel.label for kernel in kernels]
    key = (f"jaxfuse-form-v2|{find._environment_key(device.device_kind, 'cpu')}|"
           f"{'|'.join(labels)}|{signature.encode()}")
    jf._extension.extension().cache_store(key, b"[" * 100_000 + b"]" * 100_000)
    assert find.fastest_form(signature, device, kernels) is kernels[0]


def test_an_auto_plan_compiled_under_the_device_timing_lock_raises_not_hangs() -> None:
    """Its measurement runs on the find step's thread, which waits for that lock: a thread
    holding it would wait for its own result forever."""
    plan, _ = SMALL.build()
    with find.device_timing():
        with pytest.raises(RuntimeError, match="holds the device-timing lock"):
            plan.compile(solver="auto")
        with pytest.raises(RuntimeError, match="not re-entrant"), find.device_timing():
            pass
    plan.compile(solver="auto")  # (the lock released, it measures)
    assert plan.kernel_info["decided"] == "measured"


_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from cases import Case
    import jaxfuse as jf
    from jaxfuse import find
    plan, _ = Case(ops="CBNA", dtype="float32", layout="NHWC", filter_layout="HWIO", n=2, c=8,
                   h=10, w=10, k=16).build()
    plan.compile(solver="auto")
    print(json.dumps({"info": plan.kernel_info, "stats": find.stats()}))
""")


def _child(cache: str, flags: str = "") -> dict:
    env = {**os.environ, "JAXFUSE_CACHE_DIR": cache, "XLA_FLAGS": flags,
           "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-P", "-c", _CHILD, os.path.dirname(__file__)],
                         env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_decisions_persist_on_disk_per_environment(tmp_path) -> None:
    cache = str(tmp_path / "shared")
    first = _child(cache)
    assert first["info"]["decided"] == "measured" and first["stats"]["measured"] == 1
    second = _child(cache)  # a new process: nothing measured, the same choice
    assert second["info"]["decided"] == "disk cache" and second["stats"]["measured"] == 0
    assert second["info"]["solver"] == first["info"]["solver"]
    assert second["info"]["candidates_us"] == first["info"]["candidates_us"]
    other = _child(cache, flags="--xla_cpu_enable_fast_math=false")  # another XLA: measure
    assert other["info"]["decided"] == "measured"
    memory_only = _child("")
    assert memory_only["info"]["decided"] == "measured"


def test_jaxfuse_s_settings_and_the_processor_key_a_decision(monkeypatch) -> None:
    """JAXFUSE_CPU_ISA picks the CPU kernels' instruction set, JAXFUSE_PDL the GPU's launches:
    a decision measured under one is measured again under another. Where the cache lives and
    which solver is forced change no measurement."""
    for name in [name for name in os.environ if name.startswith("JAXFUSE_")]:
        monkeypatch.delenv(name)
    base = find._environment_key("cpu", "cpu")
    assert "flags" in base and "cpus" in base  # (the processor's model and features)
    monkeypatch.setenv("JAXFUSE_CACHE_DIR", "/elsewhere")
    monkeypatch.setenv("JAXFUSE_SOLVER", "fused")
    assert find._environment_key("cpu", "cpu") == base
    keys = {base}
    for name, value in (("JAXFUSE_CPU_ISA", "portable"), ("JAXFUSE_PDL", "0"),
                        ("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")):
        monkeypatch.setenv(name, value)
        keys.add(find._environment_key("cpu", "cpu"))
    assert len(keys) == 4
    assert "libraries" in find._environment_key("H100", "cuda")  # (plugins, cuDNN's wheel)


def test_the_solver_mode_is_part_of_the_memo() -> None:
    plan, _ = SMALL.build()
    assert plan.compile(solver="xla").solver == "xla"
    assert plan.compile(solver="fused").solver == "cpu"
    assert plan.compile(solver="xla").solver == "xla"
    assert compiled.cache_info()["size"] == 2


def test_modes() -> None:
    assert solvers.solver_mode("AUTO") == "auto"
    assert set(solvers.MODES) == {"auto", "fused", "xla"}


# ----- CPU timing: runs that fault their output's pages in are set aside ------------------------
def test_quiet_runs_set_aside_runs_that_took_page_faults() -> None:
    from jaxfuse.measure import quiet_runs

    # A window where some runs faulted a 12.8 MB output in (3170 faults, 4.4 ms): the quiet
    # runs' times remain.
    seconds = [4.4e-3, 4.5e-3, 1.0e-3, 1.1e-3, 4.3e-3, 0.9e-3]
    faults = [3170, 3169, 0, 12, 3166, 1]
    assert quiet_runs(seconds, faults) == [1.0e-3, 1.1e-3, 0.9e-3]
    # Every run faulted alike: nothing to set aside (the faults are then the candidate's own).
    assert quiet_runs(seconds[:2], faults[:2]) == seconds[:2]
    # No fault counts (platforms that cannot tell): the times as they are.
    assert quiet_runs(seconds, []) == seconds


class _FaultingProgram:
    """A stand-in for a compiled timing program on a CPU: `slow` seconds a run, and every
    run listed in `faulting` (1-based, the untimed first run included) also takes `fault_slow`
    seconds and 3136 page faults, as a run writing a fresh 12.8 MB output does."""

    def __init__(self, seconds: float, faulting: set[int], fault_seconds: float = 0.03):
        self.seconds, self.faulting, self.fault_seconds = seconds, faulting, fault_seconds
        self.runs, self.faults = 0, 0

    def __call__(self, sets):
        self.runs += 1
        slow = self.runs in self.faulting
        self.faults += 3136 if slow else 0
        time.sleep(self.fault_seconds if slow else self.seconds)
        return [jnp.zeros(4)], None


def _screened(monkeypatch, program: _FaultingProgram, limit: float):
    from jaxfuse import measure

    monkeypatch.setattr(measure, "page_faults", lambda: program.faults)
    harness = measure.Harness(program, [(jnp.zeros(4),)], "cpu")
    return harness.run(limit)[1]


def test_a_cpu_candidate_is_not_cut_short_on_runs_that_faulted(monkeypatch) -> None:
    # Its screening runs alternate between faulting (30 ms) and quiet (2 ms): the quiet one
    # is within the 10 ms limit, and the timed runs' quiet ones are its time.
    timing = _screened(monkeypatch, _FaultingProgram(0.002, {2, 4, 6, 8, 10}), limit=0.01)
    assert not timing.cut_short and timing.device < 0.01
    # Every screening run faulted: no evidence, so it is timed in full (its quiet runs).
    timing = _screened(monkeypatch, _FaultingProgram(0.002, {2, 3, 4}), limit=0.01)
    assert not timing.cut_short and timing.device < 0.01


def test_a_slow_cpu_candidate_is_still_cut_short(monkeypatch) -> None:
    timing = _screened(monkeypatch, _FaultingProgram(0.02, set()), limit=0.005)
    assert timing.cut_short and timing.device >= 0.02


def test_a_cpu_times_large_filters_cold() -> None:
    # 3x3 512->512 fp32 at batch 1: 9.4 MB of filters, so the sets' filters must exceed the
    # cache (4 sets), where the memory budget alone gives one set. Small filters: the budget.
    from jaxfuse import measure

    cpu, big = jax.devices("cpu")[0], Case(ops="CBNA", dtype="float32", layout="NHWC",
                                          filter_layout="HWIO", n=1, c=512, h=7, w=7, k=512)
    plan, _ = big.build()
    filters = 3 * 3 * 512 * 512 * 4
    assert measure.set_count(plan.signature, cpu) == -(-measure._CPU_CACHE_BYTES // filters)
    plan, _ = SMALL.build()  # (a few kB a set: the budget's most)
    assert measure.set_count(plan.signature, cpu) == measure._MAX_SETS


class _FakeStopwatch:
    """The extension's stopwatch calls, reporting `device_ms` and a tenth of it as host time
    for every run."""

    def __init__(self, device_ms: float):
        self.device_ms = device_ms

    def stopwatch_gate(self, stopwatch: int, enabled: bool) -> None:
        pass

    def stopwatch_read(self, stopwatch: int) -> tuple[float, float, bool, bool]:
        return self.device_ms, self.device_ms / 10, True, False


@pytest.mark.parametrize("device_ms, cut", [(1.0, False), (20.0, True)])
def test_a_gpu_candidate_is_screened_by_its_stopwatch(monkeypatch, device_ms, cut) -> None:
    # Each run takes 30 ms by the wall clock (XLA allocating its buffers, say) around a
    # program whose marks are `device_ms` apart: only the marks count against the 10 ms limit.
    from jaxfuse import measure

    monkeypatch.setattr(measure, "extension", lambda: _FakeStopwatch(device_ms))
    harness = measure.Harness(_FaultingProgram(0.03, set()), [(jnp.zeros(4),)], "gpu",
                              stopwatch=1)
    timing = harness.run(limit=0.01)[1]
    assert timing.cut_short == cut
    assert timing.device == pytest.approx(device_ms * 1e-3)


def test_summary_says_which_measurement_kept_a_chain_xla() -> None:
    """A chain whose fused kernel had the shorter candidate time (its launches cheaper) but
    the longer device time, kept XLA's in a device-bound program: the summary gives both parts,
    not the larger alone (which read as XLA chosen although slower: H100, 2026-11-26)."""
    from jaxfuse.rewrite.report import FusedGroup, FusionReport

    def group(**measured):
        return FusedGroup(("conv", "batch norm", "relu"), "CNA", "sig", "Net/Conv_0", "", None,
                          "xla", **measured)

    gpu = group(times_us=(("fused", 21.2), ("xla", 33.3)),
                device_us=(("fused", 21.2), ("xla", 19.0)),
                host_us=(("fused", 4.1), ("xla", 33.3)))
    cpu = group(times_us=(("fused", 30.0), ("xla", 25.0)))
    # Faster, but within the CPU's margin; and faster beyond it, kept by the program's choice
    close = group(times_us=(("fused", 23.0), ("xla", 25.0)))
    program = group(times_us=(("fused", 20.0), ("xla", 25.0)))
    unknown = group()
    jaxpr = jax.make_jaxpr(lambda x: x)(1.0)
    lines = FusionReport((), (), jaxpr, to_xla=(gpu, cpu, close, program, unknown)
                         ).summary().splitlines()
    assert lines[0] == "jaxfuse: 0 chain(s) fused, 5 left to XLA (by measurement), 0 left alone"
    assert lines[1].endswith("XLA chosen by measurement (device 19.0 us vs 21.2 us fused; "
                             "launch work 33.3 us vs 4.1 us)"), lines
    assert lines[2].endswith("XLA chosen by measurement (25.0 us vs 30.0 us fused)"), lines
    assert lines[3].endswith("(25.0 us vs 23.0 us fused: not the 10% faster a CPU's choice "
                             "needs)"), lines
    assert lines[4].endswith("(25.0 us vs 20.0 us fused: the whole program's choice "
                             "(jaxfuse.rewrite.choice))"), lines
    assert lines[5].endswith(": XLA chosen"), lines


def test_summary_says_a_forced_xla_was_not_measured() -> None:
    """With solver="xla" nothing is measured: the report says it was forced (it said "by
    measurement", and "XLA is faster")."""
    from jaxfuse.rewrite.report import FusedGroup, FusionReport

    def group(decided: str, **measured) -> FusedGroup:
        return FusedGroup(("conv", "relu"), "CA", "sig", "Net/Conv_0", "", None, "xla",
                          decided=decided, **measured)

    jaxpr = jax.make_jaxpr(lambda x: x)(1.0)
    forced = FusionReport((), (), jaxpr, to_xla=(group("forced"),) * 2)
    lines = forced.summary().splitlines()
    assert lines[0] == "jaxfuse: 0 chain(s) fused, 2 left to XLA (solver forced), 0 left alone"
    assert lines[1].endswith(': XLA forced (solver "xla" or JAXFUSE_SOLVER=xla)'), lines
    assert "(sig; solver forced)" in str(forced) and "faster" not in str(forced)
    mixed = FusionReport((), (), jaxpr, to_xla=(
        group("disk cache", times_us=(("fused", 3.0), ("xla", 2.0))), group("fallback")))
    lines = mixed.summary().splitlines()
    assert lines[0] == ("jaxfuse: 0 chain(s) fused, 2 left to XLA (1 by measurement, "
                        "1 no fused kernel), 0 left alone"), lines
    assert lines[2].endswith('the fused kernel is not available (kernel_info["failed"] says '
                             'why)'), lines


def test_summary_columns_fit_the_longest_chain() -> None:
    from jaxfuse.rewrite.report import FusedGroup, FusionReport

    def group(plan: str, ops: tuple[str, ...]) -> FusedGroup:
        return FusedGroup(ops, plan, "sig", "Net/Conv_0", "", None, "cpu",
                          times_us=(("fused", 1.0), ("xla", 3.0)))

    fused = (group("CNSA", ("conv", "batch norm", "residual add", "relu")),
             group("CNA", ("conv", "batch norm", "relu")))
    lines = FusionReport(fused, (), jax.make_jaxpr(lambda x: x)(1.0)).summary().splitlines()
    assert lines[1].endswith("conv -> batch norm -> residual add -> relu  cpu, saves 2.0 us")
    assert lines[2].endswith("conv -> batch norm -> relu                  cpu, saves 2.0 us")


# XLA's candidate must be the chain as a user writes it, operation for operation: the find step
# times it against the fused kernel and auto mode runs it where it wins. A clipped_relu written
# as where/isnan, not relu6's clamp, made XLA split the epilogue on a GPU (216 against 116 us
# of kernels for an NCHW depthwise chain, H100) and the find step keep a slower fused kernel.
# One layer of the benchmark suites per chain kind, checked against the benchmark's own
# unfused program (the user's form) by the operations of the optimized HLO on the CPU.
def _suite_chain_kinds() -> list[tuple[str, str, str]]:
    from jaxfuse.bench.layers import SUITES

    kinds: dict[tuple, tuple[str, str, str]] = {}
    for layers in SUITES.values():
        for layer in layers:
            chain = ("NA" if not layer.has_conv else "CBNSA" if layer.residual else
                     "CBNA" if layer.activation else "CBN")
            for layout in ("NHWC", "NCHW"):
                key = (chain, layer.activation, layout, layer.groups > 1)
                kinds.setdefault(key, (layer.name, chain, layout))
    return list(kinds.values())


def _hlo_operations(compiled_text: str) -> dict[str, int]:
    import collections
    import re

    ops = collections.Counter(re.findall(r"= \S+ ([a-z][\w-]*)\(", compiled_text))
    for plumbing in ("parameter", "get-tuple-element", "tuple", "constant", "bitcast",
                     "broadcast", "copy", "reshape", "convert", "transpose", "fusion"):
        ops.pop(plumbing, None)
    return dict(ops)


@pytest.mark.parametrize("layer,chain,layout", _suite_chain_kinds())
def test_xla_candidate_is_the_users_chain(layer: str, chain: str, layout: str) -> None:
    from jaxfuse import measure
    from jaxfuse.bench.cases import BenchCase

    cpu = jax.devices("cpu")[0]
    case = BenchCase.for_layer(layer, 1, "float16", layout, chain)
    plan, _ = case.plan(cpu, solver="xla")
    candidate = find.xla_function(plan.signature)
    operands = measure.random_operands(plan.signature, cpu, 1)[0]
    ours = jax.jit(lambda s: candidate(*s, measure.TIMING_SCALARS)).lower(operands).compile()
    users = jax.jit(lambda s: case.unfused()(*s)).lower(case.arg_sets(1, cpu)[0]).compile()
    assert _hlo_operations(ours.as_text()) == _hlo_operations(users.as_text())


class _Windows:
    """A stand-in harness whose windows time as listed, logging the order they run in."""

    def __init__(self, name: str, timings: list, log: list) -> None:
        self.name, self.timings, self.log = name, list(timings), log

    def run(self, limit=None, warm_up=None):
        from jaxfuse.measure import GPU_REWARM_SECONDS

        assert warm_up == GPU_REWARM_SECONDS  # (later windows: the device was just busy)
        self.log.append(self.name)
        return None, self.timings.pop(0)


@pytest.mark.parametrize("xla_first, xla_second, expected", [
    # XLA timed first, before the clocks rose: its second window (after the fused kernel's)
    # is the faster, and the choice follows it.
    (30.0, 24.0, "xla"),
    (30.0, 29.0, "fused"),
])
def test_close_gpu_candidates_get_a_second_window_in_the_other_order(xla_first, xla_second,
                                                                     expected) -> None:
    from jaxfuse.measure import Timing

    log: list = []
    harnesses = {"xla": _Windows("xla", [Timing(xla_second * 1e-6, 20e-6)], log),
                 "fused": _Windows("fused", [Timing(25e-6, 11e-6)], log)}
    device_us = {"xla": xla_first, "fused": 26.0}
    host_us = {"xla": 20.0, "fused": 12.0}
    times = {k: max(device_us[k], host_us[k]) for k in device_us}
    find._more_windows(harnesses, times, device_us, host_us, None, gpu=True)
    assert log == ["fused", "xla"]
    assert device_us == {"xla": min(xla_first, xla_second), "fused": 25.0}
    assert host_us == {"xla": 20.0, "fused": 11.0}
    assert find._faster(times, {}, "gpu", device_us, host_us) == expected


def test_closeness_is_judged_on_the_times_the_choice_compares() -> None:
    """A device-bound fused kernel is chosen on device time (find._faster), so that is where
    closeness counts: XLA's long launches (cuDNN's host work) do not keep its second window
    away, and the window finds XLA's true device time."""
    from jaxfuse.measure import Timing

    log: list = []
    harnesses = {"xla": _Windows("xla", [Timing(24.9e-6, 36.0e-6)], log),
                 "fused": _Windows("fused", [Timing(27.6e-6, 8.0e-6)], log)}
    device_us, host_us = {"xla": 30.0, "fused": 27.6}, {"xla": 36.7, "fused": 8.0}
    times = {k: max(device_us[k], host_us[k]) for k in device_us}
    assert times["xla"] > find._GPU_CLOSE * times["fused"]  # far apart by their costs
    find._more_windows(harnesses, times, device_us, host_us, None, gpu=True)
    assert log == ["fused", "xla"] and device_us["xla"] == 24.9
    assert find._faster(times, {}, "gpu", device_us, host_us) == "xla"


def test_cpu_candidates_get_a_second_window_however_far_apart() -> None:
    """CPUs (no launch split): the second window runs whatever the first gave, and more run
    only while the two are within _CPU_CLOSE; each keeps its fastest."""
    from jaxfuse.measure import Timing

    log: list = []
    harnesses = {"xla": _Windows("xla", [Timing(150e-6), Timing(140e-6)], log),
                 "fused": _Windows("fused", [Timing(50e-6), Timing(60e-6)], log)}
    times = {"xla": 300.0, "fused": 55.0}
    find._more_windows(harnesses, times, {}, {}, None, gpu=False)
    assert log == ["fused", "xla"]  # then 150 > 1.5 x 50: no third window
    assert times == {"xla": 150.0, "fused": 50.0}


def test_far_apart_gpu_candidates_get_no_second_window() -> None:
    log: list = []
    harnesses = {name: _Windows(name, [], log) for name in ("xla", "fused")}
    times = {"xla": 100.0, "fused": 60.0}
    find._more_windows(harnesses, times, {"xla": 100.0, "fused": 60.0},
                       {"xla": 10.0, "fused": 10.0}, None, gpu=True)
    assert log == []
