"""embstore's own exceptions (bad arguments raise TypeError/ValueError)."""

from __future__ import annotations

from embstore._core import CheckpointError, EmbstoreError

__all__ = ["CheckpointError", "EmbstoreError"]
