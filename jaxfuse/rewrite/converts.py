"""Batching the float conversions that only the fused calls read, into one op per scope.

Flax keeps parameters in ``param_dtype`` (float32) and computes in ``dtype`` (bfloat16), so
every convolution converts its filter on every call: in a fused ResNet-50, 53 XLA kernels next
to the 53 fused ones, each costing the host a launch (about 8.5 us on an H100 at batch 1) for
almost no device work. This module picks those conversions out of a scope and replaces them
with one :func:`jaxfuse.convert.convert_many`, which a GPU runs as one kernel.

A conversion is batched when

- it is a top-level ``convert_element_type`` between two of float32, float16 and bfloat16
  (not weakly typed, no sharding of its own);
- a fused call reads its result as an operand in the plan's dtype: the convolution's filter or
  input, or the residual added (what :func:`jaxfuse.rewrite.lowering.emit` reads as it is);
- nothing else needs the converted copy: every use of it is inside a chain that is fused
  (chains left to XLA, in auto mode or with ``solver="xla"``, keep their conversions exactly as
  the program wrote them), and the scope does not return it;
- its source exists where the batch is emitted: the batch goes just before the first fused
  call that reads one of its results, so a source must be a scope input or constant, or be
  computed before that point (see :func:`plan_convert_batch`).

A scope with fewer than two such conversions is left as it is: one conversion gains nothing.
Results are bit-identical: the op converts exactly as XLA does.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..convert import CONVERTIBLE
from .graph import Graph, Value
from .matcher import Group

__all__ = ["ConvertBatch", "plan_convert_batch"]

_MIN_BATCH = 2


@dataclasses.dataclass(frozen=True)
class ConvertBatch:
    """Conversions replaced by one op: `values[i]` is `sources[i]` converted to `dtypes[i]`.

    `eqns` are the top-level ``convert_element_type`` equations it replaces; it is emitted
    just before top-level equation `emit_at` is evaluated.
    """

    values: tuple[Value, ...]
    sources: tuple[Value, ...]
    dtypes: tuple[np.dtype, ...]
    eqns: frozenset[int]
    emit_at: int


@dataclasses.dataclass(frozen=True)
class _Candidate:
    value: Value
    source: Value
    eqn: int
    ready: int  # the source exists once top-level equation `ready` is evaluated (-1: always)
    first_use: int  # the first fused call that needs the value is emitted at this equation


def plan_convert_batch(g: Graph, groups: list[Group]) -> ConvertBatch | None:
    """The conversions of the scope `g` that its fused `groups` alone read, as one batch
    (None when fewer than two qualify). See the module docstring for the rules."""
    if not groups:
        return None
    consumed = {top: group for group in groups for top in group.tops}
    outputs = {id(group.out): group for group in groups}
    read = {}
    for group in groups:
        for value in _operands_read(group):
            read[id(value)] = value
    candidates = []
    for value in read.values():
        candidate = _candidate(g, value, consumed, outputs)
        if candidate is not None:
            candidates.append(candidate)
    # Emitted just before the first fused call of the batch: the point that takes the most.
    best: list[_Candidate] = []
    emit_at = -1
    for at in sorted({c.first_use for c in candidates}):
        members = [c for c in candidates if c.ready < at <= c.first_use]
        if len(members) > len(best):
            best, emit_at = members, at
    if len(best) < _MIN_BATCH:
        return None
    best.sort(key=lambda c: c.eqn)  # program order
    return ConvertBatch(tuple(c.value for c in best), tuple(c.source for c in best),
                        tuple(c.value.dtype for c in best), frozenset(c.eqn for c in best),
                        emit_at)


def _operands_read(group: Group) -> list[Value]:
    """The values the fused call for `group` reads as they are (lowering.emit): the
    convolution's input and filter, and the residual operand, when they are in the plan's
    dtype (otherwise the call converts them again, and XLA would rather fuse both steps)."""
    values = [group.conv.inputs[0], group.filter_value]
    values += [op.steps[0].operand.value for op in group.plan_ops if op.letter == "S"]
    values = [v for v in values if v.dtype == group.info.dtype]
    return values


def _candidate(g: Graph, value: Value, consumed: dict[int, Group],
               outputs: dict[int, Group]) -> _Candidate | None:
    node = value.producer
    if node is None or node.name != "convert_element_type" or \
            g.jaxpr.eqns[node.top] is not node.eqn:  # inside a wrapped call: not replaceable
        return None
    params = node.params
    if params.get("weak_type") or params.get("sharding") is not None:
        return None
    source = node.inputs[0]
    if source.dtype not in CONVERTIBLE or value.dtype not in CONVERTIBLE or \
            source.dtype == value.dtype:
        return None
    if value.is_output or not value.users:
        return None
    users = [consumed.get(user.top) for user in value.users]
    if any(group is None for group in users):  # an unfused operation needs the copy
        return None
    ready = _ready(g, source, consumed, outputs)
    if ready is None:
        return None
    first_use = min(group.emit_at for group in users)
    return _Candidate(value, source, node.top, ready, first_use)


def _ready(g: Graph, source: Value, consumed: dict[int, Group],
           outputs: dict[int, Group]) -> int | None:
    """The top-level equation after which `source` exists in the scope (-1: from the start),
    or None when the rewritten scope never holds it as a value of its own."""
    if source.literal is not None:
        return None  # a scalar written in the program: nothing worth batching
    if source.const is not None:
        return -1
    if not source.top_vars:
        return None  # a value inside a wrapped call
    scope_inputs = {*g.jaxpr.invars, *g.jaxpr.constvars}
    if any(var in scope_inputs for var in source.top_vars):
        return -1
    top = source.producer.top
    if top in consumed:  # computed by a fused call: exists once that call is emitted
        group = outputs.get(id(source))
        return None if group is None else group.emit_at
    return top
