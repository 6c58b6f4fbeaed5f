"""Grows a fusable chain from each convolution of a jaxpr scope.

From a top-level ``conv_general_dilated`` the chain takes one recognized step at a time
(:mod:`.patterns`) while every intermediate value is used only by the next step. The longest
prefix that maps onto one fusion plan (at most one bias, batch-norm, side-input add and
activation operator, ending on a value the scope can see) becomes a :class:`Group`; a
convolution with no such prefix is reported with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..descriptors import SUPPORTED_DTYPES, ConvDesc, TensorDesc
from ..errors import FusionError
from .graph import Graph, Node, Value, call_name
from .patterns import Operand, Step, candidate_steps

__all__ = ["POINTWISE", "ConvInfo", "Group", "Skipped", "find_groups"]

# Elementwise primitives: a chain that stops before one of these may be missing a form.
POINTWISE = frozenset({
    "abs", "add", "clamp", "convert_element_type", "cos", "div", "eq", "erf", "erf_inv", "exp",
    "exp2", "expm1", "ge", "gt", "integer_pow", "is_finite", "le", "log", "log1p", "logistic",
    "lt", "max", "min", "mul", "ne", "neg", "pow", "rsqrt", "select_n", "sign", "sin", "sqrt",
    "square", "sub", "tan", "tanh"})

# Steps that compute nothing the plan needs an operator for.
_PASSIVE = frozenset({"cast", "nop", "split"})

_DATA_LAYOUTS = {(0, 1, 2, 3): "NCHW", (0, 3, 1, 2): "NHWC"}
_FILTER_LAYOUTS = {(0, 1, 2, 3): "OIHW", (3, 2, 0, 1): "HWIO", (0, 3, 1, 2): "OHWI"}


@dataclasses.dataclass(frozen=True)
class ConvInfo:
    """A convolution equation restated as plan descriptors."""

    x_desc: TensorDesc
    w_desc: TensorDesc
    conv: ConvDesc
    filter_perm: tuple[int, ...] | None  # transposes an unusual filter layout to OIHW
    channel_axis: int

    @property
    def dtype(self) -> np.dtype:
        return self.x_desc.dtype


@dataclasses.dataclass(frozen=True)
class PlanOp:
    """One plan operator and the steps it implements."""

    letter: str
    steps: tuple[Step, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Group:
    """A convolution and the steps fused with it into one plan."""

    conv: Node
    info: ConvInfo
    steps: tuple[Step, ...]
    plan_ops: tuple[PlanOp, ...]
    out: Value
    tops: frozenset[int]  # the top-level equations the fused call replaces
    stop: str | None  # why the chain ends where it does
    # The float32 value the call reads as its filter where the convolution's filter is its
    # conversion (rewrite/filters.py); None: the convolution's own filter operand.
    filter_source: Value | None = None

    @property
    def filter_value(self) -> Value:
        """The value the fused call reads as its filter."""
        return self.conv.inputs[1] if self.filter_source is None else self.filter_source

    @property
    def letters(self) -> str:
        return "C" + "".join(op.letter for op in self.plan_ops)

    @property
    def emit_at(self) -> int:
        return max(self.tops)


@dataclasses.dataclass(frozen=True, eq=False)
class Skipped:
    """A convolution left alone, and why."""

    conv: Node
    reason: str


def find_groups(g: Graph, build_plan: Any) -> tuple[list[Group], list[Skipped]]:
    """Every fusable chain of the scope's top-level convolutions.

    `build_plan(info, plan_ops)` builds and compiles the plan (raising FusionError when jaxfuse
    cannot run it), so a group is only returned when it will execute.
    """
    groups: list[Group] = []
    skipped: list[Skipped] = []
    claimed: set[int] = set()
    for node in g.nodes:
        if node.name != "conv_general_dilated" or g.jaxpr.eqns[node.top] is not node.eqn:
            continue
        info = conv_info(node)
        if isinstance(info, str):
            skipped.append(Skipped(node, info))
            continue
        steps, stop = _grow(g, node, info)
        group = _longest_prefix(g, node, info, steps, stop, build_plan, claimed)
        if isinstance(group, str):
            skipped.append(Skipped(node, group))
        else:
            claimed |= group.tops
            groups.append(group)
    return groups, skipped


# ----- the convolution ------------------------------------------------------------------------
def conv_info(node: Node) -> ConvInfo | str:
    """The convolution as plan descriptors, or why it has no fused form."""
    p = node.params
    dn = p["dimension_numbers"]
    lhs, rhs, out = (tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec))
    if len(lhs) != 4:
        return f"only 2-D convolutions fuse; this one has {len(lhs) - 2} spatial dimensions"
    if lhs != out or lhs not in _DATA_LAYOUTS:
        return (f"input/output dimension numbers {lhs}/{out} are not both NCHW or both NHWC")
    if tuple(p["lhs_dilation"]) != (1, 1):
        return f"lhs_dilation={tuple(p['lhs_dilation'])} (a transposed convolution) has no " \
               "fused form"
    if p["batch_group_count"] != 1:
        return f"batch_group_count={p['batch_group_count']} has no fused form"
    x, w = node.inputs
    dtype = node.outputs[0].dtype
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype.name} is not supported (float32, float16, bfloat16 are)"
    for name, value in (("input", x), ("filter", w)):
        if not _widens_exactly(value.dtype, dtype):
            return f"the {name} is {value.dtype.name} but the result is {dtype.name}"
    layout = _DATA_LAYOUTS[lhs]
    filter_layout = _FILTER_LAYOUTS.get(rhs)
    perm = None
    w_shape = w.shape
    if filter_layout is None:  # any other filter layout: transpose the (small) filter to OIHW
        filter_layout, perm = "OIHW", rhs
        w_shape = tuple(w.shape[i] for i in rhs)
    precision = _precision(p.get("precision"))
    try:
        conv = ConvDesc(tuple(p["window_strides"]), tuple(tuple(q) for q in p["padding"]),
                        tuple(p["rhs_dilation"]), p["feature_group_count"], precision)
        x_desc = TensorDesc(x.shape, dtype, layout)
        w_desc = TensorDesc(w_shape, dtype, filter_layout)
    except (TypeError, ValueError) as err:
        return f"its geometry has no plan descriptor: {err}"
    return ConvInfo(x_desc, w_desc, conv, perm, lhs[1])


def _widens_exactly(src: np.dtype, dst: np.dtype) -> bool:
    return src == dst or (dst == np.float32 and src in SUPPORTED_DTYPES)


def _precision(precision: Any) -> Any:
    """The equation's precision for ConvDesc: as traced, so the caller's
    ``jax_default_matmul_precision`` is already in it (a pair of lax.Precision, or a
    lax.DotAlgorithmPreset); a member left None is the default."""
    if isinstance(precision, tuple):
        return tuple("default" if v is None else v for v in precision)
    return precision


# ----- growing the chain ----------------------------------------------------------------------
def _grow(g: Graph, conv: Node, info: ConvInfo) -> tuple[list[Step], str | None]:
    steps: list[Step] = []
    x = conv.outputs[0]
    while True:
        if x.is_output and not x.users:
            return steps, None if steps else (
                "the convolution's output is returned as is (by the function, or by the "
                "jit/scan/cond body it sits in)")
        if not x.users:
            return steps, None
        if x.is_output:
            return steps, (f"{_what(steps)} is also returned (by the function, or by the body "
                           "it sits in)")
        # (after a batch split, the channel axis is as many places further on as it added)
        axis = info.channel_axis + len(x.shape) - len(info.x_desc.shape)
        candidates, problems = candidate_steps(g, x, axis)
        chosen = None
        for step in candidates:
            leak = _escape(step)
            if leak is None:
                chosen = step
                break
            problems.append(leak)
        if chosen is None:
            reason = _why_not(g, x, steps, problems)
            if steps and not all(u.name in POINTWISE for u in x.users):
                return steps, None  # a natural end: some non-pointwise op needs the value
            return steps, reason
        steps.append(chosen)
        x = chosen.out


def _what(steps: list[Step]) -> str:
    return "the convolution's output" if not steps else f"the value after `{steps[-1].label}`"


def _escape(step: Step) -> str | None:
    """Why a step's inner value must stay materialized, or None."""
    for node in step.nodes:
        for value in node.outputs:
            if value is step.out:
                continue
            outside = [u for u in value.users if u not in step.nodes]
            if value.is_output or outside:
                user = f"`{outside[0].name}`" if outside else "the function's outputs"
                return (f"`{step.label}` has an intermediate value (of `{node.name}`) also "
                        f"used by {user}")
    return None


def _why_not(g: Graph, x: Value, steps: list[Step], problems: list[str]) -> str:
    what = _what(steps)
    users = set(x.users)
    if problems:
        return problems[0]
    names = ", ".join(f"`{n}`" for n in sorted({u.name for u in users}))
    tops = {u.top for u in users}
    if len(tops) > 1:
        return f"{what} is used by {len(users)} operations ({names}), so it must stay " \
               "materialized"
    eqn = g.jaxpr.eqns[tops.pop()]
    if eqn.primitive.name not in POINTWISE:  # a single op or a wrapped call such as jit(celu)
        names = f"`{call_name(eqn)}`"
    return (f"{what} feeds {names}, which is not a recognized bias, batch norm, residual add "
            "or activation")


# ----- choosing the prefix --------------------------------------------------------------------
def _longest_prefix(g: Graph, conv: Node, info: ConvInfo, steps: list[Step], stop: str | None,
                    build_plan: Any, claimed: set[int]) -> Group | str:
    reason = stop
    longest = None  # why the whole chain cannot fuse: the reason to give if nothing does
    for k in range(len(steps), 0, -1):
        prefix = steps[:k]
        result = _as_group(g, conv, info, prefix, build_plan, claimed)
        if isinstance(result, Group):
            return dataclasses.replace(result, stop=reason)
        reason = result
        longest = longest or result
    if all(s.kind in _PASSIVE for s in steps):  # the stop says more than "only casts"
        return stop or longest or "nothing follows the convolution"
    return longest or stop or "nothing follows the convolution"


def _as_group(g: Graph, conv: Node, info: ConvInfo, prefix: list[Step], build_plan: Any,
              claimed: set[int]) -> Group | str:
    end = prefix[-1].out
    if all(s.kind in _PASSIVE for s in prefix):
        return "only casts or reshapes follow the convolution; there is nothing to fuse"
    if not end.top_vars:
        return (f"stopping after `{prefix[-1].label}` would end inside a wrapped call "
                f"(`{g.jaxpr.eqns[end.producer.top].primitive.name}`)")
    nodes = {conv}.union(*(s.nodes for s in prefix))
    tops = frozenset(n.top for n in nodes)
    if tops & claimed:  # e.g. two branches meeting in one residual add: the first takes it
        return (f"`{prefix[-1].label}` is already fused into the chain of another "
                "convolution")
    for top in tops:
        eqn = g.jaxpr.eqns[top]
        if eqn.effects:
            return f"`{eqn.primitive.name}` has side effects"
        for value in g.top_outputs[top]:
            if value is not end and value.producer not in nodes:
                return (f"`{eqn.primitive.name}` computes more than the chain; fusing it "
                        "would drop its other results")
    for step in prefix[:-1]:
        if step.kind == "cast" and step.out.dtype not in (info.dtype, np.float32):
            return (f"the chain rounds to {step.out.dtype.name} midway; the fused kernel "
                    f"computes in float32 and would skip that rounding")
    prefix = [_side_from_plan_dtype(s, info.dtype) for s in prefix]
    for step in prefix:
        if isinstance(step, str):
            return step
    plan_ops = _assign_ops(prefix)
    if isinstance(plan_ops, str):
        return plan_ops
    try:
        build_plan(info, plan_ops)
    except (FusionError, TypeError, ValueError) as err:
        return f"jaxfuse cannot run this chain: {err}"
    return Group(conv, info, tuple(prefix), plan_ops, end, tops, None)


def _side_from_plan_dtype(step: Step, dtype: np.dtype) -> Step | str:
    """A side input must be in the plan's dtype without losing precision."""
    if step.kind != "side":
        return step
    z = step.operand.value
    if _widens_exactly(z.dtype, dtype):
        return step
    node = z.producer
    if node is not None and node.name == "convert_element_type" and \
            node.inputs[0].dtype == dtype and z.shape == node.inputs[0].shape:
        return dataclasses.replace(step, operand=Operand(node.inputs[0], "full"))
    return (f"the residual operand is {z.dtype.name} but the convolution runs in "
            f"{dtype.name}; fusing would round it")


def _assign_ops(steps: list[Step]) -> tuple[PlanOp, ...] | str:
    """Maps steps onto plan operators: each run of affine steps becomes one bias (pure adds) or
    one batch-norm operator; a plan holds at most one operator of each kind."""
    ops: list[PlanOp] = []
    run: list[Step] = []
    used: set[str] = set()

    def take(letter: str, taken: list[Step]) -> str | None:
        if letter in used:
            return None
        used.add(letter)
        ops.append(PlanOp(letter, tuple(taken)))
        return letter

    def flush() -> str | None:
        if not run:
            return None
        pure_add = all(s.op in ("add", "sub") for s in run)
        # A bias added before a batch norm stays a bias operator (``+ b`` then ``- mean``).
        lead = 0
        while lead < len(run) and run[lead].op == "add":
            lead += 1
        if not pure_add and lead > 0 and not used & {"B", "N"}:
            take("B", run[:lead])
            take("N", run[lead:])
            run.clear()
            return None
        if (pure_add and take("B", run)) or take("N", run):
            run.clear()
            return None
        return (f"a further scale/shift after `{ops[-1].steps[-1].label}` would need a second "
                "batch-norm operator")

    for step in steps:
        if step.kind == "affine":
            run.append(step)
            continue
        if step.kind in _PASSIVE:
            continue
        if step.kind == "side" and step.op == "rsub":  # z - y: negate y, then add z
            run.append(Step("affine", "neg", frozenset(), step.out, op="neg"))
        if (problem := flush()) is not None:
            return problem
        letter = "S" if step.kind == "side" else "A"
        if take(letter, [step]) is None:
            what = "residual add" if letter == "S" else "activation"
            return f"a second {what} (`{step.label}`) needs a second plan operator"
    if (problem := flush()) is not None:
        return problem
    return tuple(ops)
