"""Fused calls that read a model's float32 filters as they are (opt-in:
``JAXFUSE_WIDE_FILTERS=1``).

Flax keeps parameters in ``param_dtype`` (float32) and converts each filter to ``dtype``
(bfloat16) on every call. Batched (:mod:`.converts`), those conversions are still one pass
over every filter of the network, read in float32 and written in bfloat16: 46 us of a 380 us
ResNet-50 forward at batch 1 on an H100 (2026-11-25), where the convolutions read their
filters from memory once and reuse them over few pixels. ``conv_wgmma`` instead reads float32
filters itself and rounds them as they load (``PlanSpec::wide_filters``), so a group whose
filter is such a conversion can take the conversion's source and drop the conversion.

A group reads its filter's float32 source when

- the filter is a top-level ``convert_element_type`` from float32 to the plan's dtype that
  only fused groups read, each of which qualifies;
- the group's kernel is a Hopper one (``conv_wgmma`` or ``conv_tma``) on a float16/bfloat16
  NHWC plan with HWIO or OHWI filters, which ``conv_wgmma`` also runs with float32 filters;
- its output has at most :data:`WIDE_FILTER_MAX_PIXELS` pixels: there each filter value is
  used by few output pixels, so the conversion pass is a large share of the work; large
  outputs keep the batched conversion and the kernel autotuned for 16-bit filters (the
  warp-specialized ``conv_tma`` among them).

The wide plan runs the fused kernel (``solver="fused"``).

Off unless ``JAXFUSE_WIDE_FILTERS=1``: measured on an H200 (2026-11-26, ``python -m
jaxfuse.bench --suite resnet50 --batch 1 8 --dtype bfloat16 --filter-dtype float32`` against
the same without the flag), the wide kernel ran ResNet-50's layers at 1.2-3x the time of the
16-bit one (batch 1: 3x3/256 16.3 against 8.3 us; batch 8: 40.8 against 13.2 us), more than
the conversion it saves (about 3 us for the 3x3/512 filters). Not profiled; what differs from
the 16-bit kernel is that each stage also holds B's float32 copy, so a 64x64 tile fits once
per multiprocessor instead of three times, and that each k-tile's conversion sits between the
stage's arrival and its multiply. The whole ResNet-50 at batch 1 took 508 us of device time
against 353 us with the batched conversion.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np

from ..descriptors import TensorDesc
from ..errors import FusionError
from ..find import FUSED
from .graph import Graph, Value
from .lowering import compile_each, plan_of
from .matcher import Group

__all__ = ["WIDE_FILTER_MAX_PIXELS", "widen_filters"]

logger = logging.getLogger("jaxfuse")

WIDE_FILTER_MAX_PIXELS = 4096
_HOPPER_KERNELS = ("conv_wgmma", "conv_tma")


def widen_filters(g: Graph, groups: list[Group], solvers: dict[int, str | None]
                  ) -> tuple[list[Group], frozenset[int]]:
    """`groups` with those that qualify (see the module docstring) reading their filter's
    float32 source, and the top-level conversions no longer needed. `solvers` gives the
    solver each group's plan was compiled with (None: the rewrite's mode). The wide plans are
    compiled here, forcing the fused kernel; a conversion whose readers' wide plans do not all
    compile stays, with its readers as they were (never an error)."""
    if os.environ.get("JAXFUSE_WIDE_FILTERS") != "1":
        return groups, frozenset()
    readers: dict[int, list[Group]] = {}
    for group in groups:
        readers.setdefault(id(group.conv.inputs[1]), []).append(group)
    clusters = []  # (the conversion's equation, its readers widened)
    for users in readers.values():
        value = users[0].conv.inputs[1]
        source = _float32_source(g, value)
        if source is None or not _only_fused_users(value, users) or \
                not all(_qualifies(u, solvers.get(id(u))) for u in users):
            continue
        wide = []
        for u in users:
            desc = TensorDesc(u.info.w_desc.shape, np.float32, u.info.w_desc.layout)
            info = dataclasses.replace(u.info, w_desc=desc)
            wide.append(dataclasses.replace(u, info=info, filter_source=source))
        clusters.append((value.producer.top, users, wide))
    failed = _compile([w for _, _, wide in clusters for w in wide])
    widened: dict[int, Group] = {}
    absorbed = set()
    for top, users, wide in clusters:
        if any(id(w) in failed for w in wide):
            continue
        widened.update((id(u), w) for u, w in zip(users, wide))
        absorbed.add(top)
    return [widened.get(id(group), group) for group in groups], frozenset(absorbed)


def _compile(groups: list[Group]) -> set[int]:
    """Compiles the groups' plans forcing the fused kernel; the ids of the groups whose plan
    the backend refused (FusionError; any other error is raised)."""
    plans = {id(plan_of(group, FUSED)): plan_of(group, FUSED) for group in groups}
    failed = set()
    for key, error in zip(plans, compile_each(list(plans.values()), FUSED)):
        if error is None:
            continue
        if not isinstance(error, FusionError):
            raise error
        logger.debug("jaxfuse: float32 filters for %s: %s", plans[key].signature.describe(),
                     error)
        failed.add(key)
    return {id(group) for group in groups if id(plan_of(group, FUSED)) in failed}


def _float32_source(g: Graph, value: Value) -> Value | None:
    """The float32 value `value` is a top-level conversion of, or None."""
    node = value.producer
    if node is None or node.name != "convert_element_type" or \
            g.jaxpr.eqns[node.top] is not node.eqn:  # inside a wrapped call: not replaceable
        return None
    source = node.inputs[0]
    if source.dtype != np.float32 or source.literal is not None or value.is_output:
        return None
    if node.params.get("sharding") is not None:
        return None
    return source


def _only_fused_users(value: Value, users: list[Group]) -> bool:
    """Whether every use of `value` is the filter operand of one of `users`."""
    convs = {id(u.conv) for u in users}
    return bool(value.users) and all(id(user) in convs for user in value.users)


def _qualifies(group: Group, solver: str | None) -> bool:
    plan = plan_of(group, solver)
    sig = plan.signature
    c = sig.conv
    if c is None or sig.dtype == np.float32 or sig.layout != "NHWC" or c.filter_layout == "OIHW":
        return False
    _, p, q = sig.output_chw
    return (plan.kernel_info.get("solver") in _HOPPER_KERNELS and
            sig.batch * p * q <= WIDE_FILTER_MAX_PIXELS)
