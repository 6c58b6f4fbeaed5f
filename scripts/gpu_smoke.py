"""Step-by-step smoke test of the GPU backend (prints each step; for debugging on a device)."""

import faulthandler
import sys

faulthandler.enable()
import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, "tests")
from cases import Case  # noqa: E402

from jaxfuse._extension import extension  # noqa: E402

ext = extension()
dev = jax.devices("gpu")[0]
print("device", dev, dev.local_hardware_id, flush=True)
print("compiler", ext.gpu_compiler("CUDA"), flush=True)
print("name", ext.gpu_device_name("CUDA", 0), flush=True)
plan, handles = Case(ops="CBNA", dtype="float16", layout="NHWC", filter_layout="HWIO").build()
enc = plan.signature.encode()
print("compile_only", ext.gpu_compile_only("CUDA", enc, "sm_90")["solver"], flush=True)
print("prepare", ext.gpu_prepare("CUDA", enc, 0), flush=True)
plan.compile(dev)
x, args, ops = Case(ops="CBNA", dtype="float16", layout="NHWC",
                    filter_layout="HWIO").random_args(plan, handles, np.random.default_rng(0))
x, args = jax.device_put((x, args), dev)
y = jax.jit(plan.execute)(x, args)
print("executed", y.shape, float(y.astype(np.float32).mean()), flush=True)
