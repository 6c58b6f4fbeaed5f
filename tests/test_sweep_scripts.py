"""The GPU sweep's scripts, run here with a stand-in for Python: a queue item of
scripts/gpu_runs.sh runs with its own variables and names its files apart, a malformed or
unknown item is refused, a cut item's status comes back, the queues name what exists;
scripts/sweep_table.py keeps runs with variables apart; scripts/sets_probe.py runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STUB = """#!/bin/bash
echo "args: $*"
echo "form=${JAXFUSE_TF32_NCHW_FORM:-unset}"
exit ${STUB_RC:-0}
"""

if shutil.which("bash") is None or shutil.which("md5sum") is None:
    pytest.skip("needs bash and md5sum", allow_module_level=True)


def _queue_item(tmp_path: Path, item: str, **env: str) -> tuple[int, str, dict[str, str]]:
    """Runs `queue_item ITEM 60` with the stand-in; its status, output and files' texts."""
    stub = tmp_path / "stub"
    stub.write_text(env.pop("STUB_SCRIPT", STUB))
    stub.chmod(0o755)
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"  # (a folder per call)
    out.mkdir()
    script = f'source "{ROOT}/scripts/gpu_runs.sh"; queue_item "$ITEM" 60'
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          env={**os.environ, "OUT": str(out), "py": str(stub), "ITEM": item,
                               **env})
    files = {p.name: p.read_text() for p in out.iterdir()}
    return done.returncode, done.stdout, files


def test_an_item_runs_with_its_variables_and_names_its_files_apart(tmp_path) -> None:
    rc, printed, files = _queue_item(
        tmp_path, "JAXFUSE_TF32_NCHW_FORM=1,LAYER_MATCH=r50.*3x3@layers:na:float32:NCHW:1,64")
    assert rc == 0
    [(name, log)] = [(n, t) for n, t in files.items() if n.startswith("layers_")]
    assert name.startswith("layers_na_float32_NCHW_1_64_e") and name.endswith(".log")
    assert "form=1" in log and "--layers r50.*3x3" in log and "--batch 1 64" in log
    # (the exit line names the variables too)
    assert printed.startswith("JAXFUSE_TF32_NCHW_FORM=1,LAYER_MATCH=r50.*3x3@na:float32:NCHW:"
                              "1,64 exit 0")
    # The same item without variables: a file of its own name, the variable unset.
    rc, _, files = _queue_item(tmp_path, "layers:na:float32:NCHW:1,64")
    assert rc == 0 and "form=unset" in files["layers_na_float32_NCHW_1_64.log"]


def test_a_layer_item_may_name_its_layers(tmp_path) -> None:
    rc, _, files = _queue_item(tmp_path, "layers:resnet50_net:float32:NCHW:8:^r50n_(7|14)$")
    assert rc == 0
    [log] = [t for n, t in files.items() if n.startswith("layers_resnet50_net_float32_NCHW_8_m")]
    assert "--layers ^r50n_(7|14)$" in log


@pytest.mark.parametrize("item", ["JAXFUSE_TF32_NCHW_FORM@layers:na:float32:NCHW:1",
                                  "1BAD=1@layers:na:float32:NCHW:1", "bogus:x"])
def test_malformed_and_unknown_items_are_refused(tmp_path, item: str) -> None:
    rc, printed, files = _queue_item(tmp_path, item)
    assert rc == 2 and "queue item" in printed and not files


def test_a_selection_item_profiles_a_suite_in_an_empty_cache(tmp_path) -> None:
    stub = "#!/bin/bash\necho \"args: $*\"\nls -A \"$JAXFUSE_CACHE_DIR\" | wc -l\n"
    rc, printed, files = _queue_item(tmp_path, "selection:resnet50_net:float32:NCHW:256:^r50n_7",
                                     STUB_SCRIPT=stub)
    assert rc == 0 and "exit 0" in printed
    [(name, log)] = [(n, t) for n, t in files.items() if n.startswith("selection_")]
    assert name.startswith("selection_resnet50_net_float32_NCHW_256_m")
    assert ("-m jaxfuse.bench.selection --suite resnet50_net --dtype float32 --layout NCHW "
            "--batch 256 --layers ^r50n_7 --json") in log
    assert log.splitlines()[-1].strip() == "0"  # (the cache it was given was empty)


@pytest.mark.parametrize("item, log_name, command", [
    ("cold:mobilenetv2-independent:float32:8,256",  # a model's first call, cold
     "cold_mobilenetv2-independent_float32_8_256.log",
     "-m jaxfuse.bench.cold_start --model mobilenetv2-independent --dtype float32 "
     "--batch 8 256 --json"),
    ("cold:mb2_dw_7_960/NHWC:bfloat16:256",  # one layer's chain as a program
     "cold_mb2_dw_7_960-NHWC_bfloat16_256.log",
     "-m jaxfuse.bench.cold_start --model mb2_dw_7_960/NHWC --dtype bfloat16 --batch 256"),
    ("sets:mb2_dw_7_960:bfloat16:NHWC:256:1,5",  # a layer's candidates by set count
     "sets_mb2_dw_7_960_bfloat16_NHWC_256.log",
     "scripts/sets_probe.py --layer mb2_dw_7_960 --dtype bfloat16 --layout NHWC "
     "--batch 256 --sets 1 5")], ids=["cold", "cold-layer", "sets"])
def test_an_item_runs_its_command(tmp_path, item: str, log_name: str, command: str) -> None:
    rc, printed, files = _queue_item(tmp_path, item)
    assert rc == 0 and "exit 0" in printed
    assert command in files[log_name]


def test_the_sets_probe_times_both_candidates_for_each_count() -> None:
    """The probe itself, on the CPU: a row per set count, each from a process of its own."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "sets_probe.py"),
                           "--layer", "mb2_dw_7_960", "--batch", "1", "--sets", "1", "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line[:4].strip().isdigit()]
    assert [row[0] for row in rows] == ["1", "2"] and "failed" not in done.stdout


def test_a_cut_item_s_status_comes_back(tmp_path) -> None:
    rc, printed, _ = _queue_item(tmp_path, "probe:na/NA_C64_H112:float16:NHWC:1", STUB_RC="124")
    assert rc == 124 and "exit 124" in printed


@pytest.mark.parametrize("queue", sorted((ROOT / "benchmarks" / "sweeps").glob("*.queue")),
                         ids=lambda path: path.name)
def test_every_queued_item_names_what_exists(queue: Path) -> None:
    """A misspelt item costs a device call its slot: each names a kind of queue_item and
    suites, layers, models and test files that exist."""
    from jaxfuse.bench.end_to_end import MODELS
    from jaxfuse.bench.layers import SUITES

    layers = {layer.name for suite in SUITES.values() for layer in suite}
    for line in queue.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        item = line.split("@", 1)[-1]
        kind, _, rest = item.partition(":")
        fields = rest.split(":")
        if kind == "layers":  # (suites may be a comma-separated list: one process for all)
            assert all(suite in SUITES for suite in fields[0].split(",")), line
        elif kind == "selection":
            assert fields[0] in SUITES, line
        elif kind == "sets":
            assert fields[0] in layers, line
        elif kind == "probe":
            suite, _, layer = fields[0].partition("/")
            assert suite in SUITES and layer in layers, line
        elif kind == "models":
            assert fields[0] in MODELS, line
        elif kind == "cold":  # a model, or LAYER/LAYOUT
            layer, _, layout = fields[0].partition("/")
            assert fields[0] in MODELS or (layer in layers and layout in ("NCHW", "NHWC")), line
        elif kind == "tests":
            for name in fields[0].split(","):
                assert (ROOT / "tests" / f"{name}.py").is_file(), line
        else:
            pytest.fail(f"unknown kind: {line}")


def test_sweep_table_keeps_runs_with_variables_apart(tmp_path) -> None:
    row = {"suite": "na", "case": "NA_C64 N=1", "n": 1, "dtype": "float32", "layout": "NHWC",
           "auto_solver": "xla", "ratio_fused_device": 0.5, "ratio_auto_device": 0.9}
    (tmp_path / "layers_na_float32_NHWC_1.json").write_text(json.dumps({"rows": [row]}))
    (tmp_path / "layers_na_float32_NHWC_1_e1a2b3c.json").write_text(
        json.dumps({"rows": [{**row, "ratio_auto_device": 1.2}]}))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep_table.py"),
                           *map(str, sorted(tmp_path.glob("*.json")))],
                          capture_output=True, text=True, check=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("| na")]
    assert lines == ["| na | fp32 | NHWC | 1 | 0.50 (0.50) | 0.90 (0.90) |",
                     "| na | fp32 | NHWC (e1a2b3c) | 1 | 0.50 (0.50) | 1.20 (1.20) |"]
    assert "1 below 0.97" in done.stdout and "NA_C64 N=1 (xla): 0.900" in done.stdout


def test_sweep_table_lists_plans_whose_selection_passes_the_bound(tmp_path) -> None:
    """Issue #11 bounds the selection (forms timed, then the choice), not the kernel step."""
    def row(case: str, kernel: float, forms: float, choice: float) -> dict:
        return {"suite": "na", "case": case, "n": 1, "dtype": "float32", "layout": "NCHW",
                "auto_solver": "xla", "ratio_auto_device": 1.0,
                "fused_compile_s": {"kernel": kernel, "forms": forms},
                "auto_compile_s": {"kernel": 0.01, "forms": 0.0, "choice": choice}}
    rows = [row("quick", 9.0, 0.3, 0.3), row("slow", 1.5, 0.9, 1.5)]
    (tmp_path / "layers_na.json").write_text(json.dumps({"rows": rows}))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep_table.py"),
                           str(tmp_path / "layers_na.json")],
                          capture_output=True, text=True, check=True)
    assert "kernel step median 9.00 s, max 9.00 s" in done.stdout
    assert "max 2.40 s (slow), 1 of 2 above 2.0 s" in done.stdout
    assert "- slow: 2.40 s" in done.stdout and "- quick" not in done.stdout
