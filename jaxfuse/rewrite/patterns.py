"""Recognizers for the pointwise steps that may follow a convolution.

A step is matched as a small expression template over the flat view (:mod:`.graph`), anchored at
the chain's current value ``x``. Templates cover the forms real code produces: a per-channel bias
or scale written with any broadcast, the subtract/multiply/add sequence batch norm is written as
(by hand, by ``flax.linen.BatchNorm`` and ``flax.nnx.BatchNorm``), a residual add, casts, and the
activations of ``jax.nn`` / ``jax.numpy`` as they appear after jit and custom-JVP wrappers are
expanded. Activations map onto the plan's activation modes; a form is matched only where it
gives NaN and infinities what the mode gives (so ``where(x > 0, x, 0)``, which turns NaN into
0, is not relu).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..activations import GELU_CUBIC, GELU_SCALE, ActivationMode
from .graph import Graph, Node, Value

__all__ = ["Operand", "Step", "candidate_steps"]

Binding = dict[str, Value]
Match = tuple[Binding, frozenset[Node]]


# ----- a tiny template language -----------------------------------------------------------------
class Pattern:
    """Matches one value; yields every (binding, nodes used) way it can."""

    def matches(self, g: Graph, value: Value, b: Binding) -> Iterator[Match]:
        raise NotImplementedError

    def roots(self) -> frozenset[str] | None:
        """The primitives that can produce a matching value (None: any value may match)."""
        return None


class _Chain(Pattern):
    """The chain's current value."""

    def matches(self, g: Graph, value: Value, b: Binding) -> Iterator[Match]:
        if value is b["x"]:
            yield b, frozenset()


class _Param(Pattern):
    """Any value other than the chain's (a bias, a slope, a clip bound...), bound to `name`."""

    def __init__(self, name: str):
        self.name = name

    def matches(self, g: Graph, value: Value, b: Binding) -> Iterator[Match]:
        if value is b["x"]:
            return
        bound = b.get(self.name)
        if bound is None:
            yield {**b, self.name: value}, frozenset()
        elif bound is value:
            yield b, frozenset()


class _Const(Pattern):
    """A trace-time constant whose elements all equal one number satisfying `test`."""

    def __init__(self, test: Callable[[float], bool]):
        self.test = test

    def matches(self, g: Graph, value: Value, b: Binding) -> Iterator[Match]:
        c = g.uniform_constant(value)
        if c is not None and self.test(c):
            yield b, frozenset()


class _Op(Pattern):
    """The single-output primitive `name` applied to operands matching `args`."""

    def __init__(self, name: str, *args: Pattern, commutative: bool = False):
        self.name = name
        self.args = args
        self.commutative = commutative

    def matches(self, g: Graph, value: Value, b: Binding) -> Iterator[Match]:
        node = value.producer
        if node is None or node.name != self.name or len(node.outputs) != 1:
            return
        if len(node.inputs) != len(self.args):
            return
        orders = [node.inputs]
        if self.commutative:
            orders.append(node.inputs[::-1])
        for inputs in orders:
            yield from self._match_args(g, list(zip(self.args, inputs)), b, frozenset({node}))

    def roots(self) -> frozenset[str] | None:
        return frozenset({self.name})

    def _match_args(self, g: Graph, pairs: list[tuple[Pattern, Value]], b: Binding,
                    nodes: frozenset[Node]) -> Iterator[Match]:
        if not pairs:
            yield b, nodes
            return
        (pattern, value), rest = pairs[0], pairs[1:]
        for b2, used in pattern.matches(g, value, b):
            yield from self._match_args(g, rest, b2, nodes | used)


class _OpWith(_Op):
    """`name` with equation parameters `params` (``integer_pow`` with ``y=3``)."""

    def __init__(self, name: str, params: dict[str, Any], *args: Pattern):
        super().__init__(name, *args)
        self.params = params

    def matches(self, g: Graph, value: Value, b: Binding) -> Iterator[Match]:
        node = value.producer
        if node is not None and all(node.params.get(k) == v for k, v in self.params.items()):
            yield from super().matches(g, value, b)


class _Rounded(Pattern):
    """A constant equal to `number` rounded to the constant's dtype, as code writes an
    irrational constant (jax.nn.gelu's sqrt(2 / pi) is 0.796875 in bfloat16)."""

    def __init__(self, number: float):
        self.number = number

    def matches(self, g: Graph, value: Value, b: Binding) -> Iterator[Match]:
        if not jnp.issubdtype(value.dtype, jnp.floating):
            return
        c = g.uniform_constant(value)
        # Rounded directly, or through float32 first.
        if c is not None and c in {float(np.asarray(n, value.dtype))
                                   for n in (self.number, np.float32(self.number))}:
            yield b, frozenset()


class _OneOf(Pattern):
    def __init__(self, *options: Pattern):
        self.options = options

    def matches(self, g: Graph, value: Value, b: Binding) -> Iterator[Match]:
        for option in self.options:
            yield from option.matches(g, value, b)

    def roots(self) -> frozenset[str] | None:
        roots = [option.roots() for option in self.options]
        return None if None in roots else frozenset().union(*roots)


def op(name: str, *args: Pattern) -> Pattern:
    return _Op(name, *args)


def comm(name: str, a: Pattern, b: Pattern) -> Pattern:
    return _Op(name, a, b, commutative=True)


def one_of(*options: Pattern) -> Pattern:
    return _OneOf(*options)


X = _Chain()
ZERO = _Const(lambda c: c == 0.0)
ONE = _Const(lambda c: c == 1.0)
HALF = _Const(lambda c: c == 0.5)
TWO = _Const(lambda c: c == 2.0)
THREE = _Const(lambda c: c == 3.0)
SIX = _Const(lambda c: c == 6.0)


def _is_positive(x: Pattern) -> Pattern:
    """A predicate true where x > 0 (or x >= 0: every activation below agrees at 0)."""
    return one_of(op("gt", x, ZERO), op("ge", x, ZERO), op("lt", ZERO, x), op("le", ZERO, x))


def _is_negative(x: Pattern) -> Pattern:
    return one_of(op("lt", x, ZERO), op("le", x, ZERO), op("gt", ZERO, x), op("ge", ZERO, x))


def _where_positive(x: Pattern, positive: Pattern, negative: Pattern,
                    nan_takes: str | None = None) -> Pattern:
    """``jnp.where(x > 0, positive, negative)``; select_n picks its cases by the predicate.

    Every comparison with NaN is false, so a NaN x takes `negative` in the ``x > 0`` forms and
    `positive` in the ``x < 0`` forms. `nan_takes` ("positive" or "negative") keeps only the
    forms that give NaN the case the epilogue gives it; None keeps both (they agree on NaN).
    """
    forms = {"negative": op("select_n", _is_positive(x), negative, positive),
             "positive": op("select_n", _is_negative(x), positive, negative)}
    return forms[nan_takes] if nan_takes else one_of(*forms.values())


# ----- steps ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Operand:
    """A bias/scale operand: `value` holds `kind` = "scalar" | "channel" | "full" data."""

    value: Value
    kind: str


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """One recognized pointwise step of a chain, from value `x` to value `out`.

    kind: "affine" (op in add/sub/rsub/mul/div/neg with a per-channel or scalar operand),
    "side" (op in add/sub/rsub with a full-size operand), "activation", "cast", "nop" or
    "split" (a reshape splitting the batch dimension: see _splits_batch).
    """

    kind: str
    label: str
    nodes: frozenset[Node]
    out: Value
    op: str = ""
    operand: Operand | None = None
    mode: ActivationMode | None = None
    act_params: tuple[Value | float | None, ...] = (None, None, None)


@dataclasses.dataclass(frozen=True)
class _Template:
    label: str
    pattern: Pattern
    build: Callable[[Graph, Binding], dict[str, Any] | str]


def _activation(mode: ActivationMode, alpha: str | None = None,
                check: Callable[[Graph, Binding], str | None] | None = None
                ) -> Callable[[Graph, Binding], dict[str, Any] | str]:
    def build(g: Graph, b: Binding) -> dict[str, Any] | str:
        if check is not None and (problem := check(g, b)) is not None:
            return problem
        params: tuple[Any, ...] = (None, None, None)
        if alpha is not None:
            value = b[alpha]
            if int(np.prod(value.shape)) != 1:
                return f"the {mode.value} parameter has shape {value.shape}, not a scalar"
            params = (value, None, None)
        return {"kind": "activation", "mode": mode, "act_params": params}
    return build


def _const_between(name: str, low: float, high: float) -> Callable[[Graph, Binding], str | None]:
    def check(g: Graph, b: Binding) -> str | None:
        c = g.uniform_constant(b[name])
        if c is None or not low <= c <= high:
            return f"this form is an activation only for a constant {name} in [{low}, {high}]"
        return None
    return check


def _simple(kind: str, op_name: str = "") -> Callable[[Graph, Binding], dict[str, Any]]:
    def build(g: Graph, b: Binding) -> dict[str, Any]:
        return {"kind": kind, "op": op_name, "operand": b.get("p")}
    return build


def _cast(g: Graph, b: Binding) -> dict[str, Any] | str:
    return {"kind": "cast"}


_P = _Param("p")
# x, or x clamped <= 0: with NaN kept, or any clamp (where(x < 0, x, 0) turns NaN into 0).
_SAFE_X = one_of(X, _where_positive(X, ZERO, X, nan_takes="negative"), comm("min", X, ZERO))
_ANY_SAFE_X = one_of(_SAFE_X, _where_positive(X, ZERO, X, nan_takes="positive"))


def _expm1(safe_x: Pattern) -> Pattern:
    return one_of(op("expm1", safe_x), op("sub", op("exp", safe_x), ONE))


def _elu(negative: Callable[[Pattern], Pattern]) -> Pattern:
    """``where(x > 0, x, negative(expm1(clamped x)))``. elu's NaN is NaN: where a NaN x takes
    the negative case, the clamp must keep the NaN; where it takes x, any clamp will do."""
    return one_of(_where_positive(X, X, negative(_expm1(_SAFE_X)), nan_takes="negative"),
                  _where_positive(X, X, negative(_expm1(_ANY_SAFE_X)), nan_takes="positive"))


_DIFF = one_of(op("sub", X, ZERO), X)
_LOGADDEXP0 = comm("add", comm("max", X, ZERO), op("log1p", op("exp", op("neg", op("abs", _DIFF)))))
# softplus as jax.nn writes it (logaddexp(x, 0): NaN-guarded or not), and as people do, whose
# exp overflows: +inf from x > 88.7 in fp32 and bf16, x > 11.1 in fp16, where softrelu gives x.
_SOFTPLUS_FORMS = (
    _LOGADDEXP0,
    op("select_n", op("ne", _DIFF, _DIFF), _LOGADDEXP0, comm("add", X, ZERO)),
)
_OVERFLOWING_SOFTPLUS_FORMS = (
    op("log1p", op("exp", X)),
    op("log", comm("add", op("exp", X), ONE)),
)
_EXP_NEG_X = op("exp", op("neg", X))
_SIGMOID_FORMS = (op("logistic", X), op("div", ONE, comm("add", ONE, _EXP_NEG_X)))


def _half_x_times(f: Pattern) -> Pattern:
    """``0.5 * x * f`` in the orders code multiplies it (jax.nn.gelu: ``x * (0.5 * f)``)."""
    return one_of(comm("mul", comm("mul", HALF, X), f), comm("mul", X, comm("mul", HALF, f)),
                  comm("mul", HALF, comm("mul", X, f)), op("div", comm("mul", X, f), TWO))


# gelu: 0.5 x erfc(-x / sqrt 2) (jax.nn.gelu(approximate=False)) or 0.5 x (1 + erf(x / sqrt 2)).
_X_OVER_SQRT2 = one_of(comm("mul", X, _Rounded(np.sqrt(0.5))), op("div", X, _Rounded(np.sqrt(2))))
_GELU = _half_x_times(one_of(
    op("erfc", one_of(comm("mul", op("neg", X), _Rounded(np.sqrt(0.5))), op("neg", _X_OVER_SQRT2),
                      op("div", op("neg", X), _Rounded(np.sqrt(2))),
                      comm("mul", X, _Rounded(-np.sqrt(0.5))))),
    comm("add", ONE, op("erf", _X_OVER_SQRT2))))
# gelu_tanh: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), x^3 as jnp.power / ** or products.
_CUBE = one_of(_OpWith("integer_pow", {"y": 3}, X), comm("mul", X, comm("mul", X, X)),
               comm("mul", X, op("square", X)), comm("mul", X, _OpWith("integer_pow", {"y": 2}, X)))
_GELU_TANH = _half_x_times(comm("add", ONE, op("tanh", comm(
    "mul", _Rounded(GELU_SCALE), comm("add", X, comm("mul", _Rounded(GELU_CUBIC), _CUBE))))))
# hardsigmoid: relu6(x + 3) / 6 (jax.nn.hard_sigmoid), relu6 in any form that keeps NaN.
_X_PLUS_3 = comm("add", X, THREE)
_RELU6 = one_of(comm("min", comm("max", _X_PLUS_3, ZERO), SIX),
                comm("max", comm("min", _X_PLUS_3, SIX), ZERO), op("clamp", ZERO, _X_PLUS_3, SIX))
_SIXTH = _Rounded(1 / 6)
_HARD_SIGMOID = one_of(op("div", _RELU6, SIX), comm("mul", _RELU6, _SIXTH))
_HARD_SWISH = one_of(comm("mul", X, _HARD_SIGMOID), op("div", comm("mul", X, _RELU6), SIX),
                     comm("mul", comm("mul", X, _RELU6), _SIXTH))

_TEMPLATES: tuple[_Template, ...] = (
    # Affine and residual steps (the operand's shape decides which, in :func:`_classify`).
    _Template("add", comm("add", X, _P), _simple("affine", "add")),
    _Template("sub", op("sub", X, _P), _simple("affine", "sub")),
    _Template("sub", op("sub", _P, X), _simple("affine", "rsub")),
    _Template("mul", comm("mul", X, _P), _simple("affine", "mul")),
    _Template("div", op("div", X, _P), _simple("affine", "div")),
    _Template("neg", op("neg", X), _simple("affine", "neg")),
    _Template("cast", op("convert_element_type", X), _cast),
    _Template("copy", op("copy", X), _simple("nop")),
    _Template("reshape", op("reshape", X), _simple("nop")),
    # Activations.
    _Template("relu", comm("max", X, ZERO), _activation(ActivationMode.RELU)),
    _Template("relu", _where_positive(X, X, ZERO, nan_takes="positive"),
              _activation(ActivationMode.RELU)),
    _Template("relu", _where_positive(X, X, ZERO, nan_takes="negative"),
              lambda g, b: "where(x > 0, x, 0) turns NaN into 0 while relu keeps it "
                           "(jax.nn.relu and jnp.maximum(x, 0) fuse)"),
    _Template("clip", comm("min", comm("max", X, ZERO), _Param("hi")),
              _activation(ActivationMode.CLIPPED_RELU, "hi")),
    _Template("clip", op("clamp", ZERO, X, _Param("hi")),
              _activation(ActivationMode.CLIPPED_RELU, "hi")),
    _Template("clip", comm("max", comm("min", X, _Param("hi")), ZERO),
              _activation(ActivationMode.CLIPPED_RELU, "hi",
                          _const_between("hi", 0.0, float("inf")))),
    _Template("leaky_relu", _where_positive(X, X, comm("mul", X, _Param("alpha"))),
              _activation(ActivationMode.LEAKY_RELU, "alpha")),
    _Template("leaky_relu", comm("max", X, comm("mul", X, _Param("alpha"))),
              _activation(ActivationMode.LEAKY_RELU, "alpha", _const_between("alpha", 0.0, 1.0))),
    _Template("elu", _elu(lambda expm1: comm("mul", _Param("alpha"), expm1)),
              _activation(ActivationMode.ELU, "alpha")),
    _Template("elu", _elu(lambda expm1: expm1), _activation(ActivationMode.ELU)),
    *(_Template("sigmoid", form, _activation(ActivationMode.LOGISTIC))
      for form in _SIGMOID_FORMS),
    _Template("tanh", op("tanh", X), _activation(ActivationMode.TANH)),
    _Template("abs", op("abs", X), _activation(ActivationMode.ABS)),
    *(_Template("softplus", form, _activation(ActivationMode.SOFTRELU))
      for form in _SOFTPLUS_FORMS),
    *(_Template("softplus", form,
                lambda g, b: "log(1 + exp(x)) overflows to inf for large x, where softplus "
                             "does not (jax.nn.softplus fuses)")
      for form in _OVERFLOWING_SOFTPLUS_FORMS),
    # jax.nn's activations beyond MIOpen's. Each form gives NaN for NaN and for -inf (x * 0),
    # +inf for +inf, as the epilogue does.
    _Template("silu", one_of(*(comm("mul", X, f) for f in _SIGMOID_FORMS),
                             op("div", X, comm("add", ONE, _EXP_NEG_X))),
              _activation(ActivationMode.SILU)),
    _Template("gelu", _GELU, _activation(ActivationMode.GELU)),
    _Template("gelu_tanh", _GELU_TANH, _activation(ActivationMode.GELU_TANH)),
    _Template("hardswish", _HARD_SWISH, _activation(ActivationMode.HARDSWISH)),
    _Template("hardsigmoid", _HARD_SIGMOID, _activation(ActivationMode.HARDSIGMOID)),
    # (tanh takes an overflowed softplus to 1, as mish's epilogue takes large x to x)
    _Template("mish", comm("mul", X, op("tanh", one_of(*_SOFTPLUS_FORMS,
                                                       *_OVERFLOWING_SOFTPLUS_FORMS))),
              _activation(ActivationMode.MISH)),
)

_MAX_DEPTH = 10  # the largest template spans this many nodes from x to its result
# Each template's possible root primitives: a node of any other kind is not tried against it.
_ROOTS = tuple(template.pattern.roots() for template in _TEMPLATES)


def _downstream(x: Value) -> list[Node]:
    """Nodes reachable from x within a template's reach, nearest first."""
    seen: dict[Node, None] = {}
    frontier = [x]
    for _ in range(_MAX_DEPTH):
        nxt = []
        for value in frontier:
            for node in value.users:
                if node not in seen:
                    seen[node] = None
                    nxt += node.outputs
        frontier = nxt
    return list(seen)


def candidate_steps(g: Graph, x: Value, channel_axis: int) -> tuple[list[Step], list[str]]:
    """Every step that may continue the chain at `x`, largest first, and why others failed.

    A candidate's nodes include every user of `x`; whether its other intermediate values escape
    is checked by the matcher.
    """
    found: list[tuple[int, int, Step]] = []
    problems: list[str] = []
    for node in _downstream(x):
        if len(node.outputs) != 1:
            continue
        root = node.outputs[0]
        for order, template in enumerate(_TEMPLATES):
            if _ROOTS[order] is not None and node.name not in _ROOTS[order]:
                continue
            for binding, nodes in template.pattern.matches(g, root, {"x": x}):
                if not all(user in nodes for user in x.users):
                    continue
                built = template.build(g, binding)
                if isinstance(built, str):
                    problems.append(f"{template.label}: {built}")
                    continue
                step = _classify(g, x, root, nodes, template.label, built, channel_axis)
                if isinstance(step, str):
                    problems.append(step)
                    continue
                found.append((-len(nodes), order, step))
    found.sort(key=lambda item: item[:2])
    return [step for _, _, step in found], problems


def _classify(g: Graph, x: Value, out: Value, nodes: frozenset[Node], label: str,
              built: dict[str, Any], axis: int) -> Step | str:
    """Turns a template match into a Step, checking shapes and dtypes."""
    if label == "reshape" and out.shape != x.shape and _splits_batch(x, out):
        return Step("split", "batch split", nodes, out)
    if out.shape != x.shape:
        return f"`{label}` changes the shape {x.shape} -> {out.shape}"
    if not jnp.issubdtype(out.dtype, jnp.floating):
        return f"`{label}` produces {out.dtype.name} values"
    kind = built["kind"]
    if label == "reshape" and out.producer.params.get("dimensions") is not None:
        return "`reshape` with `dimensions` transposes its operand"
    if kind == "nop" or kind == "cast":
        return Step(kind, label, nodes, out)
    if kind == "activation":
        return Step(kind, built["mode"].value, nodes, out, mode=built["mode"],
                    act_params=built["act_params"])
    operand = built.get("operand")
    if operand is None:  # neg
        return Step("affine", label, nodes, out, op=built["op"])
    shape_kind, source = _operand_kind(operand, x.shape, axis)
    if shape_kind == "full":
        if built["op"] not in ("add", "sub", "rsub"):
            return (f"`{label}` by an operand of shape {operand.shape} that varies beyond the "
                    "channel axis (only per-channel scales fuse)")
        return Step("side", "residual add", nodes, out, op=built["op"],
                    operand=Operand(source, "full"))
    if shape_kind is None:
        return f"`{label}` operand of shape {operand.shape} does not broadcast to {x.shape}"
    return Step("affine", label, nodes, out, op=built["op"],
                operand=Operand(source, shape_kind))


def _splits_batch(x: Value, out: Value) -> bool:
    """Whether `out` is `x` with its batch dimensions split further, as ``jax.vmap`` of a
    convolution leaves it: the mapped axis folded into the batch for the convolution, then
    split off again (the rest of the chain follows on the split shape). The last
    :data:`_IMAGE_DIMS` dimensions are one image's; the ones before them are the batch."""
    params = out.producer.params
    if params.get("dimensions") is not None or params.get("sharding") is not None:
        return False  # (a transpose, or a resharding the fused call would drop)
    image = _IMAGE_DIMS
    return (len(out.shape) > len(x.shape) and out.shape[-image:] == x.shape[-image:]
            and math.prod(out.shape[:-image]) == math.prod(x.shape[:-image]))


# A 2-D convolution's image: (C, H, W) or (H, W, C).
_IMAGE_DIMS = 3


def _operand_kind(p: Value, shape: tuple[int, ...], axis: int) -> tuple[str | None, Value]:
    """Whether `p` is a scalar, a per-channel vector, or full-size, and the value to read."""
    if not jnp.issubdtype(p.dtype, jnp.floating) and not jnp.issubdtype(p.dtype, jnp.integer):
        return None, p
    ps = p.shape
    if int(np.prod(ps)) == 1 and len(ps) <= len(shape):
        return "scalar", p
    if len(ps) == len(shape) and all(d == 1 or i == axis for i, d in enumerate(ps)):
        return ("channel" if ps[axis] == shape[axis] else None), p
    node = p.producer
    if ps == shape and node is not None and node.name == "broadcast_in_dim":
        source = node.inputs[0]
        dims = node.params["broadcast_dimensions"]
        if all(d == 1 or dims[j] == axis for j, d in enumerate(source.shape)):
            size = int(np.prod(source.shape))
            if size == 1:
                return "scalar", source
            if size == shape[axis]:
                return "channel", source
    if len(ps) == len(shape) and all(d in (1, s) for d, s in zip(ps, shape)):
        return "full", p
    if len(ps) < len(shape) and all(d in (1, s) for d, s in zip(ps, shape[-len(ps):])):
        return "full", p
    return None, p
