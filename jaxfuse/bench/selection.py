"""``python -m jaxfuse.bench.selection``: where compiling a plan in auto mode spends its time,
step by step, for the layers of a benchmark suite.

Issue #11 bounds the selection (timing the fused kernel's forms against each other, then the
fastest against XLA's composition) at 2 s a signature when cold. ``kernel_info["compile_s"]``
gives its steps ("kernel", "waited", "forms", "choice", and "xla_ahead" beside the kernel);
this breaks the selection's down into what they do: draw the random input sets, compile
each candidate's timing program, load and run it, and compare the candidates' outputs. Run
it in an empty cache (``JAXFUSE_CACHE_DIR``) to see a cold compile; each layer's signature is
new to the process, but XLA's autotuning results for a convolution it has seen before are
not.

    JAXFUSE_CACHE_DIR=$(mktemp -d) python -m jaxfuse.bench.selection --suite resnet50_net \\
        --dtype float32 --layout NCHW --batch 256
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

from .. import compiled, find, measure
from .cases import BenchCase
from .layers import SUITES

# What the find step calls, by the name it is recorded under: (module, attribute).
_STEPS = {"sets": (find, "random_operands"), "compare": (find, "relative_error"),
          "helpers": (find, "compile_helper_programs"),
          "load": (measure.Harness, "load"), "run": (measure.Harness, "run")}
# The selection's phases, named as in kernel_info["compile_s"]: the caller's (the forms'
# timing, the choice), and XLA's candidate compiled ahead on the find step's thread.
_PHASES = {"forms": (find, "fastest_form"), "choice": (find, "choose")}
_AHEAD = {"xla_ahead": (find, "_compile_xla_ahead")}


class StepRecorder:
    """Records, while active, every step the find step takes: ``[phase, step, seconds]`` in
    the order they ran, the phase being "xla_ahead", "forms" or "choice" (plans compile one
    at a time here, and the find step measures on one thread: while it compiles XLA's
    candidate ahead, that is all it does)."""

    def __init__(self) -> None:
        self.steps: list[list[Any]] = []
        self._phase = "kernel"  # the caller's
        self._ahead: str | None = None  # the find step thread's, while it compiles ahead

    @contextlib.contextmanager
    def active(self) -> Iterator[StepRecorder]:
        originals = [(owner, name, owner.__dict__[name])
                     for owner, name in (*_STEPS.values(), *_PHASES.values(),
                                         *_AHEAD.values(), (measure.Harness, "compile"))]
        try:
            for step, (owner, name) in _STEPS.items():
                setattr(owner, name, self._timed(step, getattr(owner, name)))
            for phase, (owner, name) in _PHASES.items():
                setattr(owner, name, self._in_phase(phase, getattr(owner, name)))
            for phase, (owner, name) in _AHEAD.items():
                setattr(owner, name, self._in_phase(phase, getattr(owner, name), "_ahead"))
            measure.Harness.compile = classmethod(
                self._timed("compile", measure.Harness.compile.__func__))
            yield self
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)

    def _timed(self, step: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.steps.append([self._ahead or self._phase, step,
                                   time.perf_counter() - start])
        return timed

    def _in_phase(self, phase: str, fn: Callable[..., Any],
                  attribute: str = "_phase") -> Callable[..., Any]:
        def in_phase(*args: Any, **kwargs: Any) -> Any:
            before = getattr(self, attribute)
            setattr(self, attribute, phase)
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, attribute, before)
        return in_phase


def profile_case(case: BenchCase, device: Any) -> dict[str, Any]:
    """Compiles `case`'s plan in auto mode on `device` and says what each step took."""
    recorder = StepRecorder()
    start = time.perf_counter()
    with recorder.active():
        plan, _ = case.plan(device, solver="auto")
    info = plan.kernel_info
    row: dict[str, Any] = {"case": case.label(), "solver": info["solver"],
                           "seconds": time.perf_counter() - start,
                           "compile_s": info.get("compile_s", {}), "steps": recorder.steps}
    for phase in (*_AHEAD, *_PHASES):
        total = row["compile_s"].get(phase)
        if total is None:
            continue
        parts: dict[str, list[float]] = {}  # each call's seconds, in the order they ran
        for where, step, seconds in recorder.steps:
            if where == phase:
                parts.setdefault(step, []).append(seconds)
        # (the rest: candidates prepared, outputs moved, the disk cache written; the helper
        # programs compile beside XLA's candidate, on a thread of their own)
        parts["other"] = [total - sum(sum(times) for step, times in parts.items()
                                      if not (phase in _AHEAD and step == "helpers"))]
        row[f"{phase}_parts"] = parts
    return row


def selection_seconds(compile_s: dict[str, float]) -> float:
    """What issue #11 bounds: the compile's wall time the selection adds, that is the
    kernel's wait for XLA's candidate compiled ahead, the forms' timing and the choice."""
    return sum(compile_s.get(step, 0.0) for step in ("waited", "forms", "choice"))


def describe(row: dict[str, Any]) -> str:
    """The steps' seconds, then a line for each part of the selection: each call's seconds
    in the order they ran (the choice compiles and runs XLA's candidate first, unless it
    was compiled ahead)."""
    steps = row["compile_s"]
    line = (f"{row['case']}: {row['solver']}; selection {selection_seconds(steps):.2f} s = "
            f"waited {steps.get('waited', 0):.2f} + forms {steps.get('forms', 0):.2f} + "
            f"choice {steps.get('choice', 0):.2f}; kernel {steps.get('kernel', 0):.2f} s, "
            f"xla_ahead {steps.get('xla_ahead', 0):.2f} s (beside it)")
    for phase in (*_AHEAD, *_PHASES):
        if f"{phase}_parts" in row:
            line += f"\n  {phase}: " + ", ".join(
                f"{step}{' (beside)' if phase in _AHEAD and step == 'helpers' else ''} "
                + "+".join(f"{t:.2f}" for t in times)
                for step, times in row[f"{phase}_parts"].items())
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxfuse.bench.selection",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--suite", default="resnet50_net", choices=sorted(SUITES))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layout", default="NCHW", choices=["NCHW", "NHWC"])
    parser.add_argument("--ops", default="CBNA")
    parser.add_argument("--layers", default=None, metavar="REGEX")
    parser.add_argument("--bound", type=float, default=2.0,
                        help="seconds the selection (forms + choice) may take (issue #11)")
    parser.add_argument("--platform", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    device = jax.devices(args.platform)[0] if args.platform else jax.devices()[0]
    if compiled.cache_info()["compilations"]:  # (nothing here may be warm but XLA's autotuner)
        print("note: plans were compiled before in this process", file=sys.stderr)
    rows = []
    for layer in SUITES[args.suite]:
        if args.layers is None or re.search(args.layers, layer.name):
            case = BenchCase.for_layer(layer, args.batch, args.dtype, args.layout, args.ops)
            rows.append(profile_case(case, device))
            print(describe(rows[-1]), flush=True)
    selection = sorted((selection_seconds(r["compile_s"]), r["case"]) for r in rows)
    if selection:
        print(f"\nselection (waited + forms + choice) on {device.device_kind}: median "
              f"{selection[len(selection) // 2][0]:.2f} s, max {selection[-1][0]:.2f} s "
              f"({selection[-1][1]}), {sum(s > args.bound for s, _ in selection)} of "
              f"{len(selection)} above {args.bound} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": device.device_kind, "jax": jax.__version__,
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
