"""PyTorch modules over embstore tables (needs torch: ``pip install torch``).

The modules' forward returns a tensor that requires grad; their backward
applies the gradient to the table's own optimizer (a fused backward, as
TorchRec/FBGEMM do): no dense gradient and no torch optimizer over the
embedding rows. Give torch's optimizer the model's dense parameters only.
"""

from __future__ import annotations

from embstore._deps import require

require("torch", "torch")

from embstore.torch.collections import (  # noqa: E402
    EmbeddingBagCollection,
    EmbeddingCollection,
    JaggedTensor,
    KeyedTensor,
)
from embstore.torch.configs import EmbeddingBagConfig, EmbeddingConfig  # noqa: E402
from embstore.torch.module import Embedding, EmbeddingBag  # noqa: E402

__all__ = [
    "Embedding",
    "EmbeddingBag",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "JaggedTensor",
    "KeyedTensor",
]
