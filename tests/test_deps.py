"""Optional dependencies stay optional: importing embstore loads no torch or
mpi4py, and embstore.torch without torch says how to install it."""

from __future__ import annotations

import subprocess
import sys


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_embstore_loads_no_optional_dependency() -> None:
    proc = run(
        "import sys, embstore; print(sorted(m for m in ('torch', 'mpi4py', 'cupy') "
        "if m in sys.modules))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_embstore_torch_without_torch_is_a_clear_import_error() -> None:
    proc = run(
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import embstore.torch\nexcept ImportError as e:\n    print(e)"
    )
    assert proc.returncode == 0, proc.stderr
    # A command that works: torch from PyPI (no index has embstore itself).
    assert 'pip install torch (or, in an embstore checkout, pip install ".[torch]")' in proc.stdout
