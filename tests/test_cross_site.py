"""No cross-site requests: every write must declare a JSON body (415 otherwise), so a page on
another origin can neither send one unasked (no-cors, text/plain or a form's types) nor get the
CORS preflight a JSON request needs. httpx cases, then a real Chromium on a second origin
against the default server (no API keys)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.conftest import RunningServer, free_port
from tests.gateway_helpers import chat_body, completion_body
from tests.openapi_schema import validate
from tests.test_dashboard import chromium

TIMEOUT = httpx.Timeout(300.0)
JSON_WRITES = [
    ("/v1/chat/completions", chat_body(max_tokens=1)),
    ("/v1/completions", completion_body(max_tokens=1)),
    ("/tokenize", {"prompt": "x"}),
    ("/detokenize", {"tokens": [2]}),
    ("/api/loadgen/start", {"users": 1, "num_requests": 1, "max_tokens": 1}),
    ("/api/loadgen/stop", {}),
]
NOT_JSON = [
    ("text/plain", "text/plain"),
    ("text/plain;charset=UTF-8", "text/plain;charset=UTF-8"),
    ("form", "application/x-www-form-urlencoded"),
    ("multipart", "multipart/form-data; boundary=x"),
    ("json-ish text", "text/json"),
    ("missing", None),
]


def _post(server: RunningServer, path: str, body: bytes, content_type: str | None):
    # httpx sends no Content-Type for raw bytes unless told, as `curl --data-binary` without -H.
    headers = {"content-type": content_type} if content_type else {}
    return httpx.post(server.base_url + path, content=body, headers=headers, timeout=TIMEOUT)


def _stop_loadgen(server: RunningServer) -> None:
    httpx.post(server.base_url + "/api/loadgen/stop", json={}, timeout=TIMEOUT)


@pytest.mark.parametrize(("path", "body"), JSON_WRITES, ids=[w[0] for w in JSON_WRITES])
@pytest.mark.parametrize(("kind", "content_type"), NOT_JSON, ids=[n[0] for n in NOT_JSON])
def test_a_write_without_a_json_content_type_is_a_415(
    server: RunningServer, path: str, body: dict, kind: str, content_type: str | None
) -> None:
    response = _post(server, path, json.dumps(body).encode(), content_type)
    assert response.status_code == 415, response.text
    payload = response.json()
    validate(payload, "ErrorResponse")
    got = repr(content_type) if content_type else "no Content-Type header"
    assert payload == {
        "error": {
            "message": f"Content-Type must be application/json; got {got}. Send the body as "
            "JSON with the header `Content-Type: application/json` (curl: -H 'Content-Type: "
            "application/json').",
            "type": "invalid_request_error",
            "param": None,
            "code": "unsupported_media_type",
        }
    }


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                     "application/vnd.api+json"],
)  # fmt: skip
def test_json_content_types_are_served(server: RunningServer, content_type: str) -> None:
    body = json.dumps(completion_body(max_tokens=1)).encode()
    response = _post(server, "/v1/completions", body, content_type)
    assert response.status_code == 200, response.text
    stop = _post(server, "/api/loadgen/stop", b"{}", content_type)
    assert stop.status_code == 200, stop.text


# ------------------------------------------------------------------ a page on another origin

ATTACKS = """async (target) => {
    const results = {};
    const attempt = async (name, url, init) => {
        try {
            const response = await fetch(target + url, init);
            results[name] = response.type + " " + response.status;
        } catch (err) {
            results[name] = "refused: " + err.name;
        }
    };
    const completion = JSON.stringify({model: "gemma-3-270m", prompt: "pwned", max_tokens: 4});
    const load = JSON.stringify({users: 1, num_requests: 1000, max_tokens: 4});
    const chat = JSON.stringify({model: "gemma-3-270m", max_tokens: 4,
                                 messages: [{role: "user", content: "pwned"}]});
    // Simple requests: sent without asking, the answer unreadable (opaque).
    await attempt("completions text/plain", "/v1/completions", {method: "POST", mode: "no-cors",
        headers: {"Content-Type": "text/plain"}, body: completion});
    await attempt("loadgen text/plain", "/api/loadgen/start", {method: "POST", mode: "no-cors",
        headers: {"Content-Type": "text/plain"}, body: load});
    await attempt("chat form", "/v1/chat/completions", {method: "POST", mode: "no-cors",
        body: new URLSearchParams({[chat]: ""})});
    // JSON needs a CORS preflight, which the server does not grant.
    await attempt("completions json", "/v1/completions", {method: "POST",
        headers: {"Content-Type": "application/json"}, body: completion});
    await attempt("loadgen json", "/api/loadgen/start", {method: "POST",
        headers: {"Content-Type": "application/json"}, body: load});
    return results;
}"""


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<!doctype html><title>elsewhere</title><p>another site</p>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def other_origin() -> Iterator[str]:
    """A second origin: a plain HTTP server on another port of the same host."""
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), _Page)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _prompt_tokens_total(server: RunningServer) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=TIMEOUT).text
    counts = re.findall(r"^gemma_serve:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return sum(float(count) for count in counts)


def test_a_page_on_another_origin_cannot_generate_or_drive_load(
    server: RunningServer, other_origin: str, tmp_path
) -> None:
    _stop_loadgen(server)
    admitted_before = server.log().count("generation admitted")
    refused_before = server.log().count("unsupported_media_type")
    tokens_before = _prompt_tokens_total(server)
    try:
        with chromium(tmp_path) as browser:
            page = browser.new_page()
            page.goto(other_origin + "/")
            results = page.evaluate(ATTACKS, server.base_url)
        # The simple requests went out (opaque answers), the JSON ones never left the browser.
        assert results == {
            "completions text/plain": "opaque 0",
            "loadgen text/plain": "opaque 0",
            "chat form": "opaque 0",
            "completions json": "refused: TypeError",
            "loadgen json": "refused: TypeError",
        }, results
        status = httpx.get(server.base_url + "/api/loadgen/status", timeout=TIMEOUT).json()
        assert status["state"] != "running", status
        log = server.log()
        assert log.count("unsupported_media_type") - refused_before == 3  # refused, not lost
        assert log.count("generation admitted") == admitted_before
        assert _prompt_tokens_total(server) == tokens_before
    finally:
        _stop_loadgen(server)
