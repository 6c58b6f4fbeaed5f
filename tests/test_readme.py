"""The README's example runs as pasted: its first code block under "## Example" defines its
own inputs, compiles a plan and runs it under jax.jit."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_the_readme_example_runs_as_pasted() -> None:
    if not README.exists():
        pytest.skip("README.md is not next to the tests")
    text = README.read_text()
    example = text[text.index("\n## Example\n"):]
    code = re.search(r"```python\n(.*?)```", example, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md: Example", "exec"), namespace)
    y = np.asarray(namespace["y"], np.float32)
    assert y.shape == (8, 56, 56, 64) and np.isfinite(y).all() and (y >= 0).all()
    assert namespace["plan"].kernel_info["solver"]
