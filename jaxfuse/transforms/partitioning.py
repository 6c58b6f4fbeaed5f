"""Sharding of the fused chain under ``jax.jit``: every device runs the fused kernel on its shard.

XLA cannot look inside the custom call, so on its own it would gather every operand onto each
device. A ``jax.experimental.custom_partitioning`` rule tells it instead which dimensions the
chain is independent along: the batch N; the output channels K of a convolution (sharding the
filters' output dimension with their bias and batch-norm parameters); the groups of a grouped
convolution (input and output channels together); and every dimension of a chain without a
convolution, which is pointwise. Each shard runs the fused kernel on a plan signature of the
shard's shape, so batch- or channel-sharded operands produce equally sharded results with no
collectives. The contracted input channels and the spatial dimensions of a convolution (which
would need halos) are replicated.

The rule is chosen at lowering time: programs for one device, inside a fully manual
``shard_map``, or lowered for ``jax.export`` (whose artifacts cannot carry an in-process
partitioning callback) call the FFI target directly.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    CompoundFactor,
    SdyShardingRule,
    custom_partitioning,
)
from jax.interpreters import mlir
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._extension import FFI_TARGET
from ..signature import PlanSignature

__all__ = ["chain_factors", "partitioned_lowering", "require_devices_at_lowering",
           "shard_signature", "spans_devices", "typed_output_sharding"]

LoweringRule = Callable[..., Sequence[Any]]


# ----- the per-shard computation ----------------------------------------------------------------
def _ffi_call(signature: PlanSignature, *operands: Any) -> jax.Array:
    """The fused kernel on operands of `signature`'s shapes (one shard, or the whole array)."""
    result = jax.ShapeDtypeStruct(signature.output_shape, signature.dtype)
    # (The plain target: sharded programs are not given the record stage's registration,
    # which would tie their lowering to this process's CUDA backend.)
    return jax.ffi.ffi_call(FFI_TARGET, result)(*operands, plan=signature.encode())


# ----- which factor each dimension of each operand carries ---------------------------------------
Dim = str | tuple[str, str]  # one factor, or a compound (major, minor) such as ("g", "ko")


@dataclasses.dataclass(frozen=True)
class _Factors:
    """The chain's dimensions as sharding-rule factors (one factor or compound per dim)."""

    operands: tuple[tuple[Dim, ...], ...]  # per operand, per dim
    result: tuple[Dim, ...]
    shardable: tuple[str, ...]  # factors a shard may split
    sizes: dict[str, int]  # every shardable factor's size, and compound factors' parts

    def rule(self) -> SdyShardingRule:
        """The Shardy sharding rule: everything not shardable needs replication."""
        values = (*self.operands, self.result)
        # Shardy wants special factors in the order the factors first appear.
        names = dict.fromkeys(part for dims in values for d in dims for part in _parts(d))
        replicated = tuple(n for n in names if n not in self.shardable)
        # Sizes are given exactly for the factors that never form a whole dimension.
        whole = {d for dims in values for d in dims if isinstance(d, str)}
        sizes = {n: self.sizes[n] for n in names if n not in whole}

        def mapping(dims: tuple[Dim, ...]) -> ArrayMapping:
            return ArrayMapping(*(d if isinstance(d, str) else CompoundFactor(*d) for d in dims))

        return SdyShardingRule(tuple(map(mapping, self.operands)), (mapping(self.result),),
                               need_replication_factors=replicated, **sizes)


def _parts(dim: Dim) -> tuple[str, ...]:
    return (dim,) if isinstance(dim, str) else dim


def _major(dim: Dim) -> str:
    """The factor that shards a dimension: itself, or the major part of a compound."""
    return _parts(dim)[0]


def chain_factors(sig: PlanSignature) -> _Factors:
    """How each dimension of the chain's operands and result may be sharded."""
    conv = sig.conv
    k = sig.output_chw[0]
    if conv is None:  # pointwise: every dimension passes through
        c_in = c_out = c_filter = "c"
        spatial_in = spatial_out = ("h", "w")
        shardable = ("n", "c", "h", "w")
        sizes = {"n": sig.batch, "c": sig.channels, "h": sig.height, "w": sig.width}
    elif conv.groups == 1:  # input channels are contracted; output channels shard
        c_in, c_out, c_filter = "c", "k", "c"
        spatial_in, spatial_out = ("h", "w"), ("oh", "ow")
        shardable = ("n", "k")
        sizes = {"n": sig.batch, "k": k}
    else:  # whole groups shard, input and output channels together
        per_group_in, per_group_out = sig.channels // conv.groups, k // conv.groups
        # Shardy rejects size-1 parts of a compound dimension (depthwise: one channel a group).
        c_in = ("g", "ci") if per_group_in > 1 else "g"
        c_out = ("g", "ko") if per_group_out > 1 else "g"
        c_filter = "ci"
        spatial_in, spatial_out = ("h", "w"), ("oh", "ow")
        shardable = ("n", "g")
        sizes = {"n": sig.batch, "g": conv.groups, "ci": per_group_in, "ko": per_group_out}

    def image(c: Dim, spatial: tuple[str, str], layout: str) -> tuple[Dim, ...]:
        return ("n", c, *spatial) if layout == "NCHW" else ("n", *spatial, c)

    per_sample = (c_out, *spatial_out) if sig.out_layout == "NCHW" else (*spatial_out, c_out)
    by_name: dict[str, tuple[Dim, ...]] = {
        "x": image(c_in, spatial_in, sig.layout),
        "bias": (c_out,),
        "side": image(c_out, spatial_out, sig.out_layout),
        "scalars": ("z",),
    }
    if conv is not None:
        by_name["w"] = {"OIHW": (c_out, c_filter, "r", "s"), "HWIO": ("r", "s", c_filter, c_out),
                        "OHWI": (c_out, "r", "s", c_filter)}[conv.filter_layout]
    bn = per_sample if sig.bn_mode == "per_activation" else (c_out,)
    by_name.update(dict.fromkeys(("scale", "shift", "mean", "var"), bn))
    return _Factors(tuple(by_name[spec.name] for spec in sig.operands),
                    image(c_out, spatial_out, sig.out_layout), shardable, sizes)


def shard_signature(sig: PlanSignature, shards: dict[str, int]) -> PlanSignature:
    """The signature of one shard, given how many shards each factor is split into."""
    def div(size: int, factor: str) -> int:
        return size // shards.get(factor, 1)

    sig = dataclasses.replace(sig, batch=div(sig.batch, "n"))
    if sig.conv is None:
        return dataclasses.replace(sig, channels=div(sig.channels, "c"),
                                   height=div(sig.height, "h"), width=div(sig.width, "w"))
    if sig.conv.groups == 1:
        return dataclasses.replace(sig, conv=dataclasses.replace(
            sig.conv, out_channels=div(sig.conv.out_channels, "k")))
    conv = dataclasses.replace(sig.conv, out_channels=div(sig.conv.out_channels, "g"),
                               groups=div(sig.conv.groups, "g"))
    return dataclasses.replace(sig, channels=div(sig.channels, "g"), conv=conv)


# ----- choosing mesh axes for the factors --------------------------------------------------------
def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _choose_axes(factors: _Factors, mesh_shape: Mapping[str, int],
                 operand_shardings: Sequence[Any],
                 result_sharding: Any = None) -> dict[str, tuple[str, ...]]:
    """Mesh axes per shardable factor: the operands' first (then the result's), when they
    divide the factor evenly and no other factor uses them already."""
    chosen: dict[str, tuple[str, ...]] = {}
    used: set[str] = set()
    placed = [*zip(factors.operands, operand_shardings), (factors.result, result_sharding)]
    for dims, sharding in placed:
        if not isinstance(sharding, NamedSharding):
            continue
        spec = tuple(sharding.spec) + (None,) * (len(dims) - len(sharding.spec))
        for dim, entry in zip(dims, spec):
            factor, axes = _major(dim), _axes(entry)
            if factor not in factors.shardable or factor in chosen or not axes:
                continue
            count = math.prod(mesh_shape[a] for a in axes)
            if used.isdisjoint(axes) and factors.sizes[factor] % count == 0:
                chosen[factor] = axes
                used.update(axes)
    return chosen


def _spec(dims: tuple[Dim, ...], chosen: dict[str, tuple[str, ...]]) -> PartitionSpec:
    entries = []
    for dim in dims:
        axes = chosen.get(_major(dim), ())
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)


def _shardings(sig: PlanSignature, mesh: Mesh, arg_shapes: Sequence[Any],
               result_shape: Any) -> tuple[PlanSignature, Any, tuple[Any, ...]]:
    """The per-shard signature, result sharding and operand shardings the partitioner uses."""
    factors = chain_factors(sig)
    if mesh.empty:  # shardings without mesh axes: replicate (correct, if not fast)
        devices = sorted(result_shape.sharding.device_set, key=lambda d: d.id)
        mesh, chosen = Mesh(np.asarray(devices), ("replica",)), {}
    else:
        chosen = _choose_axes(factors, mesh.shape, [a.sharding for a in arg_shapes],
                              result_shape.sharding)
    shards = {f: math.prod(mesh.shape[a] for a in axes) for f, axes in chosen.items()}
    operands = tuple(NamedSharding(mesh, _spec(dims, chosen)) for dims in factors.operands)
    return shard_signature(sig, shards), NamedSharding(mesh, _spec(factors.result, chosen)), \
        operands


def typed_output_sharding(sig: PlanSignature, avals: Sequence[Any]) -> NamedSharding | None:
    """The result's sharding type when operands carry shardings in their types (meshes with
    ``Explicit`` axes): the same choice the partitioner makes. None outside any mesh."""
    shardings = [getattr(a, "sharding", None) for a in avals]
    mesh = next((s.mesh for s in shardings if isinstance(s, NamedSharding) and not s.mesh.empty),
                None)
    if mesh is None:
        return None
    factors = chain_factors(sig)
    return NamedSharding(mesh, _spec(factors.result, _choose_axes(factors, mesh.shape,
                                                                  shardings)))


# ----- the custom_partitioning callbacks ----------------------------------------------------------
def _partition(sig: PlanSignature, mesh: Mesh, arg_shapes: Sequence[Any],
               result_shape: Any) -> tuple[Mesh, Callable[..., jax.Array], Any, tuple[Any, ...]]:
    shard_sig, result_sharding, operand_shardings = _shardings(sig, mesh, arg_shapes,
                                                               result_shape)
    return (result_sharding.mesh, functools.partial(_ffi_call, shard_sig), result_sharding,
            operand_shardings)


def _infer_sharding_from_operands(sig: PlanSignature, mesh: Mesh, arg_shapes: Sequence[Any],
                                  result_shape: Any) -> Any:
    # Used by the GSPMD partitioner (jax_use_shardy_partitioner=False) in place of the rule.
    return _shardings(sig, mesh, arg_shapes, result_shape)[1]


def _sharding_rule(sig: PlanSignature, mesh: Mesh, operand_types: Any,
                   result_types: Any) -> SdyShardingRule:
    return chain_factors(sig).rule()


_sharded_chain = custom_partitioning(_ffi_call, static_argnums=(0,))
_sharded_chain.def_partition(partition=_partition,
                             infer_sharding_from_operands=_infer_sharding_from_operands,
                             sharding_rule=_sharding_rule)


# ----- choosing the lowering ---------------------------------------------------------------------
def spans_devices(ctx: mlir.LoweringRuleContext) -> bool:
    """True when the program being lowered is partitioned over more than one device.

    The axis context has no public type; its two kinds are told apart by their attributes
    (jit's sharding context has ``device_assignment``, shard_map's ``mesh``/``manual_axes``).
    """
    context = ctx.module_context.axis_context
    mesh, manual = getattr(context, "mesh", None), getattr(context, "manual_axes", None)
    if mesh is not None and manual is not None:
        return mesh.size > 1 and set(manual) != set(mesh.axis_names)
    devices = getattr(context, "device_assignment", None)
    return devices is not None and len(devices) > 1


def _for_export(ctx: mlir.LoweringRuleContext) -> bool:
    params = getattr(ctx.module_context, "lowering_parameters", None)
    return bool(getattr(params, "for_export", False))


def partitioned_lowering(direct: LoweringRule) -> LoweringRule:
    """A lowering rule that adds the partitioning rule to `direct` (the plain FFI lowering)
    when the program spans several devices and is not being exported."""

    def lowering(ctx: mlir.LoweringRuleContext, *args: Any,
                 signature: PlanSignature) -> Sequence[Any]:
        if _for_export(ctx) or not spans_devices(ctx):
            return direct(ctx, *args, signature=signature)
        sharded = functools.partial(_sharded_chain, signature)
        return mlir.lower_fun(sharded, multiple_results=False)(ctx, *args)

    return lowering


def require_devices_at_lowering(primitive: Any) -> None:
    """Makes ``jax.jit`` pass the device assignment when lowering programs with `primitive`.

    jit lowers without devices unless a primitive asks for them; custom_partitioning needs
    them, but only appears inside this primitive's lowering, where jit does not look. There is
    no public switch, so this uses jax's internal registry; without it the lowering simply
    takes the direct path (still correct, but XLA then gathers the operands).
    """
    try:
        from jax._src import dispatch  # no public equivalent (jax 0.10/0.11)

        dispatch.prim_requires_devices_during_lowering.add(primitive)
    except (ImportError, AttributeError):  # pragma: no cover - a jax without the registry
        pass
