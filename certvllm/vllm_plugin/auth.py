"""The API key on the routes vLLM leaves open: ``/tokenize``, ``/detokenize`` and the other tokenizer, model and
scaling routes outside ``/v1``.

vLLM's ``--api-key`` guards only paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
(``vllm.entrypoints.serve.middleware.authenticate.GUARDED_PREFIX``), so ``/tokenize`` and ``/detokenize`` answer
any client. ``certvllm serve --api-key KEY`` adds :class:`GuardTokenizerRoutes` through vLLM's own
``--middleware`` option (no patch of vLLM): the same Bearer check, with the same keys, on :data:`GUARDED_PATHS`.
The health, readiness, version and ``/metrics`` routes stay open for probes and Prometheus, as in vLLM.

``--middleware`` instantiates the class with the app alone, so the keys are handed over in this process
(:func:`set_api_keys`, called by the CLI before vLLM starts); a process that got none refuses to start.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

# routes outside vLLM's guarded prefixes that run the tokenizer or the model, or change the deployment (vLLM 0.32:
# /generative_scoring runs the model; /scale_elastic_ep rescales the engine)
GUARDED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info", "/invocations", "/pooling", "/classify", "/score",
                 "/rerank", "/generative_scoring", "/scale_elastic_ep", "/is_scaling_elastic_ep")  # fmt: skip
MIDDLEWARE_PATH = "certvllm.vllm_plugin.auth.GuardTokenizerRoutes"
_KEY_HASHES: list[bytes] = []


def set_api_keys(keys: list[str]) -> None:
    """The ``--api-key`` values the middleware accepts in this process (stored as SHA-256 digests)."""
    _KEY_HASHES[:] = [hashlib.sha256(k.encode()).digest() for k in keys if k]


def guarded(path: str) -> bool:
    """Whether ``path`` is one of :data:`GUARDED_PATHS` (or below one)."""
    return any(path == p or path.startswith(p + "/") for p in GUARDED_PATHS)


def authorized(headers: list[tuple[bytes, bytes]], hashes: list[bytes]) -> bool:
    """Whether the ASGI ``headers`` carry ``Authorization: Bearer KEY`` with one of the keys (constant time)."""
    value = next((v.decode("latin-1") for k, v in headers if k.lower() == b"authorization"), "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.encode()).digest()
    match = False
    for h in hashes:
        match |= secrets.compare_digest(digest, h)
    return match


class GuardTokenizerRoutes:
    """Pure ASGI middleware: 401 ``{"error": "Unauthorized"}`` (vLLM's answer) on :data:`GUARDED_PATHS` without a
    valid key; every other request passes untouched."""

    def __init__(self, app: Any) -> None:
        if not _KEY_HASHES:
            raise RuntimeError(
                f"certvllm: {MIDDLEWARE_PATH} has no API key in this process; it is added by `certvllm serve "
                "--api-key KEY` (which hands the key over). Drop --middleware for it, or start with certvllm serve."
            )
        self.app = app
        self.hashes = list(_KEY_HASHES)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if guarded(path) and not authorized(scope.get("headers", []), self.hashes):
                from starlette.responses import JSONResponse

                await JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
