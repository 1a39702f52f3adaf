"""The server's door: strict wire types (a 400 naming the field), nothing escaping as a bare 500,
and the bounded waiting queue (503 with Retry-After)."""

import asyncio
import logging

import httpx
import pytest
from conftest import make_llm

from picovllm.entrypoints.openai.async_engine import AsyncEngine
from picovllm.entrypoints.openai.server import build_app, serve_in_thread

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tiny_qwen):
    engine = AsyncEngine(make_llm(tiny_qwen[0], max_model_len=256).llm_engine)
    url, stop = serve_in_thread(build_app(engine, "tiny"))
    yield url, engine
    stop()
    engine.shutdown()


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {**COMPLETION, "top_p": True}, "top_p"),  # (a boolean is no number)
        ("/v1/completions", {**COMPLETION, "n": "2"}, "n"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 2.0}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "stream": "yes"}, "stream"),
        ("/v1/completions", {**COMPLETION, "prompt": ["1", 2]}, "prompt.0"),
        ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ("/v1/chat/completions", {**CHAT, "add_generation_prompt": 0}, "add_generation_prompt"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
        ("/detokenize", {"tokens": ["1", "2"]}, "tokens.0"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": 7}, "prompt"),
    ],
)
def test_a_wrongly_typed_field_is_a_400_naming_it(server, path, body, param):
    r = httpx.post(server[0] + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["type"] == "BadRequestError"


def test_the_right_types_pass_and_unknown_fields_are_ignored_and_logged_once(server, caplog):
    url = server[0]
    with caplog.at_level(logging.INFO, logger="picovllm"):
        for _ in range(2):
            body = {**COMPLETION, "top_p": 1, "temperature": 0, "logit_bias": {}, "some_new_field": 3}
            assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
    assert sum("'some_new_field'" in r.message for r in caplog.records) == 1
    tokens = httpx.post(url + "/tokenize", json={"messages": CHAT["messages"]}).json()["tokens"]
    assert httpx.post(url + "/detokenize", json={"tokens": tokens}).status_code == 200


def test_an_exception_escaping_a_route_is_an_openai_500(server, monkeypatch):
    url, engine = server

    def broken(*args, **kwargs):
        raise RuntimeError("the tokenizer broke")

    monkeypatch.setattr(engine.tokenizer, "encode", broken)
    r = httpx.post(url + "/tokenize", json={"prompt": "Hi"})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"] == {
        "message": "internal error: RuntimeError: the tokenizer broke",
        "type": "internal_error",
        "param": None,
        "code": 500,
    }
    monkeypatch.undo()
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30).status_code == 200


def test_beyond_max_num_waiting_a_request_gets_503_and_retry_after(tiny_qwen):
    engine = AsyncEngine(make_llm(tiny_qwen[0], max_num_seqs=1, max_model_len=256).llm_engine)
    url, stop = serve_in_thread(build_app(engine, "tiny", max_num_waiting=2))
    long = {**COMPLETION, "max_tokens": 60, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(url + "/v1/completions", json=long) for _ in range(8)))

    try:
        answers = asyncio.run(burst())
        codes = sorted(a.status_code for a in answers)
        assert codes.count(200) >= 3 and codes.count(503) >= 1 and set(codes) == {200, 503}
        refused = next(a for a in answers if a.status_code == 503)
        assert refused.headers["retry-after"] == "1" and refused.json()["error"]["type"] == "ServiceUnavailableError"
        metrics = httpx.get(url + "/metrics").text
        assert f"picovllm:request_rejected_total {float(codes.count(503))}" in metrics
        assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30).status_code == 200  # (room again)
    finally:
        stop()
        engine.shutdown()
