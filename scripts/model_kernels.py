"""Every kernel of a whole-model forward, plain ``jax.jit`` against ``jax.jit(fuse(apply))``,
with its device time per forward, and the optimized HLO of both programs (to find which XLA
fusion a kernel is).

    python scripts/model_kernels.py --model resnet50 --dtype bfloat16 --batch 64 --solver fused \
        --out /tmp/kernels

Writes <out>/plain.hlo, <out>/<solver>.hlo, <out>/kernels.txt (also printed) and
<out>/launches_<program>.txt: one forward's kernels in launch order with their durations.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax

from jaxfuse import fuse
from jaxfuse.bench.end_to_end import MODELS, model_inputs
from jaxfuse.bench.timing import device_time_per_op, traced_events


def launches(program, args) -> list[tuple[str, float]]:
    """One forward's kernels in the order they ran, with their durations in microseconds."""
    jax.block_until_ready(program(*args))
    events = traced_events(lambda: jax.block_until_ready(program(*args)))
    return [(name, duration / 1e3) for _, name, _, duration in sorted(events, key=lambda e: e[2])]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--solver", default="fused")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kernels"))
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    model, variables, x = model_inputs(opts.model, opts.dtype, opts.batch)
    variables, x = jax.device_put((variables, x))
    programs = {"plain": jax.jit(model.apply),
                opts.solver: jax.jit(fuse(model.apply, solver=opts.solver))}
    times: dict[str, dict[str, float]] = {}
    lines = []
    for name, program in programs.items():
        (opts.out / f"{name}.hlo").write_text(program.lower(variables, x).compile().as_text())
        (opts.out / f"launches_{name}.txt").write_text("\n".join(
            f"{us:9.1f}  {kernel[:100]}" for kernel, us in launches(program, (variables, x))))
        times[name] = {}
        total = device_time_per_op(jax.jit(lambda s, p=program: [p(*a) for a in s]),
                                   [(variables, x)], by_kernel=times[name])
        lines.append(f"{name}: {len(times[name])} kernels, {total * 1e6:.0f} us per forward")
    names = sorted(set(times["plain"]) | set(times[opts.solver]),
                   key=lambda k: -max(times["plain"].get(k, 0), times[opts.solver].get(k, 0)))
    lines.append(f"{'plain us':>9} {opts.solver + ' us':>9}  kernel")
    lines += [f"{times['plain'].get(k, 0) * 1e6:9.1f} {times[opts.solver].get(k, 0) * 1e6:9.1f}  "
              f"{k[:110]}" for k in names]
    text = "\n".join(lines)
    (opts.out / "kernels.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()


def per_conv(hlo: str, launches: list[tuple[str, float]]) -> list[tuple[str, str, float]]:
    """Each convolution's share of a forward: (layer path, plan, microseconds), in program
    order. A convolution is a library or jaxfuse call (cuDNN, cuBLAS, the fused chain) and owns
    the fusions after it (its epilogue) and the weight converts and transposes before it."""
    import re

    entry = hlo[hlo.index("\nENTRY"):]
    program = []  # (fusion name or None for a library call, layer path, plan)
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = .*? (fusion|custom-call)\(", line)
        if not m:
            continue
        op_name = re.search(r'op_name="([^"]+)"', line)
        layer = "/".join(p for p in (op_name.group(1).split("/")[1:-1] if op_name else [])
                         if not p.startswith("jit("))
        plan = re.search(r'plan = "([^"]+)"', line)
        if m.group(2) == "fusion":
            program.append((m.group(1).replace(".", "_"), layer, ""))
        else:
            program.append((None, layer, plan.group(1).split(";", 1)[1] if plan else ""))
    fusion_names = {name for name, _, _ in program if name}
    rows: list[list] = []
    pending, i, j = 0.0, 0, 0
    while i < len(program) and j < len(launches):
        name, layer, plan = program[i]
        if name is not None:  # one launch, by name
            k = next((k for k in range(j, len(launches)) if launches[k][0] == name), None)
            if k is None:
                i += 1
                continue
            us = sum(d for _, d in launches[j:k + 1])
            if "transpose" in name or "convert" in name:
                pending += us
            elif rows:
                rows[-1][2] += us
            j, i = k + 1, i + 1
            continue
        # A library or jaxfuse call: its launches up to the next fusion's.
        k = j
        while k < len(launches) and launches[k][0] not in fusion_names:
            k += 1
            following = program[i + 1][0] if i + 1 < len(program) else ""
            if following is None and not launches[k - 1][0].startswith(("Memset", "void nhwc")):
                break  # the next call starts right after this one's main kernel
        rows.append([layer, plan, pending + sum(d for _, d in launches[j:k])])
        pending, j, i = 0.0, k, i + 1
    return [(layer, plan, us) for layer, plan, us in rows]


def analyze(folder: Path, fused_name: str = "fused") -> str:
    """Side by side: every convolution's time in the plain and the fused program."""
    def load(name):
        text = (folder / f"launches_{name}.txt").read_text().splitlines()
        return [(line[11:].strip(), float(line[:9])) for line in text if line.strip()]

    plain = per_conv((folder / "plain.hlo").read_text(), load("plain"))
    fused = per_conv((folder / f"{fused_name}.hlo").read_text(), load(fused_name))
    lines = [f"{'plain us':>9} {'fused us':>9} {'ratio':>6}  layer / plan"]
    for (layer, _, p), (_, label, f) in zip(plain, fused):
        lines.append(f"{p:9.1f} {f:9.1f} {p / max(f, 1e-9):6.2f}  {layer}  {label}")
    lines.append(f"{sum(r[2] for r in plain):9.1f} {sum(r[2] for r in fused):9.1f}  total "
                 f"({len(plain)} / {len(fused)} convolutions)")
    return "\n".join(lines)
