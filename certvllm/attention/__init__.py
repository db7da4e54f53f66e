"""Engine-agnostic certified attention: the public entry points.

* :func:`certified_decode` — one decode step of one sequence over unpaged originals (the stable
  entry point for evaluations, benchmarks and outside checks). It builds pages and runs the same
  paged path as the serving backend.
* :func:`certified_attention` — the paged op itself (rows × block tables), used by the backend.
"""

from certvllm.attention.api import certified_decode
from certvllm.attention.dense import dense_decode
from certvllm.attention.paged import certified_attention
from certvllm.attention.report import CertifiedOutput, CertReport

__all__ = ["CertReport", "CertifiedOutput", "certified_attention", "certified_decode", "dense_decode"]
