"""The ``certvllm`` object of a completion or chat response (API server side of ``certificates.py``).

The engine returns a finished request's certificate in its ``kv_transfer_params`` (``certificates.py``). vLLM 0.32
writes those into a non-streaming response (``"kv_transfer_params": {"certvllm": {...}}``) and drops them from
streams, and the certificate of a completion with several prompts is split over several engine requests. This
module, added to the API server by ``certvllm serve --cert-return-certificate`` through vLLM's own ``--middleware``
option, gives every response one documented place for it, the top-level ``certvllm`` field:

* :func:`observe` wraps the engine client's ``generate`` (on the instance the server's handlers share; no vLLM code
  or class is changed) to note each engine request's certificate when its final output passes through, keyed by
  the engine request id the handler chose (``cmpl-ID-i`` for prompt ``i`` of completion ``cmpl-ID``, ``chatcmpl-ID``
  or ``chatcmpl-ID_i`` for chat). The wrapper closes the wrapped generator when it is closed itself, so a client that
  goes away aborts its request as before.
* :class:`CertificateMiddleware` (pure ASGI, ``POST /v1/completions`` and ``POST /v1/chat/completions``): in a JSON
  response it takes the certificates noted for the response's ``id`` (merged over its engine requests,
  ``certvllm.metrics.requests.merge_certificates``) into ``certvllm`` and removes ``kv_transfer_params.certvllm``
  (``kv_transfer_params`` becomes null when nothing else is in it); in a stream it holds back the chunks that end a
  choice (a ``finish_reason``) and the usage chunk until the next event, and adds ``certvllm`` to the last of them
  before ``data: [DONE]``. Other chunks pass at once; a response without a certificate passes unchanged.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from typing import Any

from certvllm.metrics.requests import merge_certificates

logger = logging.getLogger("vllm.certvllm")  # under "vllm": shares vLLM's log handlers
CERTIFICATE_KEY = "certvllm"
MIDDLEWARE_PATH = "certvllm.vllm_plugin.certificate_api.CertificateMiddleware"
ROUTES = ("/v1/completions", "/v1/chat/completions")
_OBSERVED = "_certvllm_observed"


class CertificateBook:
    """Certificates of finished engine requests until their response takes them (at most ``limit`` of them, each
    for at most ``ttl_s``: a response that never comes, e.g. a client gone, does not hold one for long)."""

    def __init__(self, limit: int = 4096, ttl_s: float = 600.0) -> None:
        self.limit, self.ttl_s = limit, ttl_s
        self._certs: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, engine_request_id: str, cert: dict[str, Any]) -> None:
        """The certificate of an engine request (a later one replaces it: with ``n`` > 1 samples each finishing
        sample's object covers the samples finished before it)."""
        now = time.monotonic()
        with self._lock:
            self._certs.pop(engine_request_id, None)
            self._certs[engine_request_id] = (now, cert)
            while self._certs and (len(self._certs) > self.limit or now - self._oldest() > self.ttl_s):
                self._certs.popitem(last=False)

    def _oldest(self) -> float:
        return next(iter(self._certs.values()))[0]

    def take(self, response_id: str) -> dict[str, Any] | None:
        """The merged certificate of the engine requests of response ``response_id`` (the id itself, or the id with
        a ``-i``/``_i`` prompt index), removed from the book; None if there is none."""
        pattern = re.compile(re.escape(response_id) + r"(?:[-_]\d+)?")
        with self._lock:
            keys = [k for k in self._certs if pattern.fullmatch(k)]
            certs = [self._certs.pop(k)[1] for k in keys]
        return merge_certificates(certs)


BOOK = CertificateBook()


def observe(engine_client: Any, book: CertificateBook = BOOK) -> None:
    """Note the certificate of every engine request that passes through ``engine_client.generate`` in ``book``
    (once per client; see the module docstring)."""
    if engine_client is None or getattr(engine_client, _OBSERVED, False):
        return
    original: Callable[..., AsyncGenerator[Any, None]] = engine_client.generate

    async def generate(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        request_id = kwargs.get("request_id", args[2] if len(args) > 2 else None)
        outputs = original(*args, **kwargs)
        try:
            async for output in outputs:
                params = getattr(output, "kv_transfer_params", None)
                cert = params.get(CERTIFICATE_KEY) if isinstance(params, dict) else None
                if request_id is not None and isinstance(cert, dict):
                    book.put(str(request_id), cert)
                yield output
        finally:
            await outputs.aclose()

    engine_client.generate = generate
    setattr(engine_client, _OBSERVED, True)


def with_certificate(body: dict[str, Any], book: CertificateBook = BOOK) -> bool:
    """Put the certificate of response ``body`` (a completion, chat completion or stream chunk as a dict) in its
    ``certvllm`` field and remove ``kv_transfer_params.certvllm``; whether the body changed."""
    changed = False
    params = body.get("kv_transfer_params")
    inline = None
    if isinstance(params, dict) and CERTIFICATE_KEY in params:
        inline = params.pop(CERTIFICATE_KEY)
        body["kv_transfer_params"] = params or None
        changed = True
    cert = book.take(body["id"]) if isinstance(body.get("id"), str) else None
    cert = cert if cert is not None else inline if isinstance(inline, dict) else None
    if cert is not None:
        body[CERTIFICATE_KEY] = cert
        changed = True
    return changed


def _dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _ends_a_choice(event: dict[str, Any]) -> bool:
    choices = event.get("choices")
    return choices == [] or (isinstance(choices, list) and any(c.get("finish_reason") for c in choices))


class _Rewriter:
    """The ``send`` of one response: JSON bodies are collected and rewritten, streams are rewritten event by event."""

    def __init__(self, send: Callable[[dict[str, Any]], Any], book: CertificateBook) -> None:
        self._send = send
        self._book = book
        self._kind: str | None = None  # "json", "sse" or "other"
        self._start: dict[str, Any] | None = None
        self._body = bytearray()
        self._pending = b""  # an incomplete SSE event
        self._held: list[bytes] = []  # complete events that may be the stream's last chunk

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            kind = _content_type(message.get("headers", []))
            self._kind = "json" if kind == "application/json" else "sse" if kind == "text/event-stream" else "other"
            if self._kind == "json":
                self._start = message  # sent with the body: its content-length changes
                return
            await self._send(message)
            return
        if message["type"] != "http.response.body" or self._kind == "other":
            await self._send(message)
            return
        more = message.get("more_body", False)
        if self._kind == "json":
            self._body += message.get("body", b"")
            if not more:
                await self._send_json()
            return
        await self._stream(message.get("body", b""), more)

    async def _send_json(self) -> None:
        body = bytes(self._body)
        try:
            parsed = json.loads(body)
            if isinstance(parsed, dict) and with_certificate(parsed, self._book):
                body = _dumps(parsed)
        except (ValueError, UnicodeDecodeError):
            pass
        start = dict(self._start or {"type": "http.response.start", "status": 200, "headers": []})
        start["headers"] = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        start["headers"].append((b"content-length", str(len(body)).encode()))
        await self._send(start)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def _stream(self, chunk: bytes, more: bool) -> None:
        data = self._pending + chunk
        *events, self._pending = data.split(b"\n\n")
        out = bytearray()
        for raw in events:
            event = raw + b"\n\n"
            payload = raw[len(b"data: ") :] if raw.startswith(b"data: ") else None
            if payload is None:  # a comment (keep-alive): passes, the held chunks stay held
                out += event
            elif payload.strip() == b"[DONE]":
                out += self._release(last=True) + event
            else:
                try:
                    parsed = json.loads(payload)
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict) and _ends_a_choice(parsed):
                    self._held.append(event)
                else:
                    out += self._release(last=False) + event
        if not more:
            out += self._release(last=True) + self._pending
            self._pending = b""
        if out or not more:
            await self._send({"type": "http.response.body", "body": bytes(out), "more_body": more})

    def _release(self, last: bool) -> bytes:
        """The held events; with ``last``, the final one carries the stream's certificate."""
        held, self._held = self._held, []
        if last and held:
            final = json.loads(held[-1][len(b"data: ") :])
            if with_certificate(final, self._book):
                held[-1] = b"data: " + _dumps(final) + b"\n\n"
        return b"".join(held)


def _content_type(headers: list[tuple[bytes, bytes]]) -> str:
    for key, value in headers:
        if key.lower() == b"content-type":
            return value.decode("latin-1").split(";")[0].strip().lower()
    return ""


class CertificateMiddleware:
    """Pure ASGI middleware (vLLM's ``--middleware``): the ``certvllm`` field of completion and chat responses (see
    the module docstring). Every other request passes untouched."""

    def __init__(self, app: Any, book: CertificateBook = BOOK) -> None:
        self.app = app
        self.book = book

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")) if scope["type"] == "http" else ""
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in ROUTES:
            await self.app(scope, receive, send)
            return
        app = scope.get("app")
        state = getattr(app, "state", None)
        observe(getattr(state, "engine_client", None), self.book)
        await self.app(scope, receive, _Rewriter(send, self.book).send)
