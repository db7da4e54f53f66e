"""The arguments of one certified layer call, as the op (``op.py``) hands them to an implementation
(``reference.py``, ``cpu_fused.py``, ``gpu.py``) once it has validated them."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from certvllm.config import CertConfig
from certvllm.kv.cache import LayerKVCache
from certvllm.kv.pagein import PageInEngine


@dataclass(frozen=True)
class LayerCall:
    """Attributes:
    q: ``[R, H_q, D]`` queries (any float dtype; post-RoPE).
    cache: the layer's tiered cache.
    tables: ``[R, W]`` int64 16-token block ids per row (host tensors except on the CUDA path).
    lens: ``[R]`` int64 context length per row, the query's own token included.
    cfg: tolerances and mode.
    scale: the softmax scale.
    pagein: the page-in engine (counts the traffic).
    generator: random source of exploration draws (or None).
    """

    q: torch.Tensor
    cache: LayerKVCache
    tables: torch.Tensor
    lens: torch.Tensor
    cfg: CertConfig
    scale: float
    pagein: PageInEngine
    generator: torch.Generator | None = None

    def rows(self, sl: slice) -> LayerCall:
        """The same call restricted to the rows ``sl``."""
        return replace(self, q=self.q[sl], tables=self.tables[sl], lens=self.lens[sl])
