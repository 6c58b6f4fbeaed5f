"""Many float conversions as one op: ``convert_many(values, dtypes)``.

:func:`jaxfuse.fuse` uses it to convert the parameters of a program's fused calls (typically
every convolution's float32 filter, which Flax converts to the computation dtype on each call)
in one GPU kernel instead of one XLA kernel each: at batch 1 every launch costs the host
several microseconds, far more than converting a filter costs the device.

The op is ``lax.convert_element_type`` applied to each value, with the same results bit for
bit (round to nearest even, denormals kept, NaN and infinities as XLA converts them); it
converts between float32, float16 and bfloat16 in any direction. Lowering:

- CUDA and ROCm: the FFI custom call ``jaxfuse_convert_many`` (csrc/ffi/convert_handler.cc):
  one launch for up to 96 values (more values take more launches), command-buffer compatible;
- CPU, or a program partitioned over several devices: XLA's own converts. Launches cost the CPU
  next to nothing and XLA already vectorizes and threads its converts; a partitioned program
  converts each shard where it lives, which a custom call without a partitioning rule would not.

Transformations: jvp (the conversion is linear; tangents are converted the same way, and the
transpose converts cotangents back), vmap (elementwise: batch dimensions pass through),
``jax.export`` (with :func:`jaxfuse.export_disabled_checks`).

>>> import jax.numpy as jnp                                           # doctest: +SKIP
>>> w16, b16 = convert_many([w, b], [jnp.bfloat16, jnp.bfloat16])
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ._extension import CONVERT_TARGET
from .transforms.partitioning import require_devices_at_lowering, spans_devices

__all__ = ["CONVERTIBLE", "convert_many", "convert_many_p"]

# The dtypes the op converts between (any two different ones).
CONVERTIBLE = frozenset(np.dtype(d) for d in (jnp.float32, jnp.float16, jnp.bfloat16))

convert_many_p = Primitive("jaxfuse_convert_many")
convert_many_p.multiple_results = True


def convert_many(values: Sequence[Any], dtypes: Sequence[Any]) -> list[jax.Array]:
    """``[lax.convert_element_type(v, d) for v, d in zip(values, dtypes)]`` as one op.

    Every value must be float32, float16 or bfloat16 and every dtype one of those; a value
    already of its dtype is passed through (it takes no part in the op).
    """
    values, dtypes = list(values), [np.dtype(d) for d in dtypes]
    if len(values) != len(dtypes):
        raise ValueError(f"convert_many got {len(values)} values and {len(dtypes)} dtypes")
    arrays = [jnp.asarray(v) for v in values]
    for i, (a, d) in enumerate(zip(arrays, dtypes)):
        if np.dtype(a.dtype) not in CONVERTIBLE or d not in CONVERTIBLE:
            raise TypeError(f"convert_many converts between float32, float16 and bfloat16; "
                            f"value {i} is {np.dtype(a.dtype).name} -> {d.name}")
    todo = [i for i, (a, d) in enumerate(zip(arrays, dtypes)) if np.dtype(a.dtype) != d]
    out: list[jax.Array] = list(arrays)
    if todo:
        converted = convert_many_p.bind(*(arrays[i] for i in todo),
                                        new_dtypes=tuple(dtypes[i] for i in todo))
        for i, v in zip(todo, converted):
            out[i] = v
    return out


def _check(avals: Sequence[Any], new_dtypes: tuple[np.dtype, ...]) -> None:
    if len(avals) != len(new_dtypes):
        raise TypeError(f"convert_many takes one dtype per operand: {len(avals)} operands, "
                        f"{len(new_dtypes)} dtypes")
    for i, (a, d) in enumerate(zip(avals, new_dtypes)):
        src = np.dtype(a.dtype)
        if src not in CONVERTIBLE or np.dtype(d) not in CONVERTIBLE or src == np.dtype(d):
            raise TypeError(f"convert_many operand {i}: {src.name} -> {np.dtype(d).name} is not "
                            "a conversion between two of float32, float16 and bfloat16")


@convert_many_p.def_abstract_eval
def _abstract_eval(*avals: Any, new_dtypes: tuple[np.dtype, ...]) -> list[Any]:
    _check(avals, new_dtypes)
    return [a.update(dtype=np.dtype(d), weak_type=False) for a, d in zip(avals, new_dtypes)]


@functools.cache
def _jitted(new_dtypes: tuple[np.dtype, ...]) -> Any:
    return jax.jit(lambda *args: convert_many_p.bind(*args, new_dtypes=new_dtypes))


@convert_many_p.def_impl
def _impl(*args: Any, new_dtypes: tuple[np.dtype, ...]) -> Any:
    return _jitted(new_dtypes)(*args)


# ----- lowering ---------------------------------------------------------------------------------
def _plain(*args: Any, new_dtypes: tuple[np.dtype, ...]) -> list[Any]:
    return [lax.convert_element_type(a, d) for a, d in zip(args, new_dtypes)]


_plain_lowering = mlir.lower_fun(_plain, multiple_results=True)


def _gpu_lowering(ctx: mlir.LoweringRuleContext, *args: Any,
                  new_dtypes: tuple[np.dtype, ...]) -> Sequence[Any]:
    if spans_devices(ctx):  # XLA partitions its own converts elementwise: no gathering
        return _plain_lowering(ctx, *args, new_dtypes=new_dtypes)
    return jax.ffi.ffi_lowering(CONVERT_TARGET)(ctx, *args)


mlir.register_lowering(convert_many_p, _plain_lowering)  # the CPU and any other platform
for _platform in ("cuda", "rocm"):
    mlir.register_lowering(convert_many_p, _gpu_lowering, platform=_platform)
require_devices_at_lowering(convert_many_p)


# ----- transformations --------------------------------------------------------------------------
def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *,
         new_dtypes: tuple[np.dtype, ...]) -> tuple[list[Any], list[Any]]:
    outs = convert_many_p.bind(*primals, new_dtypes=new_dtypes)
    out_tangents: list[Any] = [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]
    live = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]
    if live:  # the conversion is linear: its tangents are converted the same way
        converted = convert_many_p.bind(*(tangents[i] for i in live),
                                        new_dtypes=tuple(new_dtypes[i] for i in live))
        for i, t in zip(live, converted):
            out_tangents[i] = t
    return outs, out_tangents


def _transpose(cotangents: Sequence[Any], *args: Any,
               new_dtypes: tuple[np.dtype, ...]) -> list[Any]:
    """Cotangents converted back to the operands' dtypes (as lax.convert_element_type's)."""
    result: list[Any] = [None] * len(args)
    live = []
    for i, (arg, ct) in enumerate(zip(args, cotangents)):
        if not ad.is_undefined_primal(arg):
            continue
        if type(ct) is ad.Zero:
            result[i] = ad.Zero(arg.aval)
        else:
            live.append(i)
    if live:
        back = convert_many_p.bind(*(cotangents[i] for i in live),
                                   new_dtypes=tuple(np.dtype(args[i].aval.dtype) for i in live))
        for i, ct in zip(live, back):
            result[i] = ct
    return result


def _batch(args: Sequence[Any], dims: Sequence[Any], *,
           new_dtypes: tuple[np.dtype, ...]) -> tuple[list[Any], list[Any]]:
    # Elementwise: each operand keeps its batch dimension, or its lack of one.
    return convert_many_p.bind(*args, new_dtypes=new_dtypes), list(dims)


ad.primitive_jvps[convert_many_p] = _jvp
ad.primitive_transposes[convert_many_p] = _transpose
batching.primitive_batchers[convert_many_p] = _batch
