"""Operator handles returned by ``FusionPlan.add_*``: what each operator of a plan is."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .activations import ActivationMode
from .descriptors import ConvDesc, TensorDesc

__all__ = [
    "BN_MODES",
    "ActivationForwardOp",
    "BatchNormInferenceOp",
    "BiasForwardOp",
    "ConvForwardOp",
    "FusionOp",
    "SideInputAddOp",
    "batchnorm_mode",
]

BN_MODES = ("spatial", "per_activation")
_BN_ALIASES = {"peractivation": "per_activation", "miopenbnspatial": "spatial",
               "miopenbnperactivation": "per_activation"}


def batchnorm_mode(mode: str) -> str:
    """Parses a batch-norm mode name ("spatial" or "per_activation")."""
    if not isinstance(mode, str):
        raise TypeError(f"batch-norm mode must be a string, got {mode!r}")
    key = mode.strip().lower().replace("-", "_")
    key = _BN_ALIASES.get(key.replace("_", ""), key)
    if key not in BN_MODES:
        raise ValueError(f"unknown batch-norm mode {mode!r}; expected 'spatial' or "
                         "'per_activation'")
    return key


@dataclasses.dataclass(frozen=True, eq=False)
class FusionOp:
    """An operator of one plan. Handles compare by identity and are tied to their plan."""

    plan_id: int
    index: int
    # A weak reference to the plan (a handle does not keep its plan alive), for plan_version.
    owner: Callable[[], Any] | None = dataclasses.field(default=None, kw_only=True, repr=False)

    letter = "?"
    kind = "operator"

    @property
    def plan_version(self) -> int | None:
        """The version of the plan this operator belongs to, which every change to the plan
        bumps (None once the plan is gone). Arguments set for the operator carry it in their
        pytree structure, so ``jax.jit`` traces again, and refuses, after the plan changed."""
        plan = None if self.owner is None else self.owner()
        return None if plan is None else plan.version

    # A handle is an identity: copies are the handle itself; pickling drops the weak reference
    # (which cannot be pickled), so an unpickled handle has no plan_version.
    def __copy__(self) -> FusionOp:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> FusionOp:
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {name: value for name, value in self.__dict__.items() if name != "owner"}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(index={self.index})"


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ConvForwardOp(FusionOp):
    """Convolution forward: ``y = alpha * conv(x, w)``."""

    conv: ConvDesc
    filter: TensorDesc
    letter = "C"
    kind = "convolution"


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class BiasForwardOp(FusionOp):
    """Per-output-channel bias: ``y = y + b[c]``."""

    desc: TensorDesc
    letter = "B"
    kind = "bias"


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class BatchNormInferenceOp(FusionOp):
    """Batch-norm inference: ``y = scale * (y - mean) / sqrt(var + eps) + shift``."""

    mode: str
    letter = "N"
    kind = "batchnorm"


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class SideInputAddOp(FusionOp):
    """Residual add of a side input of the output's shape: ``y = y + alpha * z``."""

    desc: TensorDesc  # the side input's: the plan's output (shape, dtype, layout)
    letter = "S"
    kind = "side_add"


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ActivationForwardOp(FusionOp):
    """Activation ``y = f(y; alpha, beta, gamma)`` (see :mod:`jaxfuse.activations`)."""

    mode: ActivationMode
    letter = "A"
    kind = "activation"
