"""The vLLM plugin (``vllm.general_plugins`` entry point): the only package of certvllm that imports vLLM.

``register()`` runs in every vLLM process (API server, engine core, workers). It is idempotent and
cheap: it makes ``--kv-cache-dtype certified`` a valid value, registers the certified backend in
vLLM's CUSTOM slot, routes ``certified`` to it (the CPU platform otherwise ignores every backend
choice), forces 16-token blocks, caps the block count by the host-tier budget, registers the
``certvllm-peaked-dummy`` load format (``peaked_dummy.py``, for benchmarks) and the ``CertvllmConnector`` KV
connector (per-request certificates, ``certificates.py``) and runs a self-test.
An unsupported vLLM version is logged and leaves vLLM untouched.
"""

from __future__ import annotations

import contextlib
import logging
import sys

from certvllm import env

logger = logging.getLogger("vllm.certvllm")  # under "vllm": shares vLLM's log handlers

BACKEND_PATH = "certvllm.vllm_plugin.backend.CertifiedAttentionBackend"
_registered = False


def register() -> None:
    """Entry point: install the ``certified`` KV-cache dtype and its backend in this process."""
    global _registered
    if _registered:
        return
    from certvllm.vllm_plugin import _compat

    try:
        version = _compat.check_version()
    except _compat.UnsupportedVllmError as err:
        logger.error("certvllm plugin disabled: %s", err)
        return
    _compat.register_kv_cache_dtype(version)

    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)

    from certvllm.vllm_plugin import routing

    routing.install()
    from certvllm.vllm_plugin import peaked_dummy

    peaked_dummy.register_loader()  # --load-format certvllm-peaked-dummy (benchmarks without real weights)
    _register_certificate_connector()
    _compat.dtype_self_test()
    routing.self_test()
    _maybe_enable_multiprocess_metrics()
    _registered = True


def _register_certificate_connector() -> None:
    """``CertvllmConnector`` in vLLM's KV connector factory (loaded lazily by module path: nothing is imported
    here), for ``--kv-transfer-config '{"kv_connector": "CertvllmConnector", "kv_role": "kv_producer"}'``;
    ``certvllm serve --cert-return-certificate`` names the module path itself (``settings.py``)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from certvllm.vllm_plugin import settings

    with contextlib.suppress(ValueError):  # registered already in this process
        KVConnectorFactory.register_connector(settings.CONNECTOR_NAME, settings.CONNECTOR_MODULE, "CertvllmConnector")


def _maybe_enable_multiprocess_metrics() -> None:
    """Under plain ``vllm serve``, let worker metrics reach the API server's ``/metrics``.

    prometheus_client picks its storage when first imported, so this only works if it was not
    imported yet in this (API server) process; ``certvllm serve`` always sets it up beforehand.
    """
    import multiprocessing

    if env.prometheus_dir() is not None or sys.argv[1:2] != ["serve"]:
        return
    if multiprocessing.parent_process() is not None:  # only the API server process decides
        return
    if "prometheus_client" in sys.modules:
        logger.warning(
            "certvllm: certification metrics need PROMETHEUS_MULTIPROC_DIR set before vLLM starts; "
            "use `certvllm serve` (it sets it) to see vllm:cert_* on /metrics"
        )
        return
    import atexit
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="certvllm-metrics-")
    env.set_prometheus_dir(path)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
