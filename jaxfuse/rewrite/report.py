"""``jaxfuse.fusion_report``: what :func:`jaxfuse.fuse` fuses in a function, and what it leaves.

>>> report = jaxfuse.fusion_report(model.apply, variables, x)        # doctest: +SKIP
>>> print(report)                                                   # doctest: +SKIP
>>> [g.plan for g in report.fused]                                  # doctest: +SKIP
['CBNA', 'CNSA', ...]
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend import source_info_util as siu
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from ..find import margin
from ..primitive import fused_chain_p
from .fuse import Rewriter, StaticArgs, recording, trace
from .lowering import plan_of
from .matcher import Group, PlanOp, Skipped

__all__ = ["FusedGroup", "FusionReport", "LeftAlone", "count_fused_calls", "fusion_report"]


@dataclasses.dataclass(frozen=True)
class FusedGroup:
    """A chain replaced by one fused call.

    Attributes:
      ops: the source operations in order, e.g. ``("conv", "bias add", "batch norm", "relu")``.
      plan: the fusion plan's operator letters, e.g. ``"CBNA"``.
      kernel: the plan signature (dtype, layout, shape, filter).
      where: the convolution's module path (flax name stack) and source line.
      scope: the nested body it sits in (``"jit(f)/scan"``), empty at the top level.
      stopped: why the chain ends there, or None at a natural end (the value is returned, or an
        operation that is not pointwise needs it, such as the next convolution).
      solver: what runs it: the fused kernel (``"conv_wgmma"``, ``"cpu"``, ...) or ``"xla"``.
      times_us: measured microseconds per run, by candidate (``"fused"``, ``"xla"``); empty
        when the solver was forced rather than measured.
      compile_s: wall seconds compiling its plan took, by step (``kernel_info["compile_s"]``).
      device_us, host_us: the two parts of `times_us` on GPUs, by candidate: the kernels' time
        and the host's launch work (empty on CPUs). A program's choice weighs their sums: a
        device-bound network keeps a chain XLA's where XLA's kernels are faster although its
        launches are longer (:mod:`jaxfuse.rewrite.choice`).
      decided: how the solver was decided (``kernel_info["decided"]``): ``"measured"``,
        ``"disk cache"`` (measured before), ``"forced"`` (the solver mode) or ``"fallback"``.
    """

    ops: tuple[str, ...]
    plan: str
    kernel: str
    where: str
    scope: str
    stopped: str | None
    solver: str = ""
    times_us: tuple[tuple[str, float], ...] = ()
    compile_s: tuple[tuple[str, float], ...] = ()
    device_us: tuple[tuple[str, float], ...] = ()
    host_us: tuple[tuple[str, float], ...] = ()
    decided: str = "measured"

    @property
    def saved_us(self) -> float | None:
        """Microseconds per run the solver saves over the other candidate (None unmeasured;
        below zero where XLA runs a chain the fused kernel was within the margin of)."""
        times = dict(self.times_us)
        if "fused" not in times or "xla" not in times:
            return None
        chosen = "xla" if self.solver == "xla" else "fused"
        return times["xla" if chosen == "fused" else "fused"] - times[chosen]


@dataclasses.dataclass(frozen=True)
class LeftAlone:
    """A convolution (or a nested body) left unfused, and why."""

    op: str
    where: str
    scope: str
    reason: str


@dataclasses.dataclass(frozen=True)
class FusionReport:
    """The fused groups, the chains left to XLA by measurement, the convolutions
    left alone, and the rewritten program.

    `converts_batched`: the float conversions of the fused calls' operands (filters that Flax
    converts from ``param_dtype`` to ``dtype``, ...) that run as one batched op per scope
    instead of one kernel each (:mod:`jaxfuse.rewrite.converts`).
    """

    fused: tuple[FusedGroup, ...]
    left_alone: tuple[LeftAlone, ...]
    jaxpr: ClosedJaxpr
    to_xla: tuple[FusedGroup, ...] = ()
    converts_batched: int = 0

    @property
    def fused_calls(self) -> int:
        """How many fused calls the rewritten program has: a body counts once per equation
        that holds it (a scan body once, not once per iteration)."""
        return count_fused_calls(self.jaxpr)

    def __iter__(self) -> Iterator[FusedGroup]:
        return iter(self.fused)

    def __len__(self) -> int:
        return len(self.fused)

    def _headline(self) -> str:
        xla = ""
        if self.to_xla:
            reasons = collections.Counter(_how(g) for g in self.to_xla)
            why = next(iter(reasons)) if len(reasons) == 1 else ", ".join(
                f"{count} {reason}" for reason, count in reasons.items())
            xla = f", {len(self.to_xla)} left to XLA ({why})"
        return (f"jaxfuse: {len(self.fused)} chain(s) fused{xla}, {len(self.left_alone)} "
                "left alone")

    def summary(self) -> str:
        """A few lines: per kind of chain, how many were fused, by which solver and the time
        saved; the chains left to XLA and why; every convolution left alone."""
        kinds: dict[tuple[str, tuple[str, ...], str], list[FusedGroup]] = {}
        for g in self.fused:
            kinds.setdefault((g.plan, g.ops, g.solver), []).append(g)
        lines = [self._headline()]
        chains = {key: f"{key[0]:<6} {' -> '.join(key[1])}" for key in kinds}
        width = max(map(len, chains.values()), default=0)
        for key, groups in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"  {len(groups):4d} x {chains[key]:<{width}}  {key[2]}"
                         f"{_saved(g.saved_us for g in groups)}")
        for g in self.to_xla:
            lines.append(f"  xla   {g.plan} at {g.where}: {_why_xla(g)}")
        for s in self.left_alone:
            lines.append(f"  left  {s.op} at {s.where}: {s.reason}")
        if self.converts_batched:
            lines.append(f"  {self.converts_batched} conversions of fused calls' operands run "
                         "as one batched op")
        measured = [g for g in (*self.fused, *self.to_xla) if g.saved_us is not None]
        if measured:
            unfused = sum(dict(g.times_us)["xla"] for g in measured)
            chosen = sum(dict(g.times_us)["fused" if g in self.fused else "xla"]
                         for g in measured)
            lines.append(f"  measured chains: {chosen:.1f} us per call as chosen, "
                         f"{unfused:.1f} us all-XLA (saves {unfused - chosen:.1f} us)")
        return "\n".join(lines)

    def __str__(self) -> str:
        lines = [self._headline()]
        for g in self.fused:
            scope = f" [in {g.scope}]" if g.scope else ""
            lines.append(f"  fused {g.plan:<6} {' -> '.join(g.ops)}")
            lines.append(f"        at {g.where}{scope}  ({g.kernel}; {g.solver}"
                         f"{_saved([g.saved_us])})")
            if g.stopped:
                lines.append(f"        stops: {g.stopped}")
        for g in self.to_xla:
            scope = f" [in {g.scope}]" if g.scope else ""
            lines.append(f"  xla   {g.plan:<6} {' -> '.join(g.ops)}")
            why = "XLA is faster" if _how(g) == "by measurement" else _how(g)
            lines.append(f"        at {g.where}{scope}  ({g.kernel}; {why}"
                         f"{_saved([g.saved_us])})")
        for s in self.left_alone:
            scope = f" [in {s.scope}]" if s.scope else ""
            lines.append(f"  left  {s.op} at {s.where}{scope}")
            lines.append(f"        because {s.reason}")
        return "\n".join(lines)


def fusion_report(fn: Callable[..., Any], *example_args: Any,
                  **example_kwargs: Any) -> FusionReport:
    """Traces `fn` on example arguments and reports what :func:`jaxfuse.fuse` does to it.

    `fn` may be a plain function or the result of :func:`jaxfuse.fuse` (whose static arguments
    are then honored). Nothing is executed; plans are compiled.
    """
    target, statics, solver = fn, StaticArgs((), ()), None
    while hasattr(target, "__jaxfuse_fuse__"):  # (fuse(fuse(f)) reports what fuse(f) does)
        target, statics, inner_solver = target.__jaxfuse_fuse__
        solver = solver or inner_solver
    closed, _, flat = trace(target, statics, example_args, example_kwargs)
    with recording() as recorder:
        rewriter = Rewriter(recorder, solver)
        new = jax.make_jaxpr(
            lambda *a: rewriter.evaluate(closed.jaxpr, closed.consts, a))(*flat)
    fused: list[FusedGroup] = []
    to_xla: list[FusedGroup] = []
    left: list[LeftAlone] = []
    for scope, groups, xla_groups, skipped in recorder.scopes:
        fused += [_describe_group(scope, g, recorder.solvers[id(g)]) for g in groups]
        to_xla += [_describe_group(scope, g, "xla") for g in xla_groups]
        left += [_describe_skipped(scope, s) for s in skipped]
    left += [LeftAlone(eqn.primitive.name, _where(eqn), scope, note)
             for scope, eqn, note in recorder.notes]
    converts = sum(count for _, count in recorder.converts)
    return FusionReport(tuple(fused), tuple(left), new, tuple(to_xla), converts)


def count_fused_calls(jaxpr: ClosedJaxpr | Jaxpr) -> int:
    """The number of fused-chain primitives in `jaxpr`, nested bodies included."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive is fused_chain_p
        for val in eqn.params.values():
            for v in val if isinstance(val, tuple) else (val,):
                if isinstance(v, (ClosedJaxpr, Jaxpr)):
                    count += count_fused_calls(v)
    return count


def _describe_group(scope: str, group: Group, solver: str) -> FusedGroup:
    plan = plan_of(group)
    ops = ["conv"] + [_op_label(op) for op in group.plan_ops]
    info = plan.kernel_info
    return FusedGroup(tuple(ops), group.letters, plan.signature.describe(),
                      _where(group.conv.eqn), scope, group.stop, solver,
                      tuple(info.get("candidates_us", {}).items()),
                      tuple(info.get("compile_s", {}).items()),
                      tuple(info.get("candidates_device_us", {}).items()),
                      tuple(info.get("candidates_host_us", {}).items()),
                      info.get("decided", "measured"))


def _how(group: FusedGroup) -> str:
    """How a chain came to be XLA's, in a few words."""
    return {"forced": "solver forced", "fallback": "no fused kernel"}.get(group.decided,
                                                                          "by measurement")


def _why_xla(group: FusedGroup) -> str:
    """Why a chain stayed XLA's, in the measurements that decided it: on GPUs the kernels' and
    the launches' microseconds apart (the larger of the two alone can favour the fused kernel
    where XLA's kernels are faster)."""
    if group.decided == "forced":
        return "XLA forced (solver \"xla\" or JAXFUSE_SOLVER=xla)"
    if group.decided == "fallback":
        return "XLA: the fused kernel is not available (kernel_info[\"failed\"] says why)"
    both = ("xla", "fused")
    times, device, host = dict(group.times_us), dict(group.device_us), dict(group.host_us)
    if all(k in device and k in host for k in both):
        return (f"XLA chosen by measurement (device {device['xla']:.1f} us vs "
                f"{device['fused']:.1f} us fused; launch work {host['xla']:.1f} us vs "
                f"{host['fused']:.1f} us)")
    if all(k in times for k in both):
        why = ""
        if times["fused"] < times["xla"]:  # (faster, yet not by what fusing needs)
            need = margin("cpu", pointwise="C" not in group.plan)
            why = (f": not the {need:.0%} faster a CPU's choice needs"
                   if times["fused"] > (1 - need) * times["xla"]
                   else ": the whole program's choice (jaxfuse.rewrite.choice)")
        return (f"XLA chosen by measurement ({times['xla']:.1f} us vs {times['fused']:.1f} us "
                f"fused{why})")
    return "XLA chosen"


def _saved(values: Any) -> str:
    """", saves 12.3 us" for the sum of the measured savings in `values`, or ""."""
    known = [v for v in values if v is not None]
    return f", saves {sum(known):.1f} us" if known else ""


def _describe_skipped(scope: str, skipped: Skipped) -> LeftAlone:
    return LeftAlone("conv", _where(skipped.conv.eqn), scope, skipped.reason)


def _op_label(op: PlanOp) -> str:
    if op.letter == "S":
        return "residual add" if op.steps[0].op != "sub" else "residual subtract"
    if op.letter == "A":
        return op.steps[0].label
    kinds = [s.op for s in op.steps]
    if op.letter == "B":
        return "bias add"
    if kinds[0] in ("add", "sub") and any(k in ("mul", "div") for k in kinds):
        return "batch norm"
    if any(k in ("mul", "div") for k in kinds):
        return "scale/shift"
    return "shift" if "neg" not in kinds else "negate/shift"


def _where(eqn: JaxprEqn) -> str:
    """The module path (flax's name stack) and the innermost source lines outside flax and
    jaxfuse: one line under a name stack, else the line and its caller (helpers are common)."""
    stack = str(eqn.source_info.name_stack)
    frames = siu.summarize(eqn.source_info, num_frames=32).split("\n")  # outermost first
    libraries = [os.path.dirname(__file__)]
    if "flax" in sys.modules:
        libraries.append(os.path.dirname(sys.modules["flax"].__file__))
    user = [f for f in frames if not any(f.startswith(d) for d in libraries)]
    shown = [_short(f) for f in user[-1 if stack else -2:] if f]
    # (no line of the user's: the traced function is itself the equation, as a function
    # wrapped whole in shard_map or jit is)
    where = " > ".join(shown) if shown else "the traced function as a whole"
    return f"{stack} ({where})" if stack else where


def _short(frame: str) -> str:
    path, _, rest = frame.partition(":")
    return f"{os.path.basename(path)}:{rest}" if rest else frame
