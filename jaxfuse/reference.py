"""Unfused reference compositions of a plan: float64 NumPy (for tests) and jax.numpy (for
benchmarks and as the differentiable definition of the fused op).

Both take the primitive's operands in ``signature.operands`` order: x, then filters, bias,
batch-norm scale/shift/mean/var, side input, scalars (whichever the plan has).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from .activations import jax_activation, reference_activation
from .signature import SCALARS, PlanSignature

__all__ = ["reference_float64", "unfused"]


def _split(signature: PlanSignature, operands: tuple[Any, ...]) -> dict[str, Any]:
    names = [spec.name for spec in signature.operands]
    if len(operands) != len(names):
        raise TypeError(f"expected {len(names)} operands ({', '.join(names)}), "
                        f"got {len(operands)}")
    return dict(zip(names, operands))


def _to_nchw(a: Any, layout: str) -> Any:
    return a if layout == "NCHW" else a.transpose(0, 3, 1, 2)


def _from_nchw(a: Any, layout: str) -> Any:
    return a if layout == "NCHW" else a.transpose(0, 2, 3, 1)


def _filter_to_oihw(w: Any, layout: str) -> Any:
    return {"OIHW": w, "HWIO": w.transpose(3, 2, 0, 1), "OHWI": w.transpose(0, 3, 1, 2)}[layout]


def _conv_nchw_float64(x: np.ndarray, w: np.ndarray, signature: PlanSignature) -> np.ndarray:
    c = signature.conv
    (pt, pb), (pl, pr) = c.padding
    # Negative padding crops, positive pads with zeros.
    x = x[:, :, max(-pt, 0):x.shape[2] - max(-pb, 0), max(-pl, 0):x.shape[3] - max(-pr, 0)]
    x = np.pad(x, ((0, 0), (0, 0), (max(pt, 0), max(pb, 0)), (max(pl, 0), max(pr, 0))))
    k, oh, ow = signature.output_chw
    n = x.shape[0]
    cg, kg = signature.channels // c.groups, k // c.groups
    out = np.zeros((n, k, oh, ow))
    (sh, sw), (dh, dw) = c.strides, c.dilation
    for g in range(c.groups):
        xg = x[:, g * cg:(g + 1) * cg]
        wg = w[g * kg:(g + 1) * kg]
        for r in range(c.filter_h):
            for s in range(c.filter_w):
                patch = xg[:, :, r * dh:r * dh + (oh - 1) * sh + 1:sh,
                           s * dw:s * dw + (ow - 1) * sw + 1:sw]
                out[:, g * kg:(g + 1) * kg] += np.einsum("nchw,kc->nkhw", patch, wg[:, :, r, s])
    return out


def _per_sample_to_nchw(p: Any, signature: PlanSignature, bn: bool) -> Any:
    """Broadcastable (1, C, H, W) or (1, C, 1, 1) view of a bias/batch-norm parameter."""
    if bn and signature.bn_mode == "per_activation":
        p = p if signature.out_layout == "NCHW" else p.transpose(2, 0, 1)
        return p[None]
    return p.reshape(1, -1, 1, 1)


def _epilogue(signature: PlanSignature, y: Any, ops: dict[str, Any], scalars: Any,
              xp: Any) -> Any:
    """The pointwise tail of the chain on an NCHW value `y`, with array module `xp` (NumPy, or
    jax.numpy with jax.nn's derivative conventions for the activation)."""
    s = dict(zip(SCALARS, scalars))
    for letter in signature.ops:
        if letter == "C":
            y = y * s["conv_alpha"]
        elif letter == "B":
            y = y + _per_sample_to_nchw(ops["bias"], signature, bn=False)
        elif letter == "N":
            scale, shift, mean, var = (_per_sample_to_nchw(ops[k], signature, bn=True)
                                       for k in ("scale", "shift", "mean", "var"))
            y = scale * (y - mean) / xp.sqrt(var + s["bn_epsilon"]) + shift
        elif letter == "S":
            y = y + s["side_alpha"] * _to_nchw(ops["side"], signature.out_layout)
        elif letter == "A":
            params = (s["act_alpha"], s["act_beta"], s["act_gamma"])
            y = (jax_activation(signature.activation, y, *params) if xp is jnp else
                 reference_activation(signature.activation, y, *params, xp=xp))
    return y


def _narrowed_filters(signature: PlanSignature, w: Any) -> Any:
    """The filters as the plan computes with them: float32 filters of a 16-bit plan rounded
    to its dtype (what converting them before the convolution does)."""
    if signature.filter_dtype == signature.dtype:
        return w
    return jnp.asarray(w).astype(signature.dtype)


def reference_float64(signature: PlanSignature, *operands: Any) -> np.ndarray:
    """The chain in float64 NumPy, in the plan's layout (the correctness reference)."""
    ops = _split(signature, operands)
    if signature.conv is not None:
        ops["w"] = _narrowed_filters(signature, ops["w"])
    ops = {k: np.asarray(v, np.float64) for k, v in ops.items()}
    y = _to_nchw(ops["x"], signature.layout)
    if signature.conv is not None:
        y = _conv_nchw_float64(y, _filter_to_oihw(ops["w"], signature.conv.filter_layout),
                               signature)
    y = _epilogue(signature, y, ops, ops["scalars"], np)
    return _from_nchw(y, signature.out_layout)


def unfused(signature: PlanSignature, *operands: Any, out_sharding: Any = None) -> Any:
    """The chain as separate jax.numpy ops: conv in the plan's dtype, epilogue in float32.

    `out_sharding` is the result's sharding type, needed by the conv when operands are
    sharded in their types (meshes with Explicit axes) in ways jax does not resolve alone.
    """
    ops = _split(signature, operands)
    y = ops["x"]
    if signature.conv is not None:
        c = signature.conv
        precision = None if c.allow_tf32 else lax.Precision.HIGHEST
        y = lax.conv_general_dilated(
            y, _narrowed_filters(signature, ops["w"]), c.strides, c.padding,
            rhs_dilation=c.dilation,
            dimension_numbers=(signature.layout, c.filter_layout, signature.out_layout),
            feature_group_count=c.groups, precision=precision, out_sharding=out_sharding)
    y = _to_nchw(y.astype(jnp.float32), signature.out_layout)
    params = {k: jnp.asarray(v, jnp.float32) for k, v in ops.items()
              if k not in ("x", "w", "scalars")}
    y = _epilogue(signature, y, params, ops["scalars"].astype(jnp.float32), jnp)
    return _from_nchw(y, signature.out_layout).astype(signature.dtype)
