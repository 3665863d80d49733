"""``TrieBeamSearchGuard``, the ASGI middleware for ``vllm serve --middleware``: vLLM's server-side beam search
drops ``vllm_xargs``, so a beam-search request that asks for a trie is refused with HTTP 400 instead of answered with
unconstrained text; every other request reaches the app with the same body bytes. Driven directly with fake ASGI
``scope``/``receive``/``send`` (no server; tests/test_vllm_serve.py runs it in a real ``vllm serve``)."""

from __future__ import annotations

import asyncio
import json

import pytest

from trie_decode.integrations.vllm_requests import TrieBeamSearchGuard, beam_search_refusal

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def _scope(path=COMPLETIONS, method="POST", root_path="", headers=None):
    return {"type": "http", "method": method, "path": path, "root_path": root_path,
            "headers": headers if headers is not None else [(b"content-type", b"application/json")]}


def _run(scope, chunks, max_body_bytes=None):
    """Run the guard around a fake app that reads the whole body. Returns (status, response JSON, app's view)."""
    seen = {}

    async def app(scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                seen["disconnect"] = True
                break
            body += message.get("body", b"")
            more = message.get("more_body", False)
        seen["body"] = body
        seen["after"] = (await receive())["type"]  # vLLM listens for the disconnect: the client's own receive
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    incoming.append({"type": "http.disconnect"})
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    guard = TrieBeamSearchGuard(app)
    if max_body_bytes is not None:
        guard.max_body_bytes = max_body_bytes
    asyncio.run(guard(scope, receive, send))
    status = sent[0]["status"]
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    return status, json.loads(payload), seen


def _body(xargs=None, beam=True, chat=False, **extra):
    body = {"model": "smol", "max_tokens": 4, "n": 4, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    if beam is not None:
        body["use_beam_search"] = beam
    if xargs is not None:
        body["vllm_xargs"] = xargs
    return json.dumps(body).encode()


CONSTRAINED = [
    {"trie": "colors"},
    {"trie": ["red", "green"]},
    {"trie": json.dumps([[1, 2], [3]])},  # the JSON-string form of an inline list (values cannot nest over HTTP)
    {"trie": json.dumps(["red", "green"]), "leading_space": True},
    {"spans": json.dumps([{"after": "Color: ", "values": ["red", "green"], "end": "\n"}])},
    {"template": '{"color": "{color}"}', "slots": json.dumps({"color": ["red", "green"]})},
]


@pytest.mark.parametrize("path, chat", [(COMPLETIONS, False), (CHAT, True), ("/invocations", False)])
@pytest.mark.parametrize("xargs", CONSTRAINED, ids=["named", "strings", "json-ids", "json-strings", "spans",
                                                   "template"])
def test_beam_search_with_a_constraint_is_refused(path, chat, xargs):
    status, body, seen = _run(_scope(path), [_body(xargs, chat=chat)])
    assert status == 400 and seen == {}, (status, body)  # the app never ran
    error = body["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] == "use_beam_search"
    message = error["message"]
    assert message.startswith("use_beam_search cannot be combined with vllm_xargs '")
    assert "would not be constrained" in message and "trie_decode.integrations.vllm_beam" in message
    assert "beam_search()" in message and "async_beam_search()" in message and "raw_logprobs" in message


def test_the_refusal_is_vllms_error_response():
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    status, body, _ = _run(_scope(), [_body({"trie": "colors"})])
    assert ErrorResponse.model_validate(body).model_dump() == body


@pytest.mark.parametrize("beam", [True, 1, "true", "yes", "on"])
def test_every_form_vllm_reads_as_beam_search_is_refused(beam):
    assert beam_search_refusal(_body({"trie": "colors"}, beam=beam)) is not None


def test_refusal_names_the_keys_and_chunks_and_root_path_do_not_matter():
    body = _body({"spans": "[]", "template": "x"})
    status, out, _ = _run(_scope("/api/v1/completions", root_path="/api"), [body[:7], body[7:30], body[30:], b""])
    assert status == 400 and "vllm_xargs 'spans', 'template':" in out["error"]["message"]


@pytest.mark.parametrize("xargs, match", [
    ({"tries": "colors"}, "did you mean 'trie'"),
    ({"on_complete": "repeat"}, "none of 'trie', 'spans', 'template'"),
])
def test_trie_options_without_a_trie_are_refused_as_without_beam_search(xargs, match):
    status, body, _ = _run(_scope(), [_body(xargs)])
    assert status == 400 and match in body["error"]["message"], body


CHAT_BEAM = _body(chat=True)
TRIE_ONLY = _body({"trie": "colors"}, beam=None)
PASSED = {
    "no beam search": (_scope(), [_body({"trie": "colors"}, beam=None)]),
    "beam search off": (_scope(), [_body({"trie": "colors"}, beam=False)]),
    "beam search 'false'": (_scope(), [_body({"trie": "colors"}, beam="false")]),
    "beam search 0": (_scope(), [_body({"trie": "colors"}, beam=0)]),
    "beam search, no xargs": (_scope(), [_body()]),
    "beam search, other processors' xargs": (_scope(), [_body({"allow": "a", "prefix": [1]})]),
    "beam search, empty xargs": (_scope(), [_body({})]),
    "beam search, xargs not an object": (_scope(), [_body("{\"trie\": \"colors\"}")]),
    "chat, no beam search": (_scope(CHAT), [_body({"trie": "colors"}, beam=None, chat=True)]),
    "GET": (_scope(method="GET"), [b""]),
    "other path": (_scope("/v1/completions/render"), [_body({"trie": "colors"})]),
    "tokenize": (_scope("/tokenize"), [_body({"trie": "colors"})]),
    "not JSON": (_scope(), [b"use_beam_search=1&vllm_xargs=trie"]),
    "truncated JSON": (_scope(), [_body({"trie": "colors"})[:-1]]),
    "JSON array": (_scope(), [b'[{"use_beam_search": true, "vllm_xargs": {"trie": "x"}}]']),
    "invalid UTF-8": (_scope(), [b'{"prompt": "\xff\xfe", "use_beam_search": true}']),
    "empty body": (_scope(), [b""]),
    "chunked": (_scope(CHAT), [CHAT_BEAM[:1], CHAT_BEAM[1:50], b"", CHAT_BEAM[50:]]),
    "chunked, no beam search": (_scope(), [TRIE_ONLY[:20], TRIE_ONLY[20:]]),
}


@pytest.mark.parametrize("case", PASSED)
def test_everything_else_reaches_the_app_with_the_same_body(case):
    scope, chunks = PASSED[case]
    status, _, seen = _run(scope, chunks)
    assert status == 200
    assert seen["body"] == b"".join(chunks)
    assert seen["after"] == "http.disconnect"  # then the client's own messages


def test_a_body_over_the_bound_is_passed_on_unchecked(caplog):
    body = _body({"trie": "colors"})
    # Announced by Content-Length: not read at all.
    scope = _scope(headers=[(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())])
    with caplog.at_level("WARNING", logger="trie_decode.vllm"):
        status, _, seen = _run(scope, [body[:10], body[10:]], max_body_bytes=len(body) - 1)
    assert status == 200 and seen["body"] == body and "passed on without checking" in caplog.text
    # Chunked without a length: what was read is replayed, the rest comes from the client.
    status, _, seen = _run(_scope(), [body[:10], body[10:20], body[20:]], max_body_bytes=15)
    assert status == 200 and seen["body"] == body


def test_a_client_that_goes_away_mid_body_is_the_apps_to_see():
    seen = {}

    async def app(scope, receive, send):
        seen["messages"] = [await receive(), await receive()]

    incoming = [{"type": "http.request", "body": b'{"use_beam', "more_body": True}, {"type": "http.disconnect"}]

    async def receive():
        return incoming.pop(0)

    async def send(message):
        raise AssertionError(message)

    asyncio.run(TrieBeamSearchGuard(app)(_scope(), receive, send))
    assert [m["type"] for m in seen["messages"]] == ["http.request", "http.disconnect"]


def test_lifespan_and_websocket_scopes_pass():
    calls = []

    async def app(scope, receive, send):
        calls.append(scope["type"])

    async def never():
        raise AssertionError("the guard must not read these")

    for kind in ("lifespan", "websocket"):
        asyncio.run(TrieBeamSearchGuard(app)({"type": kind, "path": COMPLETIONS}, never, never))
    assert calls == ["lifespan", "websocket"]


def test_fastapi_add_middleware_and_a_json_route_read_the_body():
    """The way vLLM loads a ``--middleware`` class (``app.add_middleware(cls)``), in front of a FastAPI route that
    parses the body as vLLM's do."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from fastapi.testclient import TestClient

    async def completions(request):
        return JSONResponse({"got": await request.json()})

    app = FastAPI()
    app.add_middleware(TrieBeamSearchGuard)
    app.add_route(COMPLETIONS, completions, methods=["POST"])

    with TestClient(app) as client:
        sent = {"model": "smol", "prompt": "Hi", "use_beam_search": True, "n": 2}
        ok = client.post(COMPLETIONS, json=sent)
        assert ok.status_code == 200 and ok.json() == {"got": sent}
        refused = client.post(COMPLETIONS, json={**sent, "vllm_xargs": {"trie": "colors"}})
        assert refused.status_code == 400 and refused.headers["content-type"] == "application/json"
        assert refused.json()["error"]["message"].startswith("use_beam_search cannot be combined")
