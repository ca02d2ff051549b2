"""Run a piece of Python in a child process: for the calls that used to
hang or abort the process (a hang is a timeout here, an abort a signal),
and for the ones that need a memory limit (RLIMIT_AS) or a fork."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# The child's prelude: a memory limit helper (the child sets it after its imports).
PRELUDE = """
import resource, numpy as np, embstore
from embstore import optim, init, policy

def vm_size() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")

def limit_memory(extra: int) -> None:
    '''Let the process map at most ``extra`` more bytes from now on.'''
    lim = vm_size() + extra
    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
"""


def run(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` (dedented, after :data:`PRELUDE`) in a fresh
    interpreter; fails the test on a timeout (a hang), naming it."""
    src = PRELUDE + textwrap.dedent(code)
    # A fixed mmap threshold: large blocks are always mapped (and count
    # against RLIMIT_AS at once), instead of coming from heap space that
    # glibc reserved earlier once its threshold rose.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    try:
        return subprocess.run(
            [sys.executable, "-c", src], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")[-2000:] if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise AssertionError(f"the child hung (no exit within {timeout} s): {out}") from None


def ok(code: str, timeout: float = 120) -> str:
    """:func:`run` that must exit 0 (not killed by a signal); returns stdout."""
    proc = run(code, timeout)
    assert proc.returncode == 0, (
        f"child exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def main_guard(code: str) -> str:
    """``code`` as the body of ``if __name__ == "__main__":`` (for children
    that start processes of their own)."""
    return "if __name__ == '__main__':\n" + textwrap.indent(textwrap.dedent(code), "    ")


if __name__ == "__main__":  # pragma: no cover - a manual check of the helper
    print(ok("print(embstore.__version__)"), file=sys.stderr)
