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


# --- the speech-to-text routes: form fields ------------------------------------------------------------------------

TRANSCRIPTIONS, TRANSLATIONS = "/v1/audio/transcriptions", "/v1/audio/translations"
BOUNDARY = "trie-decode-boundary"


def _form(fields, boundary=BOUNDARY):
    """A multipart/form-data body as OpenAI's audio clients send it: the fields, then the audio file."""
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
             for name, value in fields]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                 "Content-Type: audio/wav\r\n\r\n")
    return "".join(parts).encode() + b"RIFF\x00\x01\xff" + f"\r\n--{boundary}--\r\n".encode()


def _form_scope(path=TRANSCRIPTIONS, content_type=f"multipart/form-data; boundary={BOUNDARY}"):
    return _scope(path, headers=[(b"content-type", content_type.encode())])


FORM_TRIE = [("model", "whisper"), ("use_beam_search", "true"), ("n", "2"), ("vllm_xargs", '{"trie": "colors"}')]


@pytest.mark.parametrize("path", [TRANSCRIPTIONS, TRANSLATIONS])
@pytest.mark.parametrize("beam", ["true", "1", "on", "yes"])
def test_speech_to_text_beam_search_with_a_constraint_is_refused(path, beam):
    fields = [(k, beam if k == "use_beam_search" else v) for k, v in FORM_TRIE]
    body = _form(fields)
    status, out, seen = _run(_form_scope(path), [body[:40], body[40:]])
    assert status == 400 and seen == {}, (status, out)
    assert out["error"]["param"] == "use_beam_search"
    assert out["error"]["message"].startswith("use_beam_search cannot be combined with vllm_xargs 'trie'")


def test_speech_to_text_urlencoded_form_and_spans_are_refused():
    body = b"use_beam_search=true&vllm_xargs=" + json.dumps({"spans": "[]"}).replace(" ", "").encode()
    status, out, _ = _run(_form_scope(content_type="application/x-www-form-urlencoded"), [body])
    assert status == 400 and "vllm_xargs 'spans'" in out["error"]["message"], out


FORM_PASSED = {
    "no beam search": [("use_beam_search", "false"), ("vllm_xargs", '{"trie": "colors"}')],
    "beam search empty": [("use_beam_search", ""), ("vllm_xargs", '{"trie": "colors"}')],
    "beam search, no xargs": [("use_beam_search", "true")],
    "beam search, other xargs": [("use_beam_search", "true"), ("vllm_xargs", '{"allow": "a"}')],
    "beam search, xargs not JSON": [("use_beam_search", "true"), ("vllm_xargs", "{trie: colors}")],
    "last field wins": [("use_beam_search", "true"), ("vllm_xargs", '{"trie": "colors"}'), ("use_beam_search", "0")],
}


@pytest.mark.parametrize("case", FORM_PASSED)
def test_other_speech_to_text_requests_reach_the_app_with_the_same_body(case):
    body = _form(FORM_PASSED[case])
    status, _, seen = _run(_form_scope(), [body])
    assert status == 200 and seen["body"] == body and seen["after"] == "http.disconnect"


@pytest.mark.parametrize("scope, body", [
    (_form_scope(), _form(FORM_TRIE, boundary="other")),  # another boundary than the header's: no fields
    (_form_scope(content_type="multipart/form-data"), _form(FORM_TRIE)),  # no boundary: the parser fails
    (_scope(TRANSCRIPTIONS), json.dumps(dict(FORM_TRIE)).encode()),  # JSON: vLLM reads no form fields from it
], ids=["other boundary", "no boundary", "json"])
def test_a_form_vllm_cannot_read_is_left_to_vllm(scope, body):
    status, _, seen = _run(scope, [body])
    assert status == 200 and seen["body"] == body


def test_speech_to_text_beam_search_drops_vllm_xargs():
    """Why the audio routes are guarded: vLLM reads ``use_beam_search`` and ``vllm_xargs`` from the form, and its beam
    search parameters have no place for the latter (the sampling parameters do)."""
    import io

    from starlette.datastructures import UploadFile
    from vllm.entrypoints.speech_to_text.transcription.protocol import TranscriptionRequest
    from vllm.entrypoints.speech_to_text.translation.protocol import TranslationRequest
    from vllm.sampling_params import BeamSearchParams

    assert "extra_args" not in BeamSearchParams.__struct_fields__
    for cls in (TranscriptionRequest, TranslationRequest):
        request = cls.model_validate({"file": UploadFile(io.BytesIO(b"RIFF"), filename="a.wav"),
                                      "use_beam_search": "true", "vllm_xargs": '{"trie": "colors"}'})
        assert request.use_beam_search is True and request.vllm_xargs == {"trie": "colors"}
        assert isinstance(request.to_beam_search_params(8), BeamSearchParams)
        assert request.to_sampling_params(8).extra_args == {"trie": "colors"}


# --- vLLM's own app: --api-key answers first -----------------------------------------------------------------------

GUARD = "trie_decode.integrations.vllm_requests.TrieBeamSearchGuard"
KEY = "sekrit"


def _vllm_app(*flags, tasks=("generate", "transcription")):
    """vLLM's own server app (``build_app``, as ``vllm serve`` builds it), without an engine: the middleware runs,
    the routes would fail (no engine state), so only what answers before a route is observable."""
    from fastapi.testclient import TestClient
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(list(flags))
    return TestClient(build_app(args, supported_tasks=tasks), raise_server_exceptions=False)


BEAM_TRIE = {"model": "smol", "prompt": "Hi", "use_beam_search": True, "n": 2, "vllm_xargs": {"trie": "colors"}}
CHAT_TRIE = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "use_beam_search": True, "n": 2,
             "vllm_xargs": {"trie": "colors"}}
UNAUTHENTICATED = {"no header": {}, "wrong key": {"Authorization": "Bearer nope"},
                   "not bearer": {"Authorization": f"Basic {KEY}"}}


def _audio(client, headers):
    body = _form(FORM_TRIE)
    return client.post(TRANSCRIPTIONS, content=body,
                       headers={**headers, "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})


@pytest.fixture(scope="module")
def with_api_key():
    """vLLM's app with ``--api-key`` and the guard, and the same app without the guard (what vLLM answers alone)."""
    return _vllm_app("--api-key", KEY, "--middleware", GUARD), _vllm_app("--api-key", KEY)


@pytest.mark.parametrize("who", UNAUTHENTICATED)
def test_an_unauthenticated_request_gets_vllms_401_not_the_guards_400(with_api_key, who):
    guarded, alone = with_api_key
    headers = UNAUTHENTICATED[who]
    for send in (lambda c: c.post(COMPLETIONS, json=BEAM_TRIE, headers=headers),
                 lambda c: c.post(CHAT, json=CHAT_TRIE, headers=headers),
                 lambda c: _audio(c, headers)):
        got, expected = send(guarded), send(alone)
        assert got.status_code == expected.status_code == 401, got.text
        assert got.json() == expected.json() == {"error": "Unauthorized"}


def test_an_authenticated_request_is_refused_by_the_guard(with_api_key):
    guarded, _ = with_api_key
    auth = {"Authorization": f"Bearer {KEY}"}
    for response in (guarded.post(COMPLETIONS, json=BEAM_TRIE, headers=auth),
                     guarded.post(CHAT, json=CHAT_TRIE, headers=auth), _audio(guarded, auth)):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"].startswith("use_beam_search cannot be combined with vllm_xargs")


def test_a_route_vllms_api_key_does_not_guard_is_refused_without_a_key(with_api_key):
    """vLLM checks the key only under /v1, /v2, /inference, /cohere: /invocations runs without one, so the guard
    refuses there whatever the headers (vLLM's own rule decides, not a copy of it)."""
    guarded, _ = with_api_key
    response = guarded.post("/invocations", json=BEAM_TRIE)
    assert response.status_code == 400 and response.json()["error"]["param"] == "use_beam_search", response.text


def test_without_api_key_the_guard_refuses():
    response = _vllm_app("--middleware", GUARD).post(COMPLETIONS, json=BEAM_TRIE)
    assert response.status_code == 400, response.text


def test_on_an_unverified_vllm_the_guard_refuses_before_the_api_key(monkeypatch):
    """The safe fallback: a vLLM whose layout is not known is not asked; the request is refused (400, not 401)."""
    from trie_decode.integrations import vllm_internals

    monkeypatch.setattr(vllm_internals, "fast_paths", lambda: False)
    response = _vllm_app("--api-key", KEY, "--middleware", GUARD).post(COMPLETIONS, json=BEAM_TRIE)
    assert response.status_code == 400, response.text


def test_an_api_key_check_the_guard_cannot_reach_is_not_asked():
    """A layer without ``.app`` between the guard and vLLM's check: the layout is unknown, the guard refuses."""
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    async def app(scope, receive, send):
        raise AssertionError("a refused request reached the app")

    class Opaque:
        def __init__(self, inner):
            self._inner = inner

        async def __call__(self, scope, receive, send):
            await self._inner(scope, receive, send)

    for chain, expected in [(AuthenticationMiddleware(app, tokens=[KEY]), 401),
                            (Opaque(AuthenticationMiddleware(app, tokens=[KEY])), 400)]:
        sent = []
        incoming = [{"type": "http.request", "body": _body({"trie": "colors"}), "more_body": False}]

        async def receive():
            return incoming.pop(0) if incoming else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        asyncio.run(TrieBeamSearchGuard(chain)(_scope(), receive, send))
        assert sent[0]["status"] == expected


def test_every_vllm_route_that_takes_beam_search_and_xargs_is_guarded():
    """Derived from vLLM's own app: a POST route whose request model has both ``use_beam_search`` and ``vllm_xargs``
    is guarded, or is one that refuses beam search itself. A new such route in a vLLM update fails here."""
    from fastapi.routing import APIRoute
    from vllm.tasks import GENERATION_TASKS, POOLING_TASKS

    from trie_decode.integrations.vllm_requests import BEAM_SEARCH_ROUTES

    refuses_itself = {"/v1/chat/completions/batch", "/v1/chat/completions/render", "/v1/completions/render"}
    app = _vllm_app(tasks=GENERATION_TASKS + POOLING_TASKS + ("render",)).app
    taking = set()
    for route in app.routes:
        if isinstance(route, APIRoute) and "POST" in route.methods:
            for param in route.dependant.body_params:
                fields = getattr(param.field_info.annotation, "model_fields", {})
                if "use_beam_search" in fields and "vllm_xargs" in fields:
                    taking.add(route.path)
    assert {TRANSCRIPTIONS, TRANSLATIONS, COMPLETIONS, CHAT} <= taking
    assert taking - refuses_itself <= BEAM_SEARCH_ROUTES, taking - refuses_itself - BEAM_SEARCH_ROUTES
