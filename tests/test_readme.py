"""The README's usage examples run as written."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_examples_run_in_order() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 3, "README lost its examples"
    namespace: dict[str, object] = {}
    for code in blocks:  # one session: later examples use earlier names
        exec(compile(code, str(README), "exec"), namespace)
