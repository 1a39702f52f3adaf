"""The server's door: strict wire types (a 400 naming the field), nothing escaping as a bare 500,
and the bounded waiting queue (503 with Retry-After)."""

import asyncio
import logging
import time

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
        ("/v1/completions", {**COMPLETION, "prompt": [10**6]}, "prompt"),  # (out of the vocabulary)
        ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 10**6}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 10**6}, "max_tokens"),
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
    """One sequence runs at a time and two may wait: with three streams open, a fourth request is
    refused; once they are done, requests are taken again."""
    engine = AsyncEngine(make_llm(tiny_qwen[0], max_num_seqs=1, max_model_len=1024).llm_engine)
    url, stop = serve_in_thread(build_app(engine, "tiny", max_num_waiting=2))
    long = {**COMPLETION, "max_tokens": 1000, "ignore_eos": True, "stream": True}  # (seconds on the CPU)

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            streams = [client.stream("POST", "/v1/completions", json=long) for _ in range(3)]
            responses = [await s.__aenter__() for s in streams]
            assert [r.status_code for r in responses] == [200, 200, 200]
            lines = responses[0].aiter_lines()  # (kept: a dropped iterator closes its stream)
            await lines.__anext__()  # (the first one runs)
            while engine.get_metrics()["num_waiting"] < 2:  # (and the engine has the other two)
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/completions", json=COMPLETION)
            for s in streams:
                await s.__aexit__(None, None, None)  # (disconnect: they are aborted)
            return refused

    try:
        refused = asyncio.run(scenario())
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "ServiceUnavailableError"
        assert "picovllm:request_rejected_total 1.0" in httpx.get(url + "/metrics").text
        deadline = time.monotonic() + 10
        while engine.num_open_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30).status_code == 200  # (room again)
    finally:
        stop()
        engine.shutdown()
