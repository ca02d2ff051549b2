"""The README's usage examples run as written."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def python_blocks() -> list[str]:
    """The README's ```python blocks (```py marks a script run otherwise,
    e.g. under mpirun)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 5, "README lost its examples"
    return blocks


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs_on_its_own(index: int, tmp_path: pathlib.Path) -> None:
    """Each block, alone in a fresh interpreter (its own imports, no names
    from an earlier block), in an empty directory."""
    code = python_blocks()[index]
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, "RAYON_NUM_THREADS": "2"},
    )
    assert proc.returncode == 0, f"README block {index}:\n{code}\n{proc.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_blocks_pass_mypy_strict(tmp_path: pathlib.Path) -> None:
    """Every README example, each as its own module, type-checks under
    mypy --strict (the unpacking of export()/evict() included)."""
    blocks = re.findall(r"```py(?:thon)?\n(.*?)```", README.read_text(), re.S)
    files = []
    for i, code in enumerate(blocks):
        path = tmp_path / f"readme_block_{i}.py"
        path.write_text(code)
        files.append(str(path))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--python-version",
            "3.11",
            "--cache-dir",
            str(ROOT / ".mypy_cache"),
            "--no-error-summary",
            *files,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed")
def test_readme_mpi_examples_run_under_mpirun(tmp_path: pathlib.Path) -> None:
    """Each ```py script that says "run with: mpirun" runs so on 2 ranks."""
    blocks = re.findall(r"```py\n(.*?)```", README.read_text(), re.S)
    scripts = [b for b in blocks if "run with: mpirun" in b.splitlines()[0]]
    assert len(scripts) >= 2, "README lost its MPI examples"
    env = {
        **os.environ,
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "RAYON_NUM_THREADS": "1",
    }
    for i, script in enumerate(scripts):
        (tmp_path / f"script{i}.py").write_text(script)
        proc = subprocess.run(
            ["mpirun", "--oversubscribe", "-n", "2", sys.executable, f"script{i}.py"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
        assert proc.returncode == 0, script + proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "manifest.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_readme_torchrun_example_trains_saves_and_resumes(tmp_path: pathlib.Path) -> None:
    """The ```py script that says "run with: torchrun" runs twice on 2
    ranks: the first saves a checkpoint per rank, the second resumes it."""
    blocks = re.findall(r"```py\n(.*?)```", README.read_text(), re.S)
    (script,) = [b for b in blocks if "run with: torchrun" in b.splitlines()[0]]
    (tmp_path / "train_ddp.py").write_text(script)
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    stamps = []
    for _ in range(2):
        proc = subprocess.run(
            [*cmd, "train_ddp.py"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        stamps.append((tmp_path / "ckpt" / "rank1.pt").stat().st_mtime_ns)
    assert stamps[1] > stamps[0]


def test_every_readme_install_command_is_run_by_ci() -> None:
    """Each `pip install ...` the README names is run as written by CI:
    .ci/run, scripts/wheel_smoke.sh (fresh venvs), or, for the hints of
    embstore._deps.EXTRAS, by the smoke script's loop over them."""
    from embstore._deps import EXTRAS

    text = README.read_text()
    commands = {
        m.split("&&")[0].strip()
        for m in re.findall(r"pip install [^`\n]+", text)
        if "embstore`" not in m
    }
    commands.discard("pip install embstore")  # said not to work
    assert len(commands) >= 10, commands
    ci = (ROOT / ".ci" / "run").read_text() + (ROOT / "scripts" / "wheel_smoke.sh").read_text()
    hints = {f"pip install {v}" for v in EXTRAS.values()}
    missing = sorted(c for c in commands if c not in ci and c not in hints)
    assert not missing, f"README install commands no CI step runs: {missing}"
    assert "for extra in torch mpi plot metrics progress replicate gpu; do" in ci
    assert set(EXTRAS) == {"torch", "mpi", "plot", "metrics", "progress", "replicate", "gpu"}


def test_every_install_hint_names_commands_ci_runs() -> None:
    """The ImportError hints name `pip install <packages>` and the checkout
    form `pip install ".[extra]"`; scripts/wheel_smoke.sh runs both kinds."""
    from embstore._deps import EXTRAS, install_hint

    smoke = (ROOT / "scripts" / "wheel_smoke.sh").read_text()
    for extra, packages in EXTRAS.items():
        hint = install_hint(extra)
        assert f"pip install {packages}" in hint
        assert f'pip install ".[{extra}]"' in hint
        assert f'  pip install ".[{extra}]"\n' in smoke, extra
