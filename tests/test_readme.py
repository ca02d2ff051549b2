"""The README's usage examples run as written."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_examples_run_in_order() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 3, "README lost its examples"
    namespace: dict[str, object] = {}
    for code in blocks:  # one session: later examples use earlier names
        exec(compile(code, str(README), "exec"), namespace)


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed")
def test_readme_mpi_example_runs_under_mpirun(tmp_path: pathlib.Path) -> None:
    blocks = re.findall(r"```py\n(.*?)```", README.read_text(), re.S)
    (script,) = [b for b in blocks if "mpirun" in b]
    (tmp_path / "train.py").write_text(script)
    env = {
        **os.environ,
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "RAYON_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        ["mpirun", "--oversubscribe", "-n", "2", sys.executable, "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "manifest.json").exists()
