"""The selection profiler (python -m jaxfuse.bench.selection): a plan compiled in auto mode is
broken down into the find step's own steps, in the order they ran, and everything it wrapped
is put back afterwards."""

from __future__ import annotations

import jax
import pytest

from jaxfuse import find, measure
from jaxfuse.bench.cases import BenchCase
from jaxfuse.bench.selection import describe, main, profile_case

# Each test compiles and measures its plans afresh (conftest.fresh_cache).
pytestmark = pytest.mark.usefixtures("fresh_cache")


def test_the_choice_is_broken_down_into_its_steps() -> None:
    wrapped = (find.choose, find.fastest_form, find.random_operands, find.relative_error,
               measure.Harness.run, measure.Harness.__dict__["compile"])
    case = BenchCase.for_layer("r50_l4_1x1_2048", 2, "float32", "NHWC", "CBNA")
    row = profile_case(case, jax.devices("cpu")[0])
    parts = row["choice_parts"]
    # XLA's candidate is compiled and run first, then the fused kernel's; then they are compared
    assert len(parts["compile"]) == 2 and len(parts["run"]) >= 2
    assert len(parts["sets"]) == 1 and len(parts["compare"]) == 1
    assert sum(map(sum, parts.values())) == pytest.approx(row["compile_s"]["choice"])
    assert parts["other"][0] >= 0 and "forms_parts" not in row  # (one form on a CPU)
    assert [phase for phase, _, _ in row["steps"]] == ["choice"] * len(row["steps"])
    assert "choice: sets" in describe(row)
    assert (find.choose, find.fastest_form, find.random_operands, find.relative_error,
            measure.Harness.run, measure.Harness.__dict__["compile"]) == wrapped


def test_the_command_prints_the_selection_against_its_bound(tmp_path, capsys) -> None:
    assert main(["--suite", "resnet50", "--batch", "2", "--dtype", "float32", "--layout", "NHWC",
                 "--layers", "^r50_l4_1x1_2048$", "--platform", "cpu",
                 "--json", str(tmp_path / "out.json")]) == 0
    printed = capsys.readouterr().out
    assert "selection (waited + forms + choice) on cpu: median" in printed
    assert "of 1 above 2.0 s" in printed
    assert (tmp_path / "out.json").exists()
