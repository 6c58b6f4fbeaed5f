"""FusionPlan: a vertical chain of operators built from an input descriptor, compiled once."""

from __future__ import annotations

import itertools
import weakref
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from . import support
from .activations import ActivationMode, activation_mode
from .args import OperatorArgs
from .compiled import CompiledPlan, compile_signature
from .descriptors import ConvDesc, TensorDesc
from .errors import FusionError, UnsupportedFusionError
from .ops import (
    ActivationForwardOp,
    BatchNormInferenceOp,
    BiasForwardOp,
    ConvForwardOp,
    FusionOp,
    SideInputAddOp,
    batchnorm_mode,
)
from .signature import SCALARS, PlanSignature

__all__ = ["FusionPlan"]

_plan_ids = itertools.count(1)
_Op = TypeVar("_Op", bound=FusionOp)


class FusionPlan:
    """A chain of fused operators on one input tensor (MIOpen's vertical fusion plan).

    >>> import jaxfuse as jf
    >>> plan = jf.FusionPlan(jf.TensorDesc((1, 8, 16, 16), "float32"))
    >>> conv = plan.add_conv_forward(jf.ConvDesc(padding="SAME"),
    ...                              jf.TensorDesc((16, 8, 3, 3), "float32", "OIHW"))
    >>> act = plan.add_activation_forward("relu")
    >>> plan.compile().output_desc.shape
    (1, 16, 16, 16)
    """

    def __init__(self, input_desc: TensorDesc):
        support.check_input(input_desc)
        self._input_desc = input_desc
        self._ops: list[FusionOp] = []
        self._conv_spec = None
        self._id = next(_plan_ids)
        self._version = 0
        self._compiled: CompiledPlan | None = None
        self._compiled_version = -1

    # ----- building ---------------------------------------------------------------------------
    @property
    def input_desc(self) -> TensorDesc:
        return self._input_desc

    @property
    def ops(self) -> tuple[FusionOp, ...]:
        return tuple(self._ops)

    def add_conv_forward(self, conv: ConvDesc, filter_desc: TensorDesc) -> ConvForwardOp:
        """Adds a convolution; it must be the plan's first operator."""
        support.check_append(self._ops, "C")
        self._conv_spec = support.check_conv(self._input_desc, conv, filter_desc)
        return self._append(ConvForwardOp, conv, filter_desc)

    def add_bias_forward(self, bias_desc: TensorDesc) -> BiasForwardOp:
        """Adds a per-channel bias; `bias_desc` has shape ``(K,)`` for K output channels."""
        support.check_append(self._ops, "B")
        if not isinstance(bias_desc, TensorDesc):
            raise TypeError(f"add_bias_forward needs a TensorDesc, got {type(bias_desc).__name__}")
        channels = self._current_channels()
        if bias_desc.shape != (channels,):
            raise FusionError(f"bias descriptor has shape {bias_desc.shape}; the operator "
                              f"before it has {channels} channels, so it must be ({channels},)")
        return self._append(BiasForwardOp, bias_desc)

    def add_batchnorm_inference(self, mode: str = "spatial") -> BatchNormInferenceOp:
        """Adds batch-norm inference in "spatial" or "per_activation" mode."""
        support.check_append(self._ops, "N")
        return self._append(BatchNormInferenceOp, batchnorm_mode(mode))

    def add_side_input_add(self) -> SideInputAddOp:
        """Adds ``y + alpha * z`` for a side input z of the output's shape (a residual add)."""
        support.check_append(self._ops, "S")
        # (no operator after it changes the output's shape: only an activation may follow)
        return self._append(SideInputAddOp, self.output_desc if self._ops else self._input_desc)

    def add_activation_forward(self, mode: str | ActivationMode) -> ActivationForwardOp:
        """Adds an activation (see :class:`jaxfuse.ActivationMode`)."""
        support.check_append(self._ops, "A")
        return self._append(ActivationForwardOp, activation_mode(mode))

    def _append(self, kind: type[_Op], *fields: Any) -> _Op:
        op = kind(self._id, len(self._ops), *fields, owner=weakref.ref(self))
        self._ops.append(op)
        self._version += 1
        return op

    @property
    def version(self) -> int:
        """Bumped by every change to the plan (an added operator)."""
        return self._version

    def _current_channels(self) -> int:
        if self._conv_spec is not None:
            return self._conv_spec.out_channels
        return self._input_desc.dim("C")

    # ----- compiling --------------------------------------------------------------------------
    @property
    def signature(self) -> PlanSignature:
        """The static description of this plan (what kernels are specialized on)."""
        if not self._ops:
            raise UnsupportedFusionError(
                "the plan has no operators; add at least one before compiling")
        d = self._input_desc
        bn = next((op.mode for op in self._ops if isinstance(op, BatchNormInferenceOp)), None)
        act = next((op.mode for op in self._ops if isinstance(op, ActivationForwardOp)), None)
        return PlanSignature(
            dtype=d.dtype, layout=d.layout, batch=d.dim("N"), channels=d.dim("C"),
            height=d.dim("H"), width=d.dim("W"), ops="".join(op.letter for op in self._ops),
            conv=self._conv_spec, bn_mode=bn, activation=act)

    def compile(self, device: Any = None, *, solver: str | None = None) -> FusionPlan:
        """Validates the plan and compiles it for `device`: a ``jax.Device``, a platform name
        (``"cpu"``, ``"gpu"``: that platform's first device) or None (the default backend's
        first).

        `solver` chooses what runs the plan: ``"auto"`` times jaxfuse's fused kernel and XLA's
        unfused composition on the device and keeps the faster (a candidate that fails is
        dropped, so the plan always runs); ``"fused"`` insists on jaxfuse's kernel (raising
        if it cannot be built); ``"xla"`` runs the unfused composition. Default:
        ``$JAXFUSE_SOLVER``, else ``"auto"``. The choice is memoized in memory and on disk.

        Compiling an identical plan again, from this or another FusionPlan, is a cache hit.
        Returns the plan, so ``plan.compile().execute(x, args)`` reads naturally.
        """
        self._compiled = compile_signature(self.signature, device, solver)
        self._compiled_version = self._version
        return self

    @property
    def solver(self) -> str | None:
        """What runs the compiled plan: ``"xla"`` (XLA's unfused composition), the CPU kernel
        (``"cpu"``, or ``"cpu_direct"`` for geometries whose padded copy would dwarf the
        tensors), or the GPU kernel (``"conv_wgmma"``, ``"conv_igemm"``, ``"pointwise"``, ...);
        None before ``compile()``."""
        return self._compiled.kernel if self.is_compiled else None

    @property
    def kernel_info(self) -> dict[str, Any]:
        """What runs the compiled plan and why: ``solver`` (as :attr:`solver`), the ``mode``,
        how it was ``decided`` ("measured", "disk cache", "forced" by the mode, or "fallback"
        to XLA when no fused kernel can be built), the measured ``candidates_us`` (on GPUs
        also split into ``candidates_device_us`` and ``candidates_host_us``, the launch work)
        and why any candidate ``failed``; on GPUs the fused kernel's ``tile``, autotuned
        ``variant``, ``arch`` and binary ``origin``, and ``filters`` where the kernel reads
        the filters in another layout, transposed into it on each call (fp32 on Hopper), or
        ``input_layout`` where it reads the input so (NCHW on Hopper: an NHWC kernel that
        writes NCHW). Empty before ``compile()``."""
        if not self.is_compiled:
            return {}
        return self._compiled.info()

    @property
    def is_compiled(self) -> bool:
        return self._compiled is not None and self._compiled_version == self._version

    @property
    def output_desc(self) -> TensorDesc:
        """The result's descriptor, inferred from the input descriptor and the operators."""
        sig = self.signature
        return TensorDesc(sig.output_shape, sig.dtype, sig.out_layout)

    # ----- executing --------------------------------------------------------------------------
    def execute(self, x: Any, args: OperatorArgs) -> jax.Array:
        """Runs the compiled plan on `x` with `args`; works eagerly and under ``jax.jit``."""
        if self._compiled is None:
            raise FusionError("the plan is not compiled; call plan.compile() before execute()")
        if self._compiled_version != self._version:
            raise FusionError("the plan's operators changed since compile(); call compile() "
                              "again before execute()")
        if not isinstance(args, OperatorArgs):
            raise TypeError(f"execute needs an OperatorArgs, got {type(args).__name__}")
        _check_input(x, self._input_desc)
        params, scalars = self._collect(args)
        return self._compiled.execute(x, *params, _pack_scalars(scalars))

    def _collect(self, args: OperatorArgs) -> tuple[list[Any], dict[str, Any]]:
        params: list[Any] = []
        scalars: dict[str, Any] = {}
        for op in self._ops:
            entry = args.entry(op)
            if entry is None:
                setter = {"C": "set_conv_forward", "B": "set_bias_forward",
                          "N": "set_batchnorm_inference", "S": "set_side_input_add",
                          "A": "set_activation_forward"}[op.letter]
                missing = f"no arguments for the {op.kind} operator (operator {op.index})"
                if foreign := args.foreign_entry(op):  # a mistake, even for an activation
                    raise ValueError(f"{missing}: the arguments in its place were set with "
                                     f"{foreign}; call args.{setter}() with this plan's handle")
                if isinstance(op, ActivationForwardOp):
                    entry = OperatorArgs().set_activation_forward(op).entry(op)
                else:
                    raise ValueError(f"{missing}; call args.{setter}() first")
            params += list(entry.arrays)
            scalars.update(entry.scalars)
        return params, scalars

    def __repr__(self) -> str:
        ops = "".join(op.letter for op in self._ops) or "empty"
        state = "compiled" if self.is_compiled else "not compiled"
        return f"FusionPlan({self._input_desc.shape} {self._input_desc.layout}, {ops}, {state})"


def _check_input(x: Any, desc: TensorDesc) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"x must be an array, got {type(x).__name__}")
    if tuple(x.shape) != desc.shape:
        raise ValueError(f"x has shape {tuple(x.shape)}, but the plan's input descriptor is "
                         f"{desc.shape} ({desc.layout})")
    if np.dtype(x.dtype) != desc.dtype:
        raise TypeError(f"x has dtype {np.dtype(x.dtype).name}, but the plan's input descriptor "
                        f"is {desc.dtype.name}")


def _pack_scalars(values: dict[str, Any]) -> Any:
    """The float32 scalars operand; a host array when every value is concrete."""
    defaults = {"conv_alpha": 1.0, "side_alpha": 1.0}
    row = [values.get(name, defaults.get(name, 0.0)) for name in SCALARS]
    if all(isinstance(v, (int, float, np.number, np.ndarray)) for v in row):
        return np.asarray(row, np.float32)
    return jnp.stack([jnp.asarray(v, jnp.float32).reshape(()) for v in row])
