"""XLA's candidate compiled ahead (jaxfuse.find.compile_ahead): on the find step's thread
while the fused kernel compiles, into the plan's trial, which the choice then measures with;
only for signatures not measured before on the device; the kernel's wait for it reported."""

from __future__ import annotations

import contextlib
import threading
import time
import types

import jax
import numpy as np
import pytest
from cases import Case

from jaxfuse import compiled, find, measure, solvers
from jaxfuse.bench.selection import StepRecorder

pytestmark = pytest.mark.usefixtures("fresh_cache")

CPU = jax.devices("cpu")[0]
CHAIN = Case(ops="CBNA", dtype="float32", layout="NHWC", filter_layout="HWIO", n=2, c=8, h=9,
             w=9, k=16)


def _signature():
    return CHAIN.build()[0].signature


def test_the_choice_measures_with_the_candidate_compiled_ahead(monkeypatch) -> None:
    signature = _signature()
    trial = find.Trial()
    recorder = StepRecorder()
    with recorder.active():
        find._compile_xla_ahead(signature, CPU, trial)
    assert trial.ahead_seconds > 0
    # XLA's candidate compiles on the sets' shapes, the helpers beside it; then the sets are
    # drawn and the candidate loaded.
    steps = [step for _, step, _ in recorder.steps]
    assert sorted(steps) == ["compile", "helpers", "load", "sets"]
    assert steps.index("compile") < steps.index("sets") < steps.index("load")
    assert {phase for phase, _, _ in recorder.steps} == {"xla_ahead"}
    compiles = []
    original = find.Harness.compile

    def counted(*args, **kwargs):
        compiles.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(find.Harness, "compile", counted)
    drawn = []
    monkeypatch.setattr(find, "random_operands", lambda *args: drawn.append(args))
    kernel = solvers.prepare_fused(signature, CPU)
    decision = find._measure(signature, CPU, kernel, trial)
    assert set(dict(decision.times_us)) == {"xla", "fused"} and not decision.failures
    assert len(compiles) == 1 and not drawn  # the fused candidate's only; the sets kept


def test_the_helper_programs_compile_beside_xla_s_candidate_holding_nothing(monkeypatch
                                                                            ) -> None:
    """Their compiles are host work, on a thread of their own that never holds the device,
    while XLA's candidate compiles holding it (it autotunes), on the sets' shapes: the sets
    are drawn after both."""
    holders = set()  # the threads holding the device

    @contextlib.contextmanager
    def device_timing():
        holders.add(threading.get_ident())
        try:
            yield
        finally:
            holders.discard(threading.get_ident())

    monkeypatch.setattr(find, "device_timing", device_timing)
    for worker in (find._worker, find._helper_worker):  # (nothing of an earlier test left)
        worker.submit(lambda: None).result()
    both = threading.Barrier(2, timeout=10)  # each waits for the other: they overlap
    helpers = []

    def compile_helper_programs(*args):
        both.wait()
        helpers.append(threading.get_ident() in holders)

    monkeypatch.setattr(find, "compile_helper_programs", compile_helper_programs)
    compiles = []
    original = find.Harness.compile

    def compile_(fn, sets, *args, **kwargs):
        both.wait()
        compiles.append((threading.get_ident() in holders,
                         isinstance(sets[0][0], jax.ShapeDtypeStruct)))
        return original(fn, sets, *args, **kwargs)

    monkeypatch.setattr(find.Harness, "compile", compile_)
    trial = find.Trial()
    find._compile_xla_ahead(_signature(), CPU, trial)
    assert not both.broken  # (they met: the helpers ran while XLA's candidate compiled)
    assert helpers == [False] and compiles == [(True, True)] and trial.ahead_seconds > 0
    assert not isinstance(trial._harnesses["xla"].sets[0][0], jax.ShapeDtypeStruct)


def test_helper_programs_compiled_ahead_are_not_compiled_again(monkeypatch) -> None:
    """What compile_helper_programs compiles is what drawing the sets and comparing outputs
    then run (on a GPU: the CPU stands in, drawing on the device as a GPU does)."""
    monkeypatch.setattr(measure, "_platform_kind", lambda device: "gpu")
    big = Case(ops="CBNA", dtype="bfloat16", layout="NCHW", filter_layout="OIHW", n=2, c=48,
               h=110, w=101, k=24)  # (x: 1.07 M elements, above _HOST_RANDOM_ELEMENTS)
    signature = big.build()[0].signature
    compiles = []

    def listener(event, seconds, **kwargs):
        if "backend_compile" in event:
            compiles.append(event)

    measure.compile_helper_programs(signature, CPU)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        (x, *_), *_ = measure.random_operands(signature, CPU, 2)
        output = jax.device_put(np.zeros(signature.output_shape, signature.dtype), CPU)
        measure._device_error_terms(output, output)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert x.shape == signature.operands[0].shape and x.dtype == signature.dtype
    assert not compiles


def test_helpers_that_fail_are_awaited_and_logged(monkeypatch, caplog) -> None:
    """A failed helper compile is no failure of the step (drawing the sets compiles them
    again), and it is over before the step is: nothing of it runs into the choice."""
    def compile_helper_programs(*args):
        time.sleep(0.2)
        raise RuntimeError("helpers broke")

    monkeypatch.setattr(find, "compile_helper_programs", compile_helper_programs)
    monkeypatch.setattr(find, "xla_function", lambda signature: 1 / 0)  # (and XLA's too)
    trial = find.Trial()
    with caplog.at_level("DEBUG", logger="jaxfuse"):
        find._compile_xla_ahead(_signature(), CPU, trial)
    assert trial.ahead_seconds >= 0.2  # (it waited for them)
    assert "helpers broke" in caplog.text and "division by zero" in caplog.text


def test_a_measured_record_names_the_decisions_version() -> None:
    """A signature measured under an older rule (decision key) is measured again, so it is
    compiled ahead again: the record of its measurement carries the rule's version."""
    gpu = types.SimpleNamespace(platform="gpu", device_kind="H100")
    assert f"decisions v{find._decision_version('gpu')}|" in find._measured_key(_signature(),
                                                                               gpu)


def test_only_signatures_not_measured_before_on_a_gpu_compile_ahead(monkeypatch) -> None:
    submitted = []
    monkeypatch.setattr(find, "_compile_xla_ahead", lambda *args: submitted.append(args))
    gpu = types.SimpleNamespace(platform="gpu", device_kind="H100")
    signature = _signature()
    find.compile_ahead(signature, CPU, find.Trial())
    assert not submitted  # (CPUs: their kernel step is quick, nothing to overlap)
    find.compile_ahead(signature, gpu, find.Trial())
    find._worker.submit(lambda: None).result()  # (the find step's thread ran it)
    assert len(submitted) == 1
    find._mark_measured(signature, gpu)
    find.compile_ahead(signature, gpu, find.Trial())
    find._worker.submit(lambda: None).result()
    assert len(submitted) == 1


def test_the_kernels_wait_for_the_device_is_a_step_of_its_own(monkeypatch) -> None:
    waits = iter([1.0, 1.25])  # the autotuner's waits on this thread, before and after

    class FakeExtension:
        def timing_waited(self):
            return next(waits)

    monkeypatch.setattr(compiled, "extension", FakeExtension)
    own = solvers.FusedKernel("cpu")

    def prepare_forms(signature, device):
        time.sleep(0.3)  # (of which the autotuner waited 0.25 s)
        return [own]

    monkeypatch.setattr(compiled, "prepare_forms", prepare_forms)
    kernel, seconds = compiled._prepare(_signature(), CPU, find.Trial())
    steps = dict(seconds)
    assert kernel is own and set(steps) == {"kernel", "waited"}
    assert steps["waited"] == pytest.approx(0.25)
    assert steps["kernel"] == pytest.approx(0.05, abs=0.04)


def test_a_plan_compiled_with_its_candidate_ahead_reports_both(monkeypatch) -> None:
    """The whole flow, on a CPU standing in for a GPU: XLA's candidate compiles on the find
    step's thread while the plan's kernel is prepared, the choice measures with it, and the
    plan reports the compile beside the kernel step."""
    def ahead_anywhere(signature, device, trial):
        find._worker.submit(find._compile_xla_ahead, signature, device, trial)

    monkeypatch.setattr(compiled.find, "compile_ahead", ahead_anywhere)
    plan = compiled.compile_signature(_signature(), CPU, "auto")
    steps = dict(plan.seconds)
    assert set(steps) == {"kernel", "choice", "xla_ahead"} and steps["xla_ahead"] > 0
    assert set(dict(plan.times_us)) == {"xla", "fused"} and plan.decided == "measured"


def test_a_plan_whose_compile_ends_first_drops_its_candidate_compiled_ahead(monkeypatch
                                                                            ) -> None:
    """A plan that falls back to XLA (its kernel cannot be built) returns before the find
    step's thread reaches its task: the task is dropped, and no sets are drawn for it."""
    monkeypatch.setattr(find, "_compiles_ahead", lambda device: True)

    def refuse(signature, device):
        raise compiled.FusionError("no kernel for this plan here")

    monkeypatch.setattr(compiled, "prepare_forms", refuse)
    drawn = []
    monkeypatch.setattr(find, "random_operands", lambda *args: drawn.append(args))
    started = threading.Event()
    find._worker.submit(started.wait, 10)  # (the thread busy, as with other plans' work)
    try:
        plan = compiled.compile_signature(_signature(), CPU, "auto")
    finally:
        started.set()
    find._worker.submit(lambda: None).result()
    assert plan.decided == "fallback" and not drawn


def test_a_closed_trial_s_task_stops_before_drawing_the_sets(monkeypatch) -> None:
    drawn = []
    monkeypatch.setattr(find, "random_operands", lambda *args: drawn.append(args))
    trial = find.Trial()
    original = find.Harness.compile

    def compile_(*args, **kwargs):
        trial.close()  # (its plan's compile ends while XLA's candidate compiles)
        return original(*args, **kwargs)

    monkeypatch.setattr(find.Harness, "compile", compile_)
    find._compile_xla_ahead(_signature(), CPU, trial)
    assert not drawn and "xla" in trial._harnesses  # (compiled on the shapes alone)
    find._compile_xla_ahead(_signature(), CPU, trial)  # (closed before it starts: nothing)


def test_sets_are_drawn_ahead_only_within_the_budget_of_open_trials(monkeypatch) -> None:
    """Plans compiled together each draw their sets ahead only while all open trials' sets
    fit _AHEAD_BYTES; one refused draws them at its measurement, which still measures."""
    signature = _signature()
    nbytes = measure.sets_bytes(signature, CPU)
    monkeypatch.setattr(find, "_AHEAD_BYTES", nbytes)
    holder = find.Trial()
    holder.sets(signature, CPU)  # (another plan's trial, holding its sets)
    assert find._resident[holder._number] == nbytes
    trial = find.Trial()
    find._compile_xla_ahead(signature, CPU, trial)
    assert trial._sets is None and "xla" in trial._shaped  # (compiled, not loaded)
    kernel = solvers.prepare_fused(signature, CPU)
    decision = find._measure(signature, CPU, kernel, trial)
    assert set(dict(decision.times_us)) == {"xla", "fused"} and not decision.failures
    holder.close()
    assert holder._number not in find._resident
    alone = find.Trial()  # (no other trial holds sets: drawn ahead, whatever their size)
    monkeypatch.setattr(find, "_AHEAD_BYTES", 0)
    trial.close()
    find._compile_xla_ahead(signature, CPU, alone)
    assert alone._sets is not None
    number = alone._number
    del alone
    import gc

    gc.collect()
    assert number not in find._resident  # (a trial never closed is released when it goes)
