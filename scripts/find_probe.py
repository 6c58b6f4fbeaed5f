"""What the find step measures for one benchmark layer, candidate by candidate.

    python scripts/find_probe.py --layer r50_l1_1x1_64 --batch 256 --dtype float32

Builds the layer's plan signature and times XLA's composition and the fused kernel (in the form
the find step would run: the transposed-filter form where ``solvers.kernel_filters`` picks one)
with ``measure.Harness`` as ``find._measure`` does (XLA first, the fused candidate under the
give-up limit XLA's time sets), three times each, then without the limit, and prints device
and host microseconds per run and whether a run was cut short. Then ``find.choose``'s own
decision in a fresh process-local measurement. For chains whose find-step times disagree with
the layer benchmark (ResNet-50 fp32 at batch 256 measured its 1x1 64->64 chain at 1348.6 us
fused against a 155 us kernel).

On GPUs it also prints each candidate program's kernel time from a profiler trace;
``--kernels`` lists the kernels, the layer benchmark's own XLA program's too, and ``--hlo DIR``
writes the optimized HLO of XLA's candidate and of the benchmark's program (MobileNetV2's fp16
NCHW depthwise chain at batch 64: 216 us of kernels against the benchmark's 116 us, an
activation formula that XLA fused worse than ``jax.nn.relu6``).
"""

from __future__ import annotations

import argparse

import jax

from jaxfuse import find, measure, solvers
from jaxfuse.bench.cases import BenchCase
from jaxfuse.bench.timing import batched, device_time_per_op


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layer", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layout", default="NHWC")
    parser.add_argument("--chain", default="CBNA")
    parser.add_argument("--platform", default=None)
    parser.add_argument("--hlo", default=None,
                        help="a folder for the optimized HLO of XLA's candidate and the bench's")
    parser.add_argument("--kernels", action="store_true",
                        help="list each program's kernels (GPUs), the layer benchmark's XLA too")
    a = parser.parse_args()

    case = BenchCase.for_layer(a.layer, a.batch, a.dtype, a.layout, a.chain)
    device = jax.devices(a.platform)[0] if a.platform else jax.devices()[0]
    plan, _ = case.plan(device, solver="fused")
    signature = plan.signature
    kernel = solvers.prepare_fused(signature, device)
    filters = kernel.filters
    print(f"{signature.describe()} on {device.device_kind}: kernel {plan.kernel_info}, "
          f"filter form {filters}")
    sets = measure.random_operands(signature, device, measure.set_count(signature, device))
    print(f"{len(sets)} input set(s)")
    candidates = {"xla": find.xla_function(signature),
                  "fused": solvers.fused_function(signature, filters=filters)}
    harnesses = {name: measure.Harness.compile(fn, sets, device)
                 for name, fn in candidates.items()}
    xla_cost = None
    for name, harness in harnesses.items():
        limit = None if xla_cost is None else find.give_up_limit(xla_cost)
        for label, lim in (("find", limit), ("unlimited", None)):
            for _ in range(3):
                _, t = harness.run(lim)
                print(f"  {name:5s} {label:9s} device {t.device * 1e6:9.1f} us  host "
                      f"{t.host * 1e6:8.1f} us  cut short {t.cut_short}")
        if name == "xla":
            xla_cost = harness.run()[1].cost
        if device.platform != "gpu":
            continue
        # The kernels alone, from a profiler trace.
        by_kernel: dict[str, float] = {}
        kernels = device_time_per_op(harness.run_all, harness.sets, by_kernel=by_kernel)
        print(f"  {name:5s} kernels   {kernels * 1e6:9.1f} us (profiler, outputs dropped)")
        if a.kernels:
            for kname, sec in sorted(by_kernel.items(), key=lambda kv: -kv[1]):
                print(f"      {sec * 1e6:8.1f} us  {kname[:110]}")
    if a.kernels and device.platform == "gpu":  # the layer benchmark's own XLA program
        bench_sets = case.arg_sets(2, device)
        by_kernel = {}
        many = batched(case.unfused())
        kernels = device_time_per_op(many, bench_sets, by_kernel=by_kernel)
        print(f"  bench xla kernels {kernels * 1e6:9.1f} us")
        for kname, sec in sorted(by_kernel.items(), key=lambda kv: -kv[1]):
            print(f"      {sec * 1e6:8.1f} us  {kname[:110]}")
    if a.hlo:
        import pathlib
        folder = pathlib.Path(a.hlo)
        folder.mkdir(parents=True, exist_ok=True)
        stem = f"{a.layer}_{a.dtype}_{a.batch}_{a.layout}"
        (folder / f"{stem}_find_xla.hlo").write_text(harnesses["xla"].run_all.as_text())
        bench = batched(case.unfused()).lower(case.arg_sets(2, device)).compile()
        (folder / f"{stem}_bench_xla.hlo").write_text(bench.as_text())
    decision = find._measure(signature, device, kernel)
    print(f"find: {decision.solver}  times {dict(decision.times_us)}  device "
          f"{dict(decision.device_us)}  host {dict(decision.host_us)}  failures "
          f"{dict(decision.failures)}")


if __name__ == "__main__":
    main()
