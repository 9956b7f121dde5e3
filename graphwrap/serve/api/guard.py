"""What the server checks of a request before the app reads it (an ASGI middleware): the API key
where one is set, and the body's size.

A body larger than the limit is answered 413 as soon as its size is known (from its
``Content-Length``, or once the bytes read pass the limit), and never kept: a client cannot make
the server hold or parse more than the limit. The rest of such a body is read and dropped, up to
:data:`DISCARD` times the limit, so that a client that sends it whole before reading (as most do)
reads the 413 and not a reset connection; past that the connection is closed. The body read is handed to the app as it
came; after it, the app's ``receive`` is the connection's (it sees a client that hangs up).
"""

import hmac
import json
from typing import Optional

MAX_BODY = 16 << 20  # bytes of a request's body (--max-body-mb)
DISCARD = 8  # a body over the limit is read and dropped up to this many times the limit before the 413
# Paths that need no key unless the server is told they do (--api-key-everywhere)
OPEN = ("/health", "/metrics")


def _error(message: str, kind: str, code: Optional[str] = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


async def _answer(send, status: int, body: bytes, headers=()):
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """``app`` behind the checks: ``api_key`` (None: none asked), ``everywhere`` (the key asked
    on /health and /metrics too), ``max_body`` bytes; ``count(path, status)`` is told of each
    request it answers itself."""

    def __init__(self, app, api_key: Optional[str] = None, everywhere: bool = False, max_body: int = MAX_BODY,
                 count=None):
        self.app, self.api_key, self.everywhere, self.max_body = app, api_key, everywhere, max_body
        self.count = count or (lambda path, status: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if self.api_key is not None and (self.everywhere or path not in OPEN) and not self._authorized(scope):
            self.count(path, "401")
            return await _answer(send, 401, _error("a valid API key is needed: 'Authorization: Bearer KEY'",
                                                   "authentication_error", "invalid_api_key"),
                                 [(b"www-authenticate", b"Bearer")])
        length = _content_length(scope)
        if length is not None and length > self.max_body:
            if length <= DISCARD * self.max_body:
                await _discard(receive, DISCARD * self.max_body)
            return await self._too_large(send, path, length)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        body, more, gone = [], True, None
        size = 0
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone = message
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                if more and message.get("more_body", False):
                    await _discard(receive, DISCARD * self.max_body - size)
                return await self._too_large(send, path, None)
            body.append(chunk)
            more = message.get("more_body", False)
        whole = b"".join(body)
        given = False

        async def replay():
            nonlocal given
            if not given:
                given = True
                return gone or {"type": "http.request", "body": whole, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, key = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(),
                                                                          self.api_key.encode())  # type: ignore[union-attr]
        return False

    async def _too_large(self, send, path: str, length: Optional[int]):
        self.count(path, "413")
        said = f"{length} bytes" if length is not None else "more"
        return await _answer(send, 413, _error(f"the request's body is too large ({said}; at most {self.max_body} "
                                               f"bytes: --max-body-mb sets it)", "invalid_request_error"),
                             [(b"connection", b"close")])


async def _discard(receive, most: int):
    """Read what is left of a body, keeping none of it, up to ``most`` bytes."""
    while most > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        most -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _content_length(scope) -> Optional[int]:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
