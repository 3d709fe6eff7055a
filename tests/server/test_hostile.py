"""Hostile and malformed requests against the real server (uvicorn on loopback): every failure is an
OpenAI-shaped error with the right status, never a 500 or a dropped connection, and the server keeps serving."""

import httpx
import pytest

from test_server import KEY, MODEL, start_server

H = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    proc, base, _ = start_server(tiny_model_dir, "--num-pages", "256", "--max-num-seqs", "16")
    yield base
    proc.terminate()
    proc.wait(timeout=30)


def assert_openai_error(r, status, fragment=""):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert err["type"] and fragment in err["message"], err
    return err


def still_serves(base):
    r = httpx.post(base + "/v1/completions", headers=H, json={"model": MODEL, "prompt": "y", "max_tokens": 2})
    assert r.status_code == 200, r.text


RAW = [  # (raw body bytes, fragment)
    (b"{not json", "malformed"),
    (b'{"model": "tiny", "prompt": "\xff\xfe bad utf-8"}', "malformed"),
    (b'{"model": "tiny", "prompt": "lone \\ud800 surrogate"}', "surrogate"),
    (b'{"model": "tiny", "prompt": "x", "stop": ["\\udfff"]}', "surrogate"),
    (b"[1, 2, 3]", "invalid request"),
    (b"", "invalid request"),
]


@pytest.mark.parametrize("content,fragment", RAW)
def test_malformed_bodies_are_400(srv, content, fragment):
    r = httpx.post(srv + "/v1/completions", content=content, headers=H, timeout=10)
    assert_openai_error(r, 400, fragment)
    still_serves(srv)


def test_lone_surrogate_in_a_chat_message_is_400(srv):
    content = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud83d"}]}'
    r = httpx.post(srv + "/v1/chat/completions", content=content, headers=H, timeout=10)
    assert_openai_error(r, 400, "surrogate")


def test_unknown_route_and_wrong_method(srv):
    assert_openai_error(httpx.get(srv + "/v1/nope", headers=H), 404, "/v1/nope")
    assert_openai_error(httpx.get(srv + "/nope"), 404)
    err = assert_openai_error(httpx.get(srv + "/v1/completions", headers=H), 405, "GET")
    assert err["type"] == "invalid_request_error"
    assert_openai_error(httpx.delete(srv + "/v1/chat/completions", headers=H), 405)


def test_a_500_carries_no_internal_text(tiny_model_dir):
    import time

    from fastapi.testclient import TestClient

    from specmla import LLM
    from specmla.server.app import create_app

    def load():
        llm = LLM(tiny_model_dir, device="cpu")

        def broken(*a, **k):
            raise RuntimeError(f"secret detail {tiny_model_dir}")

        llm.tokenizer.encode = broken
        return llm

    with TestClient(create_app(load, MODEL), raise_server_exceptions=False) as c:
        deadline = time.time() + 30
        while c.get("/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.05)
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        err = assert_openai_error(r, 500)
        assert "secret" not in r.text and str(tiny_model_dir) not in r.text
        assert err["type"] == "server_error"
