"""An optional API key, as vLLM's ``--api-key``: with one set, every route but the open ones needs it.

Clients send ``Authorization: Bearer <key>`` (what OpenAI's clients do with
``api_key=``). The key is compared in constant time (SHA-256 digests of the
sent and the expected key, so not even its length shows in the timing); a
missing or wrong key is a 401 in OpenAI's error shape. The key is never
printed: ``ApiKey`` shows as ``ApiKey(****)`` and no answer repeats what was sent.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

API_KEY_ENV = "SPEED_API_KEY"  # the key when none is passed: `serve run`, a RayService's Secret
OPEN_PATHS = frozenset({"/healthz"})  # liveness probes carry no key


class ApiKey:
    """A secret the ``Authorization`` header must carry; its value never appears in ``repr`` or ``str``."""

    def __init__(self, key: str) -> None:
        if not key or key != key.strip():
            raise ValueError("an API key must be a non-empty string without surrounding whitespace")
        self._digest = hashlib.sha256(key.encode()).digest()

    def __repr__(self) -> str:
        return "ApiKey(****)"

    __str__ = __repr__

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value is ``Bearer <this key>`` (scheme case-insensitive)."""
        scheme, _, sent = (authorization or "").partition(" ")
        sent_digest = hashlib.sha256(sent.strip().encode()).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(sent_digest, self._digest)


def resolve(key: str | None) -> ApiKey | None:
    """The key given, else ``$SPEED_API_KEY``; None (no key required) when both are unset or empty."""
    key = key if key is not None else os.environ.get(API_KEY_ENV)
    return ApiKey(key) if key else None


def unauthorized() -> JSONResponse:
    """OpenAI's answer to a missing or wrong key."""
    body = {
        "error": {
            "message": "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


def require_key(app: FastAPI) -> None:
    """Make every HTTP route of ``app`` but ``OPEN_PATHS`` (documentation and unknown paths included) check
    ``app.state.api_key`` when one is set (each Serve replica sets its own). Call before ``app`` serves."""
    app.add_middleware(_KeyCheck)


class _KeyCheck:
    """Pure ASGI middleware: answers 401 itself or passes the request through untouched (streams included)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            key: ApiKey | None = getattr(scope["app"].state, "api_key", None)
            path, root = scope["path"], scope.get("root_path", "")
            if root and path.startswith(root):  # under a Serve route prefix
                path = path[len(root) :] or "/"
            if key is not None and path not in OPEN_PATHS:
                sent = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
                if not key.accepts(sent):
                    await unauthorized()(scope, receive, send)
                    return
        await self.app(scope, receive, send)
