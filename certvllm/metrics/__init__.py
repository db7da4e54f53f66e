"""Prometheus metrics of certified attention (declared in ``prometheus.py``, documented in
``docs/metrics.md``). Engine-agnostic: the vLLM plugin feeds it reports and page-in statistics."""

from certvllm.metrics.prometheus import BOUND_BUCKETS, CertMetrics, KeyPageCounts, metric_names

__all__ = ["BOUND_BUCKETS", "CertMetrics", "KeyPageCounts", "metric_names"]
