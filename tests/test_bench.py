"""The layer benchmark's measurement: candidates timed in turns, one row per case (CPU)."""

from __future__ import annotations

import io
import json
import time

import jax
import jax.numpy as jnp
import pytest

from jaxfuse.bench.__main__ import print_table, run_case, same_program
from jaxfuse.bench.cases import BenchCase
from jaxfuse.bench.roofline import Ceilings
from jaxfuse.bench.timing import batched, busy_ns, exposed_ns, span_ns, wall_times_interleaved
from jaxfuse.measure import Timing


def test_programs_are_timed_in_turns() -> None:
    calls: list[str] = []

    def program(name: str):
        def many(sets):
            calls.append(name)
            return [jnp.asarray(s[0]) for s in sets]
        return many

    times = wall_times_interleaved({"a": program("a"), "b": program("b")}, [(1.0,), (2.0,)],
                                   repeats=3, warmup=1)
    assert set(times) == {"a", "b"} and all(t > 0 for t in times.values())
    # A warm-up round, then three timed rounds, each starting with the next program.
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]


def test_runs_that_faulted_their_outputs_in_are_set_aside(monkeypatch) -> None:
    from jaxfuse.bench import timing

    state = {"faults": 0, "runs": 0}

    def program(many_sets):
        state["runs"] += 1
        if state["runs"] % 2 == 0:  # every other run faults a fresh output in, 3x slower
            state["faults"] += 3136
            time.sleep(0.006)
        else:
            time.sleep(0.002)
        return [jnp.asarray(s[0]) for s in many_sets]

    monkeypatch.setattr(timing, "page_faults", lambda: state["faults"])
    times = timing.wall_times_interleaved({"a": program}, [(1.0,)], repeats=9, warmup=1)
    assert times["a"] < 0.004  # the quiet runs' median, not the mix's


def test_a_cpu_case_counts_each_program_s_fastest_run(monkeypatch) -> None:
    """Two programs alike but for when the machine disturbed them: by each one's fastest run
    they time the same (by the median they would part 2x)."""
    from jaxfuse.bench import timing

    runs = {"a": 0, "b": 0}

    def program(name: str):
        def many(sets):
            runs[name] += 1
            slow = runs[name] % 3 != 0 if name == "a" else runs[name] % 3 == 0
            time.sleep(0.008 if slow else 0.002)
            return [jnp.asarray(s[0]) for s in sets]
        return many

    monkeypatch.setattr(timing, "page_faults", lambda: 0)
    times = timing.wall_times_interleaved({"a": program("a"), "b": program("b")}, [(1.0,)],
                                          repeats=9, warmup=1, statistic=min)
    assert times["a"] < 0.005 and times["b"] < 0.005
    assert times["a"] == pytest.approx(times["b"], rel=0.5)


def test_chained_ops_wait_for_each_other_and_compute_the_same() -> None:
    def op(x, w):
        return jnp.tanh(x * w)

    sets = [(jnp.full((4,), float(i + 1)), jnp.full((4,), 0.5)) for i in range(3)]
    independent, chained = batched(op), batched(op, chained=True)
    for a, b in zip(independent(sets), chained(sets), strict=True):
        assert jnp.array_equal(a, b)
    text = chained.lower(sets).as_text()
    assert text.count("optimization_barrier") == len(sets) - 1
    assert "optimization_barrier" not in independent.lower(sets).as_text()


@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("layer,chain", [("NA_C1024_H14", "NA"), ("r50_l4_1x1_2048", "CBNA")])
def test_a_case_reports_every_mode_against_xla(layer: str, chain: str, chained: bool) -> None:
    device = jax.devices("cpu")[0]
    case = BenchCase.for_layer(layer, 1, "float32", "NHWC", chain)
    ceilings = Ceilings(copy_bandwidth=1e10, matmul={"float32": 1e11})
    row = run_case(case, device, ceilings, sets=2, repeats=2, device_timing=False,
                   chained=chained)
    for mode in ("xla", "fused", "auto"):
        assert row[f"{mode}_wall_us"] > 0
    for mode in ("fused", "auto"):
        assert row[f"ratio_{mode}_wall"] == pytest.approx(row["xla_wall_us"]
                                                          / row[f"{mode}_wall_us"])
        assert row[f"{mode}_rel_error_vs_xla"] < 1e-4
    # what compiling each plan took, by step (the auto plan's includes its choice)
    assert set(row["fused_compile_s"]) == {"kernel"}
    assert set(row["auto_compile_s"]) == {"kernel", "choice"}


def test_a_plan_running_xla_s_own_program_takes_xla_s_time() -> None:
    """Auto mode that runs XLA's composition compiles to XLA's program: timing it again would
    measure only the machine's noise, so the row takes XLA's time and says so."""
    device = jax.devices("cpu")[0]
    case = BenchCase.for_layer("NA_C1024_H14", 1, "float32", "NHWC", "NA")
    sets = case.arg_sets(2, device)
    plan, ops = case.plan(device, solver="xla")
    assert same_program(batched(case.fused(plan, ops)), batched(case.unfused()), sets)
    forced, ops = case.plan(device, solver="fused")
    assert not same_program(batched(case.fused(forced, ops)), batched(case.unfused()), sets)


def test_a_case_whose_auto_plan_is_xla_s_program(monkeypatch) -> None:
    plan = BenchCase.plan
    # auto mode's measurement picks XLA here
    monkeypatch.setattr(BenchCase, "plan", lambda self, device, solver: plan(
        self, device, solver="xla" if solver == "auto" else solver))
    device = jax.devices("cpu")[0]
    case = BenchCase.for_layer("NA_C1024_H14", 1, "float32", "NHWC", "NA")
    ceilings = Ceilings(copy_bandwidth=1e10, matmul={"float32": 1e11})
    row = run_case(case, device, ceilings, sets=2, repeats=2, device_timing=False)
    assert row["auto_solver"] == "xla" and row["auto_same_program_as"] == "xla"
    assert row["auto_wall_us"] == row["xla_wall_us"] and row["ratio_auto_wall"] == 1.0


def test_a_twin_s_device_time_is_its_twin_s(monkeypatch) -> None:
    """Device times too: a program timed again would read as a different speed. Every
    program of a row is traced once, together (a trace costs seconds on a GPU)."""
    import jaxfuse.bench.__main__ as bench
    from jaxfuse.bench.timing import DeviceTiming

    plan = BenchCase.plan
    monkeypatch.setattr(BenchCase, "plan", lambda self, device, solver: plan(
        self, device, solver="xla" if solver == "auto" else solver))
    seconds = {"xla": 1.0, "fused": 2.0, "auto": 3.0, "copy": 4.0}
    traced: list = []

    def one_trace(programs, calls=5):
        traced.append(list(programs))
        return {name: DeviceTiming(seconds[name] * 1e-6, 1.0, 2 * seconds[name] * 1e-6, {})
                for name in programs}

    monkeypatch.setattr(bench, "device_timings", one_trace)
    queued: list = []

    def queued_times(functions, arg_sets, device):
        queued.append(list(functions))
        return {name: Timing(seconds[name] * 3e-6, 1e-6) for name in functions}

    monkeypatch.setattr(bench, "queued_times", queued_times)
    device = jax.devices("cpu")[0]
    case = BenchCase.for_layer("NA_C1024_H14", 1, "float32", "NHWC", "NA")
    ceilings = Ceilings(copy_bandwidth=1e10, matmul={"float32": 1e11})
    row = run_case(case, device, ceilings, sets=2, repeats=2, device_timing=True)
    assert row["auto_same_program_as"] == "xla"
    assert traced == [["xla", "copy", "fused"]]  # one trace, the auto plan not in it
    assert queued == [["xla", "fused"]]  # likewise
    assert row["auto_queued_us"] == row["xla_queued_us"] == 3.0
    assert row["fused_queued_us"] == 6.0 and row["fused_queued_host_us"] == 1.0
    assert row["ratio_auto_queued"] == 1.0 and row["ratio_fused_queued"] == 0.5
    assert row["auto_dispatch_us"] == row["xla_dispatch_us"] > 0
    assert row["auto_device_us"] == row["xla_device_us"] == 1.0
    assert row["ratio_auto_device"] == 1.0 and row["fused_device_us"] == 2.0
    assert row["auto_span_us"] == row["xla_span_us"] == 2.0 and row["fused_span_us"] == 4.0
    assert row["ratio_auto_span"] == 1.0 and row["ratio_fused_span"] == 0.5
    table = io.StringIO()
    print_table([row], out=table)
    assert "geomean xla/jaxfuse (span) N=1 float32 NHWC NA: forced 0.50" in table.getvalue()
    assert "geomean xla/jaxfuse (queued) N=1 float32 NHWC NA: forced 0.50" in table.getvalue()


def test_the_host_s_part_of_a_call_is_kept_apart() -> None:
    """The time until a call returns (its dispatch) is part of its wall time."""

    def slow_dispatch(sets):
        time.sleep(0.003)
        return [jnp.asarray(s[0]) for s in sets]

    dispatch: dict[str, float] = {}
    times = wall_times_interleaved({"a": slow_dispatch}, [(1.0,)], repeats=3, warmup=1,
                                   dispatch=dispatch)
    assert 0.003 <= dispatch["a"] <= times["a"]


def test_queued_times_run_the_find_step_s_harness_on_each_function() -> None:
    """On a CPU the harness times wall clock; a function that does not compile gets None."""
    from jaxfuse.bench.timing import queued_times

    def broken(x):
        raise TypeError("does not trace")

    sets = [(jnp.arange(8.0) + i,) for i in range(2)]
    times = queued_times({"double": lambda x: x * 2, "broken": broken}, sets,
                         jax.devices("cpu")[0])
    assert times["broken"] is None
    assert times["double"] is not None and times["double"].device > 0


def test_a_case_whose_auto_plan_is_the_forced_kernel_s_program() -> None:
    device = jax.devices("cpu")[0]
    case = BenchCase.for_layer("NA_C1024_H14", 1, "float32", "NHWC", "NA")
    ceilings = Ceilings(copy_bandwidth=1e10, matmul={"float32": 1e11})
    row = run_case(case, device, ceilings, sets=2, repeats=2, device_timing=False)
    twin = "xla" if row["auto_solver"] == "xla" else "fused"
    assert row["auto_same_program_as"] == twin
    assert row["auto_wall_us"] == row[f"{twin}_wall_us"]


def _kernels(starts_us, duration_us=10.0):
    return [(int(t * 1e3), int(duration_us * 1e3), f"k{i % 2}") for i, t in enumerate(starts_us)]


def _fake_trace(monkeypatch, trace_of_calls):
    """A profiler stand-in: runs the traced function (its calls log themselves, its sleeps
    too) and returns the kernels `trace_of_calls` gives for that log."""
    from jaxfuse.bench import timing

    log: list = []
    monkeypatch.setattr(timing.time, "sleep", lambda seconds: log.append("sleep"))

    def traced(run):
        log.clear()
        run()
        return trace_of_calls(log)

    monkeypatch.setattr(timing, "_traced_kernels", traced)
    return log


def _logging(name, log, ops=2):
    def many(sets):
        log.append(name)
        return jnp.zeros(1)
    return many, [()] * ops


def test_one_trace_is_split_into_calls_at_the_sleeps_between_them(monkeypatch) -> None:
    """Two programs, two calls each, each call after a sleep; two kernels a call (20 us
    apart in a's calls, 30 in b's); calls 2 ms apart. Each program gets its own calls."""
    from jaxfuse.bench import timing

    starts = [0, 20, 2000, 2020, 4000, 4030, 6000, 6030]
    log = _fake_trace(monkeypatch, lambda log: _kernels(starts))
    got = timing.device_timings({"a": _logging("a", log), "b": _logging("b", log)}, calls=2)
    assert log == ["sleep", "a", "sleep", "a", "sleep", "b", "sleep", "b"]
    assert got["a"].shared and got["b"].shared
    # 20 us of kernels a call, 2 ops: 10 us an op; spans of 30 and 40 us a call.
    assert got["a"].seconds == pytest.approx(10e-6) and got["b"].seconds == pytest.approx(10e-6)
    assert got["a"].span == pytest.approx(15e-6) and got["b"].span == pytest.approx(20e-6)
    assert got["a"].kernels_per_op == 1.0 and got["a"].by_kernel == {
        "k0": pytest.approx(5e-6), "k1": pytest.approx(5e-6)}


def test_a_split_that_is_not_clean_is_refused() -> None:
    from jaxfuse.bench.timing import _split

    kernels = _kernels([0, 20, 2000, 2020, 4000, 4030, 6000, 6030])
    assert [len(g) for g in _split(kernels, 4, min_gap_ns=1e6)] == [2, 2, 2, 2]
    assert _split(kernels, 3, min_gap_ns=1e6) is None  # four calls where three were asked
    assert _split(kernels, 9, min_gap_ns=0) is None  # fewer kernels than calls
    # Without a floor: the largest gaps, whatever they are.
    assert [len(g) for g in _split(kernels, 3, min_gap_ns=0)] == [2, 2, 4]


def test_programs_that_cannot_be_told_apart_are_traced_one_by_one(monkeypatch) -> None:
    """A program with a gap of its own as long as the sleeps between calls: the one trace
    cannot be split cleanly, so each program gets a trace of its own."""
    from jaxfuse.bench import timing

    traces = iter([_kernels([0, 5000, 8000, 13000]),  # both programs, one call each: unclean
                   _kernels([0, 5000]), _kernels([0, 20])])  # then one trace each
    _fake_trace(monkeypatch, lambda log: next(traces))
    nothing = (lambda sets: jnp.zeros(1), [()])
    got = timing.device_timings({"gappy": nothing, "b": nothing}, calls=1)
    assert got["gappy"].span == pytest.approx(5010e-6) and got["b"].span == pytest.approx(30e-6)
    assert not got["gappy"].shared


def test_a_count_of_gaps_that_only_looks_clean_is_not_trusted(monkeypatch) -> None:
    """Program a's calls launch nothing, and b has a long gap of its own in each call: the
    number of long gaps matches, but b's calls would come out unlike each other."""
    from jaxfuse.bench import timing

    both = [(0, 10, "x"), (3000, 10, "y"), (6000, 10, "x"), (9000, 10, "y")]
    traces = iter([both, [], both])
    _fake_trace(monkeypatch, lambda log: next(traces))
    nothing = (lambda sets: jnp.zeros(1), [()])
    got = timing.device_timings({"a": nothing, "b": nothing}, calls=2)
    assert got["a"] is None  # traced alone: no kernels
    assert got["b"].kernels_per_op == 2.0 and not got["b"].shared  # its own trace, both calls


def test_device_time_counts_overlapping_kernels_once() -> None:
    # (start, duration): a kernel that starts before the previous one ends (programmatic
    # dependent launch) and waits for it adds only what runs past that one's end.
    assert busy_ns([(0, 10), (20, 5)]) == 15
    assert busy_ns([(0, 10), (4, 10), (6, 2), (30, 1)]) == 15
    assert busy_ns([]) == 0
    # The span: first start to last end, the gaps between kernels included.
    assert span_ns([(0, 10), (20, 5)]) == 25
    assert span_ns([(0, 10), (4, 10), (6, 2)]) == 14
    assert span_ns([]) == 0
    # Each kernel's part past every earlier one's end: what it adds to the union.
    assert exposed_ns([(0, 10), (4, 10), (6, 2), (30, 1)]) == [10, 4, 0, 1]


def test_whole_models_are_timed_in_turns() -> None:
    from jaxfuse.bench.end_to_end import forward_seconds_interleaved

    calls: list[str] = []

    def program(name: str):
        def fn(x):
            calls.append(name)
            return jnp.asarray(x)
        return fn

    times = forward_seconds_interleaved({"a": program("a"), "b": program("b")}, (1.0,),
                                        calls=2, repeats=2)
    assert set(times) == {"a", "b"} and all(t > 0 for t in times.values())
    # Two calls each to size the blocks, then two rounds of two-call blocks, the order rotating.
    assert calls == ["a", "a", "b", "b", "a", "a", "b", "b", "b", "b", "a", "a"]


@pytest.mark.filterwarnings("ignore")
def test_a_model_run_saves_each_row_as_it_finishes(tmp_path, monkeypatch, capsys) -> None:
    from jaxfuse.bench import end_to_end

    done: list[int] = []

    def fake_run(name, batch, dtype, size, device, modes, devices):
        # The rows before this one are already on disk when the next starts.
        if done:
            assert len(json.loads((tmp_path / "r.json").read_text())["rows"]) == len(done)
        done.append(batch)
        return {"model": name, "batch": batch, "dtype": dtype, "devices": devices,
                "plain_ms": 2.0, "auto_ms": 1.0, "auto_speedup": 2.0}

    monkeypatch.setattr(end_to_end, "run", fake_run)
    end_to_end.main(["--platform", "cpu", "--model", "resnet50", "--batch", "1", "8",
                     "--dtype", "float32", "--json", str(tmp_path / "r.json")])
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 8] and all("row_s" in r for r in rows)
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "device: cpu" and len(table) == 4 and table[2].startswith("resnet50")


def test_one_run_of_several_suites_sums_each_suite_apart() -> None:
    """A run may hold several suites (one process start-up on the device): its geomeans and
    network sums are per suite."""
    def row(suite, layer, ratio, count=1):
        return {"suite": suite, "case": layer, "layer": layer, "n": 1, "dtype": "bfloat16",
                "layout": "NHWC", "ops": "CBNA", "count": count, "floor_us": 1.0,
                "ratio_fused_wall": ratio, "ratio_auto_wall": ratio, "xla_wall_us": 10.0,
                "fused_wall_us": 10.0 / ratio, "auto_wall_us": 10.0 / ratio}

    table = io.StringIO()
    print_table([row("resnet50", "a", 2.0), row("na", "b", 0.5),
                 row("resnet50_net", "c", 1.0, count=3)], out=table)
    text = table.getvalue()
    assert "geomean xla/jaxfuse (wall) resnet50 N=1 bfloat16 NHWC CBNA: forced 2.00" in text
    assert "geomean xla/jaxfuse (wall) na N=1 bfloat16 NHWC CBNA: forced 0.50" in text
    assert "network sum (wall) resnet50_net N=1 bfloat16 NHWC: xla 30 us" in text
    assert "network sum (wall) resnet50 " not in text  # (no layer of it counts more than once)


@pytest.mark.parametrize("missing", ["xla", "copy", "fused"])
def test_a_program_without_a_device_time_leaves_its_columns_out(monkeypatch, missing) -> None:
    import jaxfuse.bench.__main__ as bench
    from jaxfuse.bench.timing import DeviceTiming

    monkeypatch.setattr(bench, "device_timings", lambda programs, calls=5: {
        name: None if name == missing else DeviceTiming(2e-6, 1.0, 3e-6, {}, shared=True)
        for name in programs})
    device = jax.devices("cpu")[0]
    case = BenchCase.for_layer("NA_C1024_H14", 1, "float32", "NHWC", "NA")
    ceilings = Ceilings(copy_bandwidth=1e10, matmul={"float32": 1e11})
    row = run_case(case, device, ceilings, sets=2, repeats=2, device_timing=True)
    assert ("ratio_fused_device" in row) == (missing not in ("xla", "fused"))
    assert ("copy_device_us" in row) == (missing != "copy")  # (else against the wall time)
    assert row["device_trace_shared"] == (missing != "xla")


def test_a_queued_measurement_that_fails_costs_only_its_own_numbers(monkeypatch) -> None:
    """A harness that raises while running (out of memory, say) leaves that function's time
    None; the others are timed, and the sweep goes on."""
    from jaxfuse.bench import timing

    run = timing.Harness.run

    def failing_run(self, *args, **kwargs):
        if self.sets[0][0].shape == (3,):
            raise RuntimeError("RESOURCE_EXHAUSTED")
        return run(self, *args, **kwargs)

    monkeypatch.setattr(timing.Harness, "run", failing_run)
    times = timing.queued_times({"ok": lambda x: x * 2}, [(jnp.arange(4.0),)],
                                jax.devices("cpu")[0])
    assert times["ok"] is not None
    times = timing.queued_times({"bad": lambda x: x * 2}, [(jnp.arange(3.0),)],
                                jax.devices("cpu")[0])
    assert times == {"bad": None}


def test_a_call_that_waits_far_past_its_device_time_is_traced(capsys) -> None:
    from jaxfuse.bench.__main__ import _probe_stalls

    program = jax.jit(lambda sets: [a * 2 + 1 for (a,) in sets])
    args = [(jnp.arange(64.0) + i,) for i in range(2)]
    row = {"case": "c", "xla_wall_us": 40.0, "xla_dispatch_us": 38.0, "xla_device_us": 5.0,
           "fused_wall_us": 245.0, "fused_dispatch_us": 19.0, "fused_device_us": 4.0}
    _probe_stalls(row, {"xla": program, "fused": program}, args)
    assert set(row["stalls"]) == {"xla", "fused", "control"}  # (XLA's beside it, a control)
    assert len(row["stalls"]["control"]["runs_us"]) == 10
    timeline = row["stalls"]["fused"]
    assert len(timeline["runs_us"]) == 10
    assert all(ready >= returned for returned, ready in timeline["runs_us"])
    assert timeline["events"] and all(start >= 0 for _, _, start, _ in timeline["events"])
    wait = timeline["milestones_us"]["wait"]  # (the CPU has no graph launches or kernels)
    assert 0 <= wait[0] <= wait[1] <= timeline["call_us"]
    assert "stall probe, c, fused" in capsys.readouterr().out

    quiet = {**row, "fused_wall_us": 30.0}
    del quiet["stalls"]
    _probe_stalls(quiet, {"xla": program, "fused": program}, args)
    assert "stalls" not in quiet


def test_a_stall_probe_that_fails_costs_the_row_nothing_else(monkeypatch) -> None:
    from jaxfuse.bench import stall
    from jaxfuse.bench.__main__ import _probe_stalls

    def busy(*_: object) -> dict:
        raise RuntimeError("Profile has already been started")

    monkeypatch.setattr(stall, "awaited_timeline", busy)
    row = {"case": "c", "fused_wall_us": 245.0, "fused_dispatch_us": 19.0,
           "fused_device_us": 4.0, "xla_wall_us": 40.0, "xla_dispatch_us": 38.0}
    _probe_stalls(row, {"xla": None, "fused": None}, [()])
    assert row["stalls"]["fused"] == {"error": "RuntimeError: Profile has already been started"}
    assert "error" in row["stalls"]["control"]  # (no program to run beside it either)


@pytest.mark.parametrize("model, solver, plans", [
    ("mobilenet", "fused", None),
    ("mb2_dw_7_960/NCHW", "auto", 1),  # one layer's chain: one signature, selected
], ids=["model", "layer"])
def test_a_cold_start_runs_in_a_fresh_process_with_an_empty_cache(model: str, solver: str,
                                                                  plans: int | None) -> None:
    from jaxfuse.bench import cold_start

    row = cold_start.measure(model, "float32", 1, solver, timeout=600)
    assert "error" not in row, row
    assert row["cache_entries_at_start"] == 0 and row["plans"] > 0
    assert plans is None or row["plans"] == plans
    assert row["first_call_s"] > row["second_call_s"] > 0


def test_a_cold_start_row_gives_the_selection_per_plan_and_the_wait_beyond_plain() -> None:
    from jaxfuse.bench import cold_start

    row = {"model": "m", "dtype": "float32", "batch": 8,
           "plain": {"first_call_s": 3.0}, "auto": {"first_call_s": 9.0, "plans": 4},
           "fused": {"first_call_s": 5.0, "plans": 4}}
    line = cold_start._line(row, ["plain", "auto", "fused"])
    assert line.split()[-3:] == ["4", "1.00", "+6.00"]
    row["auto"] = {"error": "exit 1: FusionError: ..."}
    line = cold_start._line(row, ["plain", "auto", "fused"])
    assert "ERROR" in line and "auto: exit 1" in line
