"""Tests in this folder run under mpirun (every rank runs every test, in the
same order); tests/test_mpi.py launches them with 2, 3 and 4 ranks. A plain
pytest run does not collect them here."""

from __future__ import annotations

import os

if not os.environ.get("EMBSTORE_MPI_TESTS"):
    collect_ignore_glob = ["*.py"]
