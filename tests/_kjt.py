"""A KeyedJaggedTensor's accessors without torchrec (what torchrec users
pass in): keys, values, lengths, optional weights, and a stride per key
when given one (a variable-stride KJT)."""

from __future__ import annotations

from typing import Any

import torch


class FakeKJT:
    def __init__(
        self,
        keys: list[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: Any = None,
        stride_per_key: list[int] | None = None,
    ) -> None:
        self._k, self._v, self._l, self._w = keys, values, lengths, weights
        self._s = stride_per_key

    def keys(self) -> list[str]:
        return self._k

    def values(self) -> torch.Tensor:
        return self._v

    def lengths(self) -> torch.Tensor:
        return self._l

    def weights_or_none(self) -> Any:
        return self._w

    def stride(self) -> int:
        return max(self._s) if self._s else len(self._l) // len(self._k)

    def variable_stride_per_key(self) -> bool:
        return self._s is not None

    def stride_per_key(self) -> list[int]:
        return self._s or [self.stride()] * len(self._k)
