"""Engine-agnostic certified attention: the public entry points.

* :func:`certified_attention` — the op (rows × block tables over one layer's paged cache), used by the
  vLLM backend, the benchmarks and the tests: it validates, chooses the implementation and applies rungs
  3/4 (``op.py``).
* :func:`certified_decode` — one decode step of one sequence over unpaged originals (the stable entry
  point for evaluations and outside checks): it builds pages and calls the op.
"""

from certvllm.attention.api import certified_decode
from certvllm.attention.dense import dense_decode
from certvllm.attention.op import certified_attention
from certvllm.bounds.report import CertifiedOutput, CertReport

__all__ = ["CertReport", "CertifiedOutput", "certified_attention", "certified_decode", "dense_decode"]
