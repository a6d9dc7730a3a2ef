"""What happens to a request before FastAPI sees it, and to an error no route handler knew (pure ASGI).

`RequestGate` stands in front of every route:
1. it authenticates from the headers alone (`Authorize`: the admin token on the control and episode routes, a live
   lease key on a trainable server's chat completions), so an unauthenticated request is refused before a byte of
   its body is read;
2. it refuses a body over the limit with 413 (`request_too_large`): at once from its Content-Length, or as soon as a
   streamed body passes the limit, never reading past it;
3. it hands the body it read on to the app, which therefore never parses more than the limit;
4. it measures every body's shape before anything parses it (`shape_refusal`, a few passes of C over its bytes):
   nested deeper than `MAX_BODY_DEPTH` is a 400 `invalid_request` (100,000 `[` made the parser raise RecursionError:
   a 500 on every route), more than `MAX_BODY_VALUES` JSON values (strings, numbers, keys, arrays, objects) a 413
   `request_too_large` (4 million integers, under the size limit, held the loop for over a second however they were
   handled);
5. it parses a body over `PARSE_OFF_LOOP_BYTES` (or with over `INLINE_MAX_COMMAS` commas) in a worker thread,
   counting its JSON objects as they are decoded, and refuses one with more than `MAX_BODY_OBJECTS` (413
   `request_too_large`) before any of them is validated. A 16 MiB body can hold 450,000 tiny messages, whose parse
   and validation took 11 s of the event loop (every other request, `/health` included, waited); the count stops
   the parse at the limit, and the routes take the parsed body (and validate it in a worker thread too) from the
   scope (`PARSED_JSON`) instead of parsing it again on the loop.

So whatever body under the size limit reaches any route, the loop is never held for long: /health answers within
0.5 s meanwhile (tests/servers/test_hostile_bodies.py).

`CatchUnexpected` answers an exception that no handler took with the JSON 500 `internal_error`, as an ordinary
response: Starlette's last-resort handler would re-raise it after answering, and the server would then drop the
keep-alive connection under the client's next request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import numpy as np
from starlette.datastructures import Headers

from marl.protocol import ErrorCode
from servers.errors import Refusal, excerpt, refusal_response

log = logging.getLogger("marl.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: (ASGI scope, bearer token or None) -> why the request may not go on, or None when it may. What it admitted the
#: request as (a chat call's lease) it may leave in the scope for the route, so that nothing is checked twice.
Authorize = Callable[[Scope, str | None], Refusal | None]

#: Bodies above this are parsed in a worker thread (a smaller one parses in well under a millisecond).
PARSE_OFF_LOOP_BYTES = 64 * 2**10
#: JSON objects one body may hold: messages, content parts, tool calls, tools and their schemas. Thousands of
#: turns of a conversation fit; validating this many on the event loop takes a few hundred ms at most.
MAX_BODY_OBJECTS = 8192
#: How deep a body's arrays and objects may nest: a chat request is 5 levels, a tool's JSON schema a few more each.
MAX_BODY_DEPTH = 64
#: Token ids of the longest prompt a body must carry: a 128k-token context.
PROMPT_IDS_FIT = 2**17
#: Values beside such a prompt: every other field's keys and values (a completions call's usual ten take ~20).
OTHER_VALUES_FIT = 4096
#: JSON values one body may hold (every string, number, literal, key, array and object): a token-id prompt of a
#: 128k-token context fits, with its other fields. Parsing and validating this many valid values takes ~20 ms.
#: When all of them fail, pydantic listed 131,063 problems of a Responses `input` in 0.21 s (the GIL held, an idle
#: 2-core CPU; 262,144 took 1.2 s loaded), so the long lists of the request models fail fast
#: (`Field(fail_fast=True)`: the first bad item answers).
MAX_BODY_VALUES = PROMPT_IDS_FIT + OTHER_VALUES_FIT
#: A small body with more commas than this (values) is parsed and validated off the loop too, as a large one is.
INLINE_MAX_COMMAS = 2048
#: Scope key of a body the gate parsed (servers.http.routes' routes take it from there).
PARSED_JSON = "marl.parsed_json"
#: Scope key of when the gate first saw the request (`time.perf_counter()`): where the server's own time on it starts.
RECEIVED_AT = "marl.received_at"


def bearer_token(authorization: str | None) -> str | None:
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return None


class RequestGate:
    def __init__(self, app: ASGIApp, *, authorize: Authorize, max_body_bytes: int):
        self.app = app
        self.authorize = authorize
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[RECEIVED_AT] = time.perf_counter()
        headers = Headers(scope=scope)
        declared = _content_length(headers)
        refusal = self.authorize(scope, bearer_token(headers.get("authorization")))
        if refusal is None and declared is not None and declared > self.max_body_bytes:
            refusal = self._too_large(f"declares {declared} bytes")
        if refusal is not None:
            if declared is not None and declared <= self.max_body_bytes:
                await _drain(receive)  # a small body is read and dropped, so the connection stays usable
            await refusal_response(refusal)(scope, receive, send)
            return
        body = await self._read_body(receive)
        if body is not None and not isinstance(body, Refusal):
            body = await _parse_large(scope, body)
        if isinstance(body, Refusal):
            await refusal_response(body)(scope, receive, send)
        elif body is not None:
            await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | Refusal | None:
        """The whole body, a refusal once it passes the limit, or None if the client went away."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return self._too_large(f"sent more than {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, what: str) -> Refusal:
        limit_mb = self.max_body_bytes / 2**20
        return Refusal(413, ErrorCode.REQUEST_TOO_LARGE, f"the request body {what}; this server takes at most"
                       f" {self.max_body_bytes} bytes ({limit_mb:g} MiB, marl serve --max-body-mb)")


async def _parse_large(scope: Scope, body: bytes) -> bytes | Refusal:
    """Refuse a body too deep or with too many values; parse a large one off the event loop into the scope (refused
    if it holds too many objects)."""
    if len(body) <= PARSE_OFF_LOOP_BYTES and body.count(b",") <= INLINE_MAX_COMMAS:
        return shape_refusal(body) or body  # a small body is measured in well under a millisecond
    try:
        scope[PARSED_JSON] = await asyncio.to_thread(_bounded_json, body)
    except _Refused as refused:
        return refused.refusal
    except ValueError:  # not JSON: the route refuses it as any bad body (its parse stops where this one did)
        pass
    return body


class _Refused(Exception):
    def __init__(self, refusal: Refusal) -> None:
        self.refusal = refusal


def _too_many(what: str) -> Refusal:
    return Refusal(413, ErrorCode.REQUEST_TOO_LARGE, f"the request body holds more than {what}; this server takes at"
                   f" most {MAX_BODY_VALUES} JSON values (strings, numbers, keys, arrays) and {MAX_BODY_OBJECTS} JSON"
                   " objects (messages, content parts, tools)")


def _bounded_json(body: bytes) -> Any:
    """json.loads of a body whose shape passed (`shape_refusal`), which gives up at the MAX_BODY_OBJECTS + 1st
    object. The hook runs as Python between the decoder's objects, so the event loop's thread gets the GIL back every
    few ms while this thread parses."""
    refusal = shape_refusal(body)
    if refusal is not None:
        raise _Refused(refusal)
    count = 0

    def counted(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal count
        count += 1
        if count > MAX_BODY_OBJECTS:
            raise _Refused(_too_many(f"{MAX_BODY_OBJECTS} JSON objects"))
        return dict(pairs)

    return json.loads(body, object_pairs_hook=counted)


#: Every byte but the four brackets (what `bytes.translate` deletes to keep only those).
_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")


def shape_refusal(body: bytes) -> Refusal | None:
    """Why a body is refused before it is parsed (nested deeper than MAX_BODY_DEPTH, more than MAX_BODY_VALUES
    values), or None. Every step is one C pass over the bytes (a 16 MiB body: tens of ms each, the GIL free between
    them); what is not JSON is left to the parser to refuse."""
    opens = body.count(b"[") + body.count(b"{")
    if opens <= MAX_BODY_DEPTH and len(body) <= MAX_BODY_VALUES:  # cannot be too deep, nor hold too many values
        return None
    bare = body  # with its escapes gone, every quote left opens or closes a string
    if b"\\" in body:
        bare = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    strings = bare.count(b'"') // 2
    outside = b"".join(bare.split(b'"')[::2]) if strings else bare  # what lies outside the strings
    # Depth first: a body nested too deep is refused as that (naming its field), however many values it holds.
    if _depth(outside.translate(None, _NOT_BRACKETS)) > MAX_BODY_DEPTH:
        field = _too_deep_field(bare)
        return Refusal(400, ErrorCode.INVALID_REQUEST, f"the request body nests arrays and objects more than"
                       f" {MAX_BODY_DEPTH} levels deep{'' if field is None else ' in ' + excerpt(field)}; this server"
                       f" takes at most {MAX_BODY_DEPTH}", param=field)
    # Every value but the first of an array or object follows a comma or a colon; each array or object opens once.
    values = outside.count(b",") + outside.count(b":") + outside.count(b"[") + outside.count(b"{") + 1
    if max(strings, values) > MAX_BODY_VALUES:
        return _too_many(f"{MAX_BODY_VALUES} JSON values")
    return None


def _too_deep_field(bare: bytes) -> str | None:
    """The top-level key of the object `bare` (a body, its escapes removed) under which it first nests deeper than
    MAX_BODY_DEPTH; None when the body is not an object. Vectorised (a body over the depth is rare and hostile):
    each byte's depth is the running count of the brackets outside strings."""
    if not bare.lstrip().startswith(b"{"):
        return None
    raw = np.frombuffer(bare, dtype=np.uint8)
    outside = np.cumsum(raw == ord('"'), dtype=np.int32) % 2 == 0  # after an even number of quotes
    opens = (raw == ord("[")) | (raw == ord("{"))
    closes = (raw == ord("]")) | (raw == ord("}"))
    depth = np.cumsum((opens & outside).astype(np.int32) - (closes & outside))
    too_deep = int(np.argmax(depth > MAX_BODY_DEPTH))
    colons = np.flatnonzero((raw[:too_deep] == ord(":")) & outside[:too_deep] & (depth[:too_deep] == 1))
    if not len(colons):
        return None
    close = bare.rfind(b'"', 0, int(colons[-1]))  # the key's closing quote, then its opening one
    return bare[bare.rfind(b'"', 0, close) + 1:close].decode(errors="replace")


def _depth(brackets: bytes) -> int:
    """The deepest a parser gets in `brackets` (only []{} characters): the running count's maximum."""
    if len(brackets) <= MAX_BODY_DEPTH:
        return len(brackets)
    steps = (np.frombuffer(brackets, dtype=np.uint8) & 2).astype(np.int32) - 1  # [ { have bit 1 set: +1; ] }: -1
    return int(np.cumsum(steps).max())


def _content_length(headers: Headers) -> int | None:
    try:
        return int(headers["content-length"])
    except (KeyError, ValueError):
        return None


async def _drain(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the body already read, then whatever the connection says next (a disconnect)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if delivered:
            return await receive()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class CatchUnexpected:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:  # the status line is out: all that is left is to drop the connection
                raise
            log.exception("unexpected error answering %s %s", scope.get("method"), scope.get("path"))
            refusal = Refusal(500, ErrorCode.INTERNAL_ERROR, f"internal server error: {type(exc).__name__}: {exc}")
            await refusal_response(refusal)(scope, receive, tracked)
