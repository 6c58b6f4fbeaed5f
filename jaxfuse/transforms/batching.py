"""vmap of the fused chain, without a loop wherever the kernel can absorb the vmapped axis.

Three strategies, picked from which operands are batched:

1. Only the input and/or the side input: fold the vmapped axis into the batch dimension N and
   run one fused kernel on a plan with a B times larger batch.
2. Filters or per-channel parameters (bias, batch-norm): fold the vmapped axis into the
   channels. Example b's channels become channel group b of one plan with B times the channels,
   and the convolution becomes grouped (``groups * B``), so each example only sees its own
   filters. Unbatched operands are broadcast first.
3. The runtime scalars (conv alpha, epsilon, activation parameters, side alpha): one kernel can
   only take one set, so the fused call runs once per example under ``lax.map``. So does case 2
   when a channel axis is sharded in its type (``Explicit`` mesh axes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..signature import PlanSignature

__all__ = ["batching_rule"]

Bind = Callable[..., jax.Array]  # bind(signature, *operands) -> output
BatchingRule = Callable[..., tuple[jax.Array, int]]

# Operands that only carry the batch dimension N (everything else is per-channel or scalar).
_PER_EXAMPLE = frozenset({"x", "side"})


def batching_rule(bind: Bind) -> BatchingRule:
    """A ``batching.primitive_batchers`` rule for the primitive that `bind` binds."""

    def rule(args: Sequence[Any], dims: Sequence[int | None], *,
             signature: PlanSignature) -> tuple[jax.Array, int]:
        names = [spec.name for spec in signature.operands]
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        if size == 0:  # nothing to compute (and folding into channels would make 0 groups)
            return jnp.zeros((0, *signature.output_shape), signature.dtype), 0
        # Vmapped axis first on every batched operand; unbatched ones keep their shape.
        moved = {name: (a if d is None else jnp.moveaxis(a, d, 0), d is not None)
                 for name, a, d in zip(names, args, dims)}
        batched = {name for name, (_, is_batched) in moved.items() if is_batched}
        if batched <= _PER_EXAMPLE:
            return _fold_into_batch(bind, signature, moved, size), 0
        if "scalars" not in batched and not _channels_sharded(signature, moved):
            return _fold_into_channels(bind, signature, moved, size), 0
        return _map_over_examples(bind, signature, moved), 0

    return rule


def _broadcast(value: tuple[Any, bool], size: int) -> Any:
    array, is_batched = value
    array = jnp.asarray(array)
    return array if is_batched else jnp.broadcast_to(array, (size, *array.shape))


def _sharded_in_type(array: Any, axis: int) -> bool:
    """Whether `axis` is sharded in `array`'s type (meshes with Explicit axes)."""
    spec = getattr(getattr(jax.typeof(array), "sharding", None), "spec", ())
    return axis < len(spec) and spec[axis] is not None


def _fold_into_batch(bind: Bind, sig: PlanSignature, moved: dict[str, tuple[Any, bool]],
                     size: int) -> jax.Array:
    # Examples become the major part of the new batch, unless the batch dimension is sharded
    # in its type: then it stays major so that the merge keeps each shard's rows together.
    batch_major = any(_sharded_in_type(moved[name][0], 1 if moved[name][1] else 0)
                      for name in _PER_EXAMPLE if name in moved)
    operands = []
    for name, value in moved.items():
        array = value[0]
        if name in _PER_EXAMPLE:
            array = _broadcast(value, size)
            if batch_major:
                array = jnp.swapaxes(array, 0, 1)
            array = array.reshape(size * sig.batch, *array.shape[2:])
        operands.append(array)
    out = bind(dataclasses.replace(sig, batch=size * sig.batch), *operands)
    if batch_major:
        return jnp.swapaxes(out.reshape(sig.batch, size, *sig.output_shape[1:]), 0, 1)
    return out.reshape(size, *sig.output_shape)


def _channels_sharded(sig: PlanSignature, moved: dict[str, tuple[Any, bool]]) -> bool:
    """Whether an operand's channel axis is sharded in its type; folding examples into it as
    the major part would then interleave shards."""
    for name, (array, is_batched) in moved.items():
        axis = _channel_axis(sig, name)
        if axis is not None and _sharded_in_type(array, axis + int(is_batched)):
            return True
    return False


def _channel_axis(sig: PlanSignature, name: str) -> int | None:
    """The channel axis of an (unbatched) operand; None for the scalars."""
    if name in ("x", "side"):
        return 1 if (sig.layout if name == "x" else sig.out_layout) == "NCHW" else 3
    if name == "w":
        return {"OIHW": 0, "HWIO": 3, "OHWI": 0}[sig.conv.filter_layout]
    if name == "scalars":
        return None
    if name != "bias" and sig.bn_mode == "per_activation":  # batch-norm (K,H,W) or (H,W,K)
        return 0 if sig.out_layout == "NCHW" else 2
    return 0  # bias and spatial batch-norm parameters: (K,)


def _merge_channels(array: Any, axis: int) -> Any:
    """(B, ...) -> the unbatched shape with B folded into `axis` as its major part."""
    array = jnp.moveaxis(array, 0, axis)
    shape = array.shape
    return array.reshape(*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2:])


def _split_channels(array: Any, axis: int, size: int) -> Any:
    """Inverse of :func:`_merge_channels`: (..., B*K, ...) -> (B, ..., K, ...)."""
    shape = array.shape
    array = array.reshape(*shape[:axis], size, shape[axis] // size, *shape[axis + 1:])
    return jnp.moveaxis(array, axis, 0)


def _fold_into_channels(bind: Bind, sig: PlanSignature, moved: dict[str, tuple[Any, bool]],
                        size: int) -> jax.Array:
    operands = []
    for name, value in moved.items():
        axis = _channel_axis(sig, name)
        operands.append(value[0] if axis is None else _merge_channels(_broadcast(value, size),
                                                                      axis))
    wide = dataclasses.replace(sig, channels=size * sig.channels)
    if sig.conv is not None:
        conv = dataclasses.replace(sig.conv, out_channels=size * sig.conv.out_channels,
                                   groups=size * sig.conv.groups)
        wide = dataclasses.replace(wide, conv=conv)
    # (the output's channel axis is the side input's: both are in the output's layout)
    return _split_channels(bind(wide, *operands), _channel_axis(sig, "side"), size)


def _map_over_examples(bind: Bind, sig: PlanSignature,
                       moved: dict[str, tuple[Any, bool]]) -> jax.Array:
    names = list(moved)
    batched = {name: a for name, (a, is_batched) in moved.items() if is_batched}

    def one(example: dict[str, Any]) -> jax.Array:
        return bind(sig, *(example[n] if n in example else moved[n][0] for n in names))

    return lax.map(one, batched)
