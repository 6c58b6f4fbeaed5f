"""Runtime arguments of a fusion plan's operators, as a JAX pytree.

One compiled plan runs with any number of :class:`OperatorArgs`; arguments never trigger a
recompile. Arrays and scalars are pytree leaves, so args pass through ``jax.jit``, ``grad`` and
``vmap`` like any other container.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._compat import Tracer
from .activations import DEFAULT_PARAMS
from .ops import (
    ActivationForwardOp,
    BatchNormInferenceOp,
    BiasForwardOp,
    ConvForwardOp,
    FusionOp,
    SideInputAddOp,
)

__all__ = ["OperatorArgs"]


_KINDS = {cls.letter: cls.kind for cls in (ConvForwardOp, BiasForwardOp, BatchNormInferenceOp,
                                           SideInputAddOp, ActivationForwardOp)}


@dataclasses.dataclass(frozen=True)
class _Entry:
    plan_id: int
    letter: str
    arrays: tuple[Any, ...]
    scalars: tuple[tuple[str, Any], ...]
    op: FusionOp


def _require(op: Any, cls: type[FusionOp], setter: str, adder: str) -> None:
    if not isinstance(op, cls):
        raise TypeError(f"{setter} needs the {cls.__name__} returned by FusionPlan.{adder}(), "
                        f"got {type(op).__name__}")


def _check_blend_beta(beta: Any, setter: str) -> None:
    # JAX results are fresh buffers, so there is no prior output to blend into.
    _check_scalar(f"{setter}: beta", beta)
    if not _is_concrete(beta):  # its value is unknown here, so it could not be checked
        raise TypeError(f"{setter}: beta is a traced value (under jit, vmap or grad); it must "
                        "be the concrete number 0 (JAX outputs are fresh buffers, so there is "
                        "no prior output to blend into): leave it out or pass 0")
    if float(np.asarray(beta)) != 0.0:
        raise ValueError(f"{setter}: beta={beta} is not supported (JAX outputs are fresh "
                         "buffers, so the blend factor beta must be 0)")


def _is_concrete(value: Any) -> bool:
    return not isinstance(value, Tracer)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _check_scalar(name: str, value: Any) -> None:
    """A runtime scalar travels as one float32: it must be a real number (a Python or NumPy
    scalar, or a 0-d array or tracer) that float32 can hold. NaN and infinities pass through."""
    if isinstance(value, (bool, int, float)):
        number = value
    elif hasattr(value, "shape") and hasattr(value, "dtype"):  # NumPy/jax scalars and arrays
        if tuple(value.shape) != ():
            raise ValueError(f"{name} must be a scalar, got an array of shape "
                             f"{tuple(value.shape)}")
        dtype = np.dtype(value.dtype)
        if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
                or dtype == np.bool_):
            raise TypeError(f"{name} must be a real number, got dtype {dtype.name}")
        if not _is_concrete(value):
            return
        number = np.asarray(value, np.float64).item()
    else:
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        fits = not math.isfinite(float(number)) or abs(float(number)) <= _FLOAT32_MAX
    except OverflowError:  # a Python int beyond float64
        fits = False
    if not fits:
        raise ValueError(f"{name}={value!r} does not fit in float32 (largest finite magnitude "
                         f"{_FLOAT32_MAX:.4g})")


def _check_array(name: str, value: Any, shape: tuple[int, ...], dtype: Any | None) -> None:
    if value is None:
        raise ValueError(f"{name} is missing")
    if not hasattr(value, "shape"):
        value = np.asarray(value)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    if dtype is not None and np.dtype(value.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} has dtype {np.dtype(value.dtype).name}, expected "
                        f"{np.dtype(dtype).name}")


@jax.tree_util.register_pytree_node_class
class OperatorArgs:
    """Runtime arguments for the operators of a plan, keyed by operator handle.

    >>> args = OperatorArgs()                                   # doctest: +SKIP
    >>> args.set_conv_forward(conv, w)                          # doctest: +SKIP
    >>> args.set_activation_forward(act, alpha=0.1)             # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}

    # ----- setters, one per operator kind -----------------------------------------------------
    def set_conv_forward(self, op: ConvForwardOp, w: Any, alpha: Any = 1.0,
                         beta: Any = 0.0) -> OperatorArgs:
        """Sets the filters `w` (in the filter descriptor's layout) and the scale `alpha`.

        `beta` (MIOpen's output blend factor) must be the concrete number 0; anything else,
        a traced value included, is refused.
        """
        _require(op, ConvForwardOp, "set_conv_forward", "add_conv_forward")
        _check_blend_beta(beta, "set_conv_forward")
        _check_array("set_conv_forward: w", w, op.filter.shape, op.filter.dtype)
        _check_scalar("set_conv_forward: alpha", alpha)
        return self._set(op, (w,), (("conv_alpha", alpha),))

    def set_bias_forward(self, op: BiasForwardOp, b: Any) -> OperatorArgs:
        """Sets the per-output-channel bias `b`, shape ``(K,)``."""
        _require(op, BiasForwardOp, "set_bias_forward", "add_bias_forward")
        _check_array("set_bias_forward: b", b, op.desc.shape, None)
        return self._set(op, (b,), ())

    def set_batchnorm_inference(self, op: BatchNormInferenceOp, scale: Any, shift: Any,
                                mean: Any, variance: Any, epsilon: Any = 1e-5) -> OperatorArgs:
        """Sets batch-norm scale, shift (bias), estimated mean and variance, and epsilon.

        Shapes are ``(C,)`` in "spatial" mode and the per-sample shape in the plan's layout
        (``(C, H, W)`` or ``(H, W, C)``) in "per_activation" mode.
        """
        _require(op, BatchNormInferenceOp, "set_batchnorm_inference", "add_batchnorm_inference")
        for name, value in (("scale", scale), ("shift", shift), ("mean", mean),
                            ("variance", variance)):
            if value is None:
                raise ValueError(f"set_batchnorm_inference: {name} is missing")
        _check_scalar("set_batchnorm_inference: epsilon", epsilon)
        if _is_concrete(epsilon) and not float(np.asarray(epsilon)) >= 0:
            raise ValueError(f"set_batchnorm_inference: epsilon must be >= 0, got {epsilon}")
        return self._set(op, (scale, shift, mean, variance), (("bn_epsilon", epsilon),))

    def set_side_input_add(self, op: SideInputAddOp, z: Any, alpha: Any = 1.0) -> OperatorArgs:
        """Sets the side input `z` (the output's shape and dtype), added as ``alpha * z``."""
        _require(op, SideInputAddOp, "set_side_input_add", "add_side_input_add")
        _check_array("set_side_input_add: z", z, op.desc.shape, op.desc.dtype)
        _check_scalar("set_side_input_add: alpha", alpha)
        return self._set(op, (z,), (("side_alpha", alpha),))

    def set_activation_forward(self, op: ActivationForwardOp, alpha: Any = None,
                               beta: Any = None, gamma: Any = None) -> OperatorArgs:
        """Sets the activation's alpha, beta, gamma (defaults: the mode's usual values)."""
        _require(op, ActivationForwardOp, "set_activation_forward", "add_activation_forward")
        da, db, dg = DEFAULT_PARAMS[op.mode]
        values = (("act_alpha", da if alpha is None else alpha),
                  ("act_beta", db if beta is None else beta),
                  ("act_gamma", dg if gamma is None else gamma))
        for (_, value), given in zip(values, ("alpha", "beta", "gamma")):
            _check_scalar(f"set_activation_forward: {given}", value)
        return self._set(op, (), values)

    def _set(self, op: FusionOp, arrays: tuple[Any, ...],
             scalars: tuple[tuple[str, Any], ...]) -> OperatorArgs:
        self._entries[op.index] = _Entry(op.plan_id, op.letter, arrays, scalars, op)
        return self

    # ----- reading back -----------------------------------------------------------------------
    def entry(self, op: FusionOp) -> _Entry | None:
        """The arguments set for `op` (None when unset)."""
        entry = self._entries.get(op.index)
        if entry is None or entry.plan_id != op.plan_id or entry.letter != op.letter:
            return None
        return entry

    def foreign_entry(self, op: FusionOp) -> str | None:
        """Whose handle set the arguments in `op`'s place when they are not `op`'s (e.g.
        "another plan's activation handle"); None when they are `op`'s or nothing is set."""
        entry = self._entries.get(op.index)
        if entry is None or self.entry(op) is not None:
            return None
        whose = "another plan's" if entry.plan_id != op.plan_id else "a"
        return f"{whose} {_KINDS[entry.letter]} handle"

    def __repr__(self) -> str:
        kinds = ", ".join(f"{i}:{e.letter}" for i, e in sorted(self._entries.items()))
        return f"OperatorArgs({kinds})"

    # ----- pytree protocol --------------------------------------------------------------------
    def tree_flatten(self) -> tuple[list[Any], Any]:
        # The structure names each operator and its plan's version now: a plan changed after
        # jax.jit traced it gives a new structure, so jit traces again and execute() refuses.
        leaves: list[Any] = []
        structure = []
        for index, e in sorted(self._entries.items()):
            leaves += list(e.arrays) + [v for _, v in e.scalars]
            structure.append((index, e.op, e.op.plan_version, len(e.arrays),
                              tuple(n for n, _ in e.scalars)))
        return leaves, tuple(structure)

    @classmethod
    def tree_unflatten(cls, structure: Any, leaves: Any) -> OperatorArgs:
        args = cls()
        it = iter(leaves)
        for index, op, _, n_arrays, names in structure:
            arrays = tuple(next(it) for _ in range(n_arrays))
            scalars = tuple((n, next(it)) for n in names)
            args._entries[index] = _Entry(op.plan_id, op.letter, arrays, scalars, op)
        return args
