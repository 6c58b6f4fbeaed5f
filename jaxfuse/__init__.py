"""jaxfuse: MIOpen-style fusion plans for JAX.

Describe a vertical chain of operators (convolution, bias, batch-norm inference, side-input
add, activation) on an input descriptor, compile it once into one fused kernel per device, and
execute it any number of times with new weights and parameters, eagerly or under ``jax.jit``.
"""

from ._extension import register_targets
from .activations import ActivationMode
from .args import OperatorArgs
from .compiled import cache_info, clear_cache
from .descriptors import ConvDesc, TensorDesc
from .errors import FusionError, UnsupportedFusionError
from .functional import (
    batchnorm_activation,
    bias_activation,
    conv_batchnorm_activation,
    conv_bias_activation,
    conv_bias_batchnorm_activation,
)
from .ops import (
    ActivationForwardOp,
    BatchNormInferenceOp,
    BiasForwardOp,
    ConvForwardOp,
    SideInputAddOp,
)
from .plan import FusionPlan
from .rewrite import FusionReport, fuse, fusion_report
from .support import supported_chains
from .transforms import export_disabled_checks

__version__ = "0.1.0"

# At import, so that programs deserialized with jax.export find the handlers.
register_targets()

__all__ = [
    "ActivationForwardOp",
    "ActivationMode",
    "BatchNormInferenceOp",
    "BiasForwardOp",
    "ConvDesc",
    "ConvForwardOp",
    "FusionError",
    "FusionPlan",
    "FusionReport",
    "OperatorArgs",
    "SideInputAddOp",
    "TensorDesc",
    "UnsupportedFusionError",
    "batchnorm_activation",
    "bias_activation",
    "cache_info",
    "clear_cache",
    "conv_batchnorm_activation",
    "conv_bias_activation",
    "conv_bias_batchnorm_activation",
    "export_disabled_checks",
    "fuse",
    "fusion_report",
    "supported_chains",
]
