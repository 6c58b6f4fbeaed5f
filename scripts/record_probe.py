"""Whether XLA records the fused calls through the handler's record stage: the backend's
record counters after a fused MobileNetV2's first call and after ten more with their outputs
kept alive (each then writes to new buffers).

    python scripts/record_probe.py
"""

import jax

import jaxfuse
from jaxfuse._extension import extension, record_target
from jaxfuse.bench.end_to_end import model_inputs

model, variables, x = model_inputs("mobilenet", "bfloat16", 1)
variables, x = jax.device_put((variables, x))
f = jax.jit(jaxfuse.fuse(model.apply))
jax.block_until_ready(f(variables, x))
print("target", record_target(), "after first call", extension().gpu_stats(), flush=True)
outs = [f(variables, x) for _ in range(10)]
jax.block_until_ready(outs)
print("after 10 kept calls", extension().gpu_stats(), flush=True)
