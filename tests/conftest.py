"""Shared fixtures: seeded generators, the hypothesis profile used in CI, and the session's one ``certvllm serve``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("CERTVLLM_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("ci")
# two torch threads, or one in each pytest-xdist worker (make test runs two workers on this 2-core machine, beside
# the engines' own workers: more threads than cores make torch's thread pools wait on each other)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def pytest_addoption(parser: pytest.Parser) -> None:
    """Model folders and sizing of the GPU engine tests (tests/vllm_plugin/test_gpu_vllm.py, test_gpu_hybrid.py)."""
    group = parser.getgroup("certvllm GPU engines")
    group.addoption(
        "--dummy8b-dir", default=None,
        help="Llama-3.1-8B-shaped dummy model folder (default .device/llama8b-dummy, written when missing)",
    )  # fmt: skip
    group.addoption(
        "--hybrid8b-dir", default=None,
        help="OLMo-3-7B-shaped (hybrid: sliding-window and full attention) dummy model folder (default "
        ".device/olmo3-7b-dummy, written when missing; tests/vllm_plugin/test_gpu_hybrid.py)",
    )  # fmt: skip
    group.addoption(
        "--smollm2-dir", default=None,
        help="prepared SmolLM2-135M folder with its weights (default models/smollm2-135m-instruct)",
    )  # fmt: skip
    group.addoption(
        "--gpu-host-memory-gb", type=float, default=None,
        help="host tier of the 131072-token engine in GiB (default: sized automatically)",
    )  # fmt: skip


_SERVER: dict[str, Any] = {}  # the shared server while it runs: its ExitStack and process


@pytest.fixture(scope="session")
def certified_server(tmp_path_factory) -> Iterator[str]:
    """The base URL of one ``certvllm serve`` (the installed console script) of the bundled model, shared by
    every test that needs a real server: tests/vllm_plugin/test_vllm_server.py, the dashboard scrape of
    tests/test_deploy.py and the short soak of tests/test_soak.py (one server start instead of three: each is
    ~40 s of this 2-core machine's time).

    ``--cert-config default --cert-bound-tol 0.001``: the default preset with a bound tolerance that sends a share
    of the head-steps to rung 3, so that the fallback series exist for the dashboard's queries; the rest stay
    certified (rungs 0-2), so every series of the server tests is exported too, and those tests check only
    what holds on every rung (token accounting, the answer, freed blocks). ``--cert-return-certificate request``:
    a request that asks for its certificate gets it (tests/vllm_plugin/test_certificates.py); the others are served
    as without the flag. ``PROMETHEUS_MULTIPROC_DIR`` is
    left for ``certvllm serve`` to set. The server stops after the last test that uses it
    (:func:`pytest_runtest_teardown`), not at the end of the session, and then no process of its group may be
    left. Under pytest-xdist its users form one group (``XDIST_GROUPS``: "server"), so one worker runs them all.
    """
    from servers import SERVER_MODEL, certified_serve_command, free_port, serve_env, serving

    from certvllm.models import prepare_default_model

    prepare_default_model(SERVER_MODEL)
    port = free_port()
    folder = tmp_path_factory.mktemp("server")
    env = serve_env(kv_cache_gib=1)
    cmd = certified_serve_command(port, max_model_len=2048,
                                  cert_args=("--cert-config", "default", "--cert-bound-tol", "0.001",
                                             "--cert-return-certificate", "request"))  # fmt: skip
    stack = contextlib.ExitStack()
    base, proc = stack.enter_context(serving(cmd, port, env, folder / "serve.log", start_timeout=240))
    _SERVER.update(stack=stack, proc=proc)
    try:
        yield base
    finally:
        _stop_server()


def _stop_server() -> None:
    stack = _SERVER.pop("stack", None)
    if stack is None:
        return
    from servers import alive_in_group

    stack.close()
    assert not alive_in_group(_SERVER.pop("proc").pid), "server processes left behind"


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the shared server once the last test that uses it (in the session's order) is done."""
    if "stack" not in _SERVER or "certified_server" not in getattr(item, "fixturenames", ()):
        return
    items = item.session.items
    later = items[items.index(item) + 1 :]
    if not any("certified_server" in getattr(other, "fixturenames", ()) for other in later):
        _stop_server()


# -- pytest-xdist (make test: -n 2 --dist loadgroup) ----------------------------------------------------------
# Tests that must run on one worker, one after the other, by node id (a module, or one test of a module):
# ``engines``: the engine module and the evaluation smoke test each keep both cores busy with two vLLM engines,
# and four engines at once would not fit the machine's memory (the fault module's own server runs there too, and
# the tensor-parallel module's engines, each of which computes on both cores, one thread per rank);
# ``server``: the users of ``certified_server`` (one server, stopped after its last user). The groups are handed
# out first (longest first), then the other tests module by module, so the other worker runs the single-core tests
# (the Triton interpreter, the benchmark's engines one at a time, the fast tests) beside the engines.
XDIST_GROUPS = {
    "tests/vllm_plugin/test_vllm_engine.py": "engines",
    "tests/vllm_plugin/test_hybrid_engine.py": "engines",
    "tests/eval/test_eval.py::test_eval_smoke_through_the_engine": "engines",
    "tests/vllm_plugin/test_tensor_parallel.py": "engines",
    "tests/vllm_plugin/test_serving_faults.py": "engines",
    "tests/vllm_plugin/test_vllm_server.py": "server",
    "tests/test_deploy.py::test_dashboard_metrics_exist_in_a_real_scrape": "server",
    "tests/test_soak.py::test_short_soak_against_the_shared_server": "server",
    "tests/vllm_plugin/test_bad_requests.py": "server",
    "tests/vllm_plugin/test_certificates.py::test_a_request_alone_gets_the_numbers_it_added_to_the_metrics": "server",
    "tests/vllm_plugin/test_certificates.py::test_a_stream_ends_with_its_certificate": "server",
    "tests/vllm_plugin/test_certificates.py::test_two_concurrent_requests_get_their_own_numbers": "server",
    "tests/vllm_plugin/test_certificates.py::test_prompts_and_samples_of_one_response_share_one_certificate": "server",
}
XDIST_GROUP_ORDER = ("engines", "server")


def xdist_group(nodeid: str) -> str | None:
    """The ``XDIST_GROUPS`` group of a test node id, if any."""
    for prefix, group in XDIST_GROUPS.items():
        if nodeid == prefix or nodeid.startswith(prefix + "::") or nodeid.startswith(prefix + "["):
            return group
    return None


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` with the groups of ``XDIST_GROUPS``: pytest-xdist's own loadgroup finds a test's
    ``xdist_group`` mark by renaming its node id, which pytest 9 no longer allows (the marks are silently
    ignored), so the groups are named here by node id instead; every other test is grouped by module."""
    if config.getoption("dist", None) != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid) or nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the groups first, in XDIST_GROUP_ORDER, then the modules (largest first)
                self.ordered = True
                for group in reversed(XDIST_GROUP_ORDER):
                    if group in self.workqueue:
                        self.workqueue.move_to_end(group, last=False)
            super()._assign_work_unit(node)

    return GroupScheduling(config, log)
