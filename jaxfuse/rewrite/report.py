"""``jaxfuse.fusion_report``: what :func:`jaxfuse.fuse` fuses in a function, and what it leaves.

>>> report = jaxfuse.fusion_report(model.apply, variables, x)        # doctest: +SKIP
>>> print(report)                                                   # doctest: +SKIP
>>> [g.plan for g in report.fused]                                  # doctest: +SKIP
['CBNA', 'CNSA', ...]
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend import source_info_util as siu
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from ..primitive import fused_chain_p
from .fuse import Rewriter, StaticArgs, recording, trace
from .lowering import build_plan
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
    """

    ops: tuple[str, ...]
    plan: str
    kernel: str
    where: str
    scope: str
    stopped: str | None


@dataclasses.dataclass(frozen=True)
class LeftAlone:
    """A convolution (or a nested body) left unfused, and why."""

    op: str
    where: str
    scope: str
    reason: str


@dataclasses.dataclass(frozen=True)
class FusionReport:
    """The fused groups and the chains left alone, with the rewritten program."""

    fused: tuple[FusedGroup, ...]
    left_alone: tuple[LeftAlone, ...]
    jaxpr: ClosedJaxpr

    @property
    def fused_calls(self) -> int:
        """How many fused calls the rewritten program has: a body counts once per equation
        that holds it (a scan body once, not once per iteration)."""
        return count_fused_calls(self.jaxpr)

    def __iter__(self) -> Iterator[FusedGroup]:
        return iter(self.fused)

    def __len__(self) -> int:
        return len(self.fused)

    def summary(self) -> str:
        """A few lines: how many chains of each kind were fused, and every chain left alone."""
        kinds: dict[tuple[str, tuple[str, ...]], int] = {}
        for g in self.fused:
            kinds[(g.plan, g.ops)] = kinds.get((g.plan, g.ops), 0) + 1
        lines = [f"jaxfuse: {len(self.fused)} chain(s) fused, {len(self.left_alone)} left alone"]
        for (plan, ops), n in sorted(kinds.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {n:4d} x {plan:<6} {' -> '.join(ops)}")
        for s in self.left_alone:
            lines.append(f"  left  {s.op} at {s.where}: {s.reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        lines = [f"jaxfuse: {len(self.fused)} chain(s) fused, {len(self.left_alone)} left alone"]
        for g in self.fused:
            scope = f" [in {g.scope}]" if g.scope else ""
            lines.append(f"  fused {g.plan:<6} {' -> '.join(g.ops)}")
            lines.append(f"        at {g.where}{scope}  ({g.kernel})")
            if g.stopped:
                lines.append(f"        stops: {g.stopped}")
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
    target, statics = getattr(fn, "__jaxfuse_fuse__", (fn, StaticArgs((), ())))
    closed, _, flat = trace(target, statics, example_args, example_kwargs)
    with recording() as recorder:
        rewriter = Rewriter(recorder)
        new = jax.make_jaxpr(
            lambda *a: rewriter.evaluate(closed.jaxpr, closed.consts, a))(*flat)
    fused: list[FusedGroup] = []
    left: list[LeftAlone] = []
    for scope, groups, skipped in recorder.scopes:
        fused += [_describe_group(scope, g) for g in groups]
        left += [_describe_skipped(scope, s) for s in skipped]
    left += [LeftAlone(eqn.primitive.name, _where(eqn), scope, note)
             for scope, eqn, note in recorder.notes]
    return FusionReport(tuple(fused), tuple(left), new)


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


def _describe_group(scope: str, group: Group) -> FusedGroup:
    plan, _ = build_plan(group.info, group.plan_ops)
    ops = ["conv"] + [_op_label(op) for op in group.plan_ops]
    return FusedGroup(tuple(ops), group.letters, plan.signature.describe(),
                      _where(group.conv.eqn), scope, group.stop)


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
    user = [f for f in frames if not any(f.startswith(d) for d in libraries)] or frames[-1:]
    shown = [_short(f) for f in user[-1 if stack else -2:] if f]
    where = " > ".join(shown) if shown else "unknown source line"
    return f"{stack} ({where})" if stack else where


def _short(frame: str) -> str:
    path, _, rest = frame.partition(":")
    return f"{os.path.basename(path)}:{rest}" if rest else frame
