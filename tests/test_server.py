"""The OpenAI-compatible server on a tiny model, on a free loopback port, driven by the official
openai client and raw HTTP."""

import asyncio
import dataclasses
import json
import time

import httpx
import pytest
from conftest import engine_args, make_llm

openai = pytest.importorskip("openai")

import picovllm  # noqa: E402
from picovllm import LLM, RequestOutputKind, SamplingParams  # noqa: E402
from picovllm.entrypoints.openai.async_engine import AsyncEngine, EngineProcess  # noqa: E402
from picovllm.entrypoints.openai.server import build_app, serve_in_thread  # noqa: E402

MODEL = "tiny"
KEY = "sk-test"


@pytest.fixture(scope="module", params=["sync", "async_scheduling", "engine_process", "engine_process_tp2"])
def server(tiny_qwen, request):
    """(URL, the served LLMEngine (None when it runs in a process of its own), a separate LLM of
    the same model for expected outputs, the background engine). The served engine belongs to the
    server's engine thread or process. Its 16-token budget and 16 sequences make prompts go in
    chunks beside other streams' decodes, and requests queue; every test runs against the
    synchronous engine, one with async scheduling, and (the server's default) the engine in a
    process of its own, with async scheduling, and that with tensor_parallel_size 2."""
    args = engine_args(
        tiny_qwen[0],
        max_model_len=256,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=16,
        async_scheduling=request.param != "sync",
        tensor_parallel_size=2 if request.param.endswith("tp2") else 1,
    )
    if request.param.startswith("engine_process"):
        llm_engine, engine = None, EngineProcess(args)
    else:
        llm_engine = LLM(**args).llm_engine
        engine = AsyncEngine(llm_engine)
    url, stop = serve_in_thread(build_app(engine, MODEL, api_key=KEY))
    yield url, llm_engine, make_llm(tiny_qwen[0], max_model_len=256, block_size=4), engine
    stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def test_completion_matches_llm_generate(server, client):
    llm = server[2]
    prompts = ["The capital of France is", "def add(a, b):"]
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    resp = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in resp.choices] == [o.outputs[0].text for o in expected]
    assert [c.finish_reason for c in resp.choices] == ["length", "length"]
    assert resp.usage.completion_tokens == 16
    assert resp.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)


def test_streaming_equals_non_streaming_and_holds_back_stop_text(client):
    free = (
        client.completions.create(
            model=MODEL, prompt="Hello world", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = free[6:9]
    assert stop
    full = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    ).choices[0]
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Hello world",
            max_tokens=24,
            temperature=0,
            stop=[stop],
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == full.text == free[: free.index(stop)]
    assert all(stop not in c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_stops_the_engine_computing_the_request(server, client, stream):
    """Stop strings are found where the text is decoded (the server's OutputProcessor, in its HTTP
    process when the engine runs apart), and the engine is told to stop: it computes a few steps
    past the stop, not the 200 tokens asked for, and frees the request's blocks."""
    background = server[3]
    free = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    stop = text[6:9]
    steps = background.get_metrics()["num_steps"]
    resp = client.completions.create(
        model=MODEL,
        prompt="Hello world",
        max_tokens=200,
        n=2,
        temperature=0,
        stop=[stop],
        stream=stream,
        extra_body={"ignore_eos": True},
    )
    chunks = [ch for c in resp for ch in c.choices] if stream else resp.choices
    texts = ["".join(c.text for c in chunks if c.index == i) for i in range(2)]
    assert texts == [text[: text.index(stop)]] * 2
    assert sorted(c.finish_reason for c in chunks if c.finish_reason) == ["stop", "stop"]
    deadline = time.time() + 10
    while time.time() < deadline and background.get_metrics()["num_running"]:
        time.sleep(0.02)
    m = background.get_metrics()
    assert m["num_running"] == m["num_waiting"] == 0
    assert m["num_steps"] - steps < 24 + 24  # (the free run's 24 tokens at most, twice)
    assert m["kv_blocks_free"] + m["kv_blocks_cached"] == m["kv_blocks_total"]


def test_a_request_whose_output_cannot_be_read_fails_alone(server, unreadable_seed):
    """Reading a request's output raises (conftest's unreadable_seed) where the server reads it:
    that request ends with an error (a stream's error event, a plain request's 500) and is aborted
    in the engine; a request beside it is served in full; nothing is left running or held."""
    url, _, llm, background = server
    good = {"prompt": "Hello world", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    bad = {**good, "temperature": 1.0, "seed": unreadable_seed}
    expected = llm.generate(
        "Hello world", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False
    )

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
            ok = asyncio.create_task(c.post("/v1/completions", json=good))
            failed = await c.post("/v1/completions", json=bad)
            async with c.stream("POST", "/v1/completions", json={**bad, "stream": True}) as r:
                events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return await ok, failed, events

    ok, failed, events = asyncio.run(scenario())
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == expected[0].outputs[0].text
    assert failed.status_code == 500 and "could not be read" in failed.json()["error"]["message"]
    assert "could not be read" in events[-1] and '"error"' in events[-1]
    deadline = time.time() + 10
    while time.time() < deadline and background.get_metrics()["num_running"]:
        time.sleep(0.02)
    m = background.get_metrics()
    assert m["num_running"] == m["num_waiting"] == 0
    assert m["kv_blocks_free"] + m["kv_blocks_cached"] == m["kv_blocks_total"]
    assert not background.reader.groups


@pytest.mark.parametrize("extra", [{}, {"stop": ["a", " t"]}, {"echo": True}])
def test_streamed_completion_logprobs_equal_the_whole_answers(client, extra):
    """Tokens, log-probabilities and text offsets, streamed or not, for a random model's output of
    split characters (held back until complete) and stop strings' text (held back until known)."""
    kwargs = dict(model=MODEL, prompt=[205, 180, 175], max_tokens=15, temperature=0, logprobs=2, **extra)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    tokens, lps, offsets = [], [], []
    for chunk in client.completions.create(**kwargs, stream=True):
        lp = chunk.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            lps += lp.token_logprobs
            offsets += lp.text_offset
    assert len(whole.tokens) > 5 and len(set(whole.tokens)) > 3
    assert (tokens, lps, offsets) == (whole.tokens, whole.token_logprobs, whole.text_offset)


def test_chat_stream_and_usage(client):
    msgs = [{"role": "user", "content": "Hello"}]
    full = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []


def test_n_seed_and_logprobs(client):
    kw = dict(model=MODEL, prompt="Hello", max_tokens=8, temperature=1.0, n=3, seed=7, extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) == 3 and [c.index for c in a.choices] == [0, 1, 2]
    lp = (
        client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .logprobs
    )
    assert len(lp.token_logprobs) == 3 and all(x <= 0 for x in lp.token_logprobs)
    # text_offset: where each token's text starts in the choice's text (with echo the prompt's tokens
    # come first, from 0; then the generated ones, from the prompt's end)
    kw = dict(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    echoed = client.completions.create(**kw, echo=True).choices[0].logprobs
    lengths = [len(t) for t in echoed.tokens]
    assert echoed.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    assert echoed.text_offset[-3] == len("Hello")  # (the first generated token's)
    sent = 0  # streamed: a chunk's tokens start where the text sent so far ends
    for chunk in client.completions.create(**kw, echo=True, stream=True):
        choice = chunk.choices[0]
        assert choice.logprobs.text_offset[:1] == [sent][: len(choice.logprobs.tokens)]
        sent += len(choice.text)
    assert sent == len("Hello") + sum(lengths[-3:])
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].logprob == content[0].top_logprobs[0].logprob  # greedy: the top token


def _random_completion(rng) -> dict:
    """A /v1/completions body: a token-id prompt, greedy or seeded, a random mix of settings."""
    body = {
        "model": MODEL,
        "prompt": [rng.randint(3, 250) for _ in range(rng.randint(1, 40))],
        "max_tokens": rng.randint(1, 16),
        "temperature": rng.choice([0, 0.7, 1.3]),
        "seed": rng.randint(0, 999),
    }
    maybe = {
        "n": [2, 3],
        "top_k": [5, 40],
        "top_p": [0.6, 0.95],
        "repetition_penalty": [1.2, 0.9],
        "frequency_penalty": [0.7],
        "stop": [["e"], ["a", " t"]],
        "include_stop_str_in_output": [True],
        "ignore_eos": [True],
        "min_tokens": [1, 3],
        "logprobs": [1, 3],
        "stop_token_ids": [[40, 41, 42]],
        "logit_bias": [{"203": 100}],
        "structured_outputs": [{"regex": "[a-z]{3,9}"}],
    }
    for name, values in maybe.items():
        if rng.random() < 0.15:
            body[name] = rng.choice(values)
    if "min_tokens" in body:
        body["min_tokens"] = min(body["min_tokens"], body["max_tokens"])
    return body


def _sampling_params(body: dict) -> SamplingParams:
    names = set(dataclasses.asdict(SamplingParams()))
    kw = {k: v for k, v in body.items() if k in names and k not in ("logit_bias", "structured_outputs")}
    if "logit_bias" in body:
        kw["logit_bias"] = {int(t): v for t, v in body["logit_bias"].items()}
    if "structured_outputs" in body:
        kw["structured_outputs"] = picovllm.StructuredOutputsParams(**body["structured_outputs"])
    return SamplingParams(**kw)


async def _completion_texts(client: httpx.AsyncClient, body: dict, stream: bool) -> list[tuple]:
    """(index, text, finish_reason) of each choice; streamed: its deltas put together."""
    if not stream:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return sorted((c["index"], c["text"], c["finish_reason"]) for c in r.json()["choices"])
    texts, reasons = {}, {}
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                    reasons[c["index"]] = c["finish_reason"] or reasons.get(c["index"])
    return sorted((i, texts[i], reasons[i]) for i in texts)


def test_random_requests_streamed_or_not_give_what_llm_generate_gives(server):
    """Rounds of concurrent requests with random mixes of settings, streamed or not: each choice's
    text and finish reason as LLM.generate's for the same prompt and settings."""
    import random

    async def rounds():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=server[0], headers=headers, timeout=60) as client:
            for round_ in range(4):
                rng = random.Random(round_)
                bodies = [_random_completion(rng) for _ in range(rng.randint(3, 8))]
                streams = [rng.random() < 0.5 for _ in bodies]
                got = await asyncio.gather(*(_completion_texts(client, b, s) for b, s in zip(bodies, streams)))
                prompts = [{"prompt_token_ids": b["prompt"]} for b in bodies]
                outs = server[2].generate(prompts, [_sampling_params(b) for b in bodies], use_tqdm=False)
                for body, g, o in zip(bodies, got, outs):
                    assert g == sorted((c.index, c.text, c.finish_reason) for c in o.outputs), body

    asyncio.run(rounds())


def test_streamed_n_completions_end_once_each_and_equal_the_non_streamed(client):
    """n=2, seeded: each choice's stream joins to its non-streamed text, and ends with exactly one
    chunk carrying its finish_reason (the engine reports every completion of the request each step)."""
    kw = dict(model=MODEL, prompt="Hello", max_tokens=12, temperature=1.0, n=2, seed=5, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    for choice in full.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        assert mine[-1].finish_reason is not None


def test_logit_bias_allowed_token_ids_and_truncate_prompt_tokens(server, client):
    """logit_bias as OpenAI's clients send it (token ids as strings; biases beyond [-100, 100]
    taken as its ends, as vLLM does); vLLM's allowed_token_ids (the only tokens a request may
    take) and truncate_prompt_tokens (a chat's default max_tokens: the room left after it)."""
    resp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, logit_bias={"42": 250})
    assert (
        resp.choices[0].text
        == client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, logit_bias={"42": 100}).choices[0].text
    )
    assert resp.usage.completion_tokens == 5
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, logit_bias={"42": 100}, logprobs=True
    )
    assert [t.token for t in chat.choices[0].logprobs.content] == [chat.choices[0].logprobs.content[0].token] * 4
    cut = client.completions.create(
        model=MODEL, prompt="a b c d e f g h", max_tokens=2, extra_body={"truncate_prompt_tokens": 3}
    )
    assert cut.usage.prompt_tokens == 3
    long = [{"role": "user", "content": "a b " * 300}]  # (past max_model_len 256, its last 200 tokens kept)
    chat = client.chat.completions.create(
        model=MODEL, messages=long, extra_body={"truncate_prompt_tokens": 200, "ignore_eos": True}
    )
    assert chat.usage.prompt_tokens == 200 and chat.usage.completion_tokens == 56  # (the room left)
    allowed = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=6, temperature=0, extra_body={"allowed_token_ids": [42, 43]}
    )
    params = SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=[42, 43])
    expected = server[2].generate("Hi", params, use_tqdm=False)[0].outputs[0]
    assert set(expected.token_ids) <= {42, 43} and allowed.choices[0].text == expected.text


def test_models_health_tokenize(server):
    url = server[0]
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/version").json() == {"version": picovllm.__version__}
    models = httpx.get(url + "/v1/models", headers=headers).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 256
    toks = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) > 0
    assert httpx.post(url + "/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"] == "Hello world"


MSG = [{"role": "user", "content": "Hi"}]
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "maximum": 999}, "tag": {"enum": ["a", "b"]}},
    "required": ["id", "tag"],
    "additionalProperties": False,
}


def test_structured_outputs_in_every_field_streamed_and_not(client):
    """response_format (json_schema, json_object), structured_outputs and guided_* on both
    routes: every answer is what its constraint allows, streamed or not, and equal both ways."""
    import re

    import jsonschema

    schema = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    for stream in (False, True):
        chat = client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=60, seed=3, response_format=schema, stream=stream
        )
        text = "".join(c.choices[0].delta.content or "" for c in chat) if stream else chat.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
        for extra, ok in [
            ({"structured_outputs": {"regex": "[xy]{3}"}}, lambda t: re.fullmatch("[xy]{3}", t)),
            ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
            ({"response_format": schema}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
            ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ]:
            out = client.completions.create(
                model=MODEL, prompt="Hi", max_tokens=60, n=2, seed=1, stream=stream, extra_body=extra
            )
            texts = {}
            for c in out if stream else [out]:
                for choice in c.choices:
                    texts[choice.index] = texts.get(choice.index, "") + choice.text
            assert len(texts) == 2 and all(ok(t) for t in texts.values()), (extra, texts)


def _post(url, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "Hi", "temperature": -0.5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "Hi " * 400}, 400, None),
        ("/v1/completions", {"prompt": [1, 2, 10**7]}, 400, None),
        ("/v1/completions", {"prompt": [1, 2.5]}, 400, None),
        ("/v1/completions", {"prompt": ""}, 400, None),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        ("/v1/completions", {"prompt": "Hi", "min_tokens": 1, "stop_token_ids": [10**7]}, 400, "stop_token_ids"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"x1": 5}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "Hi", "allowed_token_ids": [10**7]}, 400, "allowed_token_ids"),
        ("/v1/chat/completions", {"messages": MSG, "logit_bias": {str(10**7): 5}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "Hi", "guided_regex": "a("}, 400, "guided_regex"),
        ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"json": {"type": "x"}}}, 400, "structured_outputs"),
        (
            "/v1/completions",
            {"prompt": "Hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
            400,
            "structured_outputs",
        ),
        ("/v1/completions", {"prompt": "Hi", "guided_choice": ["a"], "guided_regex": "b"}, 400, "guided_choice"),
        ("/v1/chat/completions", {"messages": MSG, "guided_grammar": "root ::= "}, 400, "guided_grammar"),
        (
            "/v1/chat/completions",
            {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            400,
            "response_format",
        ),
        ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ],
)
def test_bad_input_gets_openai_errors_and_server_keeps_serving(server, path, body, status, param):
    url = server[0]
    r = _post(url, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]
    if param:
        assert param in (err["param"] or "") or param in err["message"]
    ok = _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_malformed_json_names_no_field(server):
    r = httpx.post(
        server[0] + "/v1/completions",
        content=b'{"prompt": "Hi", "max_tokens": }',
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] is None and error["message"].startswith("invalid JSON")


def test_api_key_required(server):
    assert _post(server[0], "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, key=None).status_code == 401
    assert _post(server[0], "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, key="wrong").status_code == 401


def test_64_concurrent_streams(server, client):
    llm = server[2]
    prompts = [f"Hello {i}" for i in range(64)]
    expected = {
        p: o.outputs[0].text
        for p, o in zip(
            prompts,
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False),
        )
    }
    aclient = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)

    async def one(p):
        stream = await aclient.completions.create(
            model=MODEL, prompt=p, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        return p, "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    for p, text in asyncio.run(main()):
        assert text == expected[p]
    engine = server[1]
    if engine is not None:
        assert (
            engine.launcher.num_launched_ahead > 0
            if engine.config.async_scheduling
            else engine.launcher.num_launched_ahead == 0
        )


def test_a_stream_read_late_gets_what_it_missed_in_one_output(server):
    """A stream read only once its request has ended holds one output (RequestStream merges what
    arrives before it is read): each completion's text, tokens and logprobs joined as a reader
    that kept up reads them, step by step; the finish reasons the same."""
    background = server[3]
    params = SamplingParams(
        n=2, temperature=1.0, seed=3, max_tokens=10, logprobs=2, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def read(request_id: str, late: bool):
        text, ids = await background.validate("Hello there", params)
        stream = background.generate(request_id, text, ids, params)
        while late and not (stream._output is not None and stream._output.finished):
            await asyncio.sleep(0.005)
        outs = [out async for out in stream]
        joined = {}
        for out in outs:
            for c in out.outputs:
                text, tokens, lps, _ = joined.get(c.index, ("", [], [], None))
                joined[c.index] = (text + c.text, tokens + c.token_ids, lps + c.logprobs, c.finish_reason)
        return len(outs), joined

    async def main():
        return await read("kept-up", late=False), await read("late", late=True)

    (num_kept_up, kept_up), (num_late, late) = asyncio.run(main())
    assert num_kept_up > 1 and num_late == 1
    assert sorted(late) == sorted(kept_up) == [0, 1]
    for index, (text, tokens, lps, reason) in late.items():
        assert (text, tokens, reason) == (kept_up[index][0], kept_up[index][1], kept_up[index][3])
        assert len(tokens) == 10 and reason == "length"
        # (the second prompt's prefix comes from the cache: its logprobs may differ in the last bits)
        for mine, theirs in zip(lps, kept_up[index][2], strict=True):
            assert sorted(mine) == sorted(theirs)
            assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-4 for t in mine)


def test_a_stream_reads_its_last_output_before_the_error_after_it():
    """An engine that dies after a request's last output was delivered (not yet read): the stream
    reads that output and ends; one whose output had not ended reads it, then the error."""
    from picovllm.entrypoints.openai.async_engine import EngineDeadError, RequestStream
    from picovllm.outputs import CompletionOutput, RequestOutput

    class Engine:
        _streams: dict = {}

        def abort(self, request_id):
            raise AssertionError("a stream that ended aborts nothing")

    def out(text: str, finished: bool) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(0, text, [7])], finished)

    async def main():
        read = []
        for finished in (True, False):
            stream = RequestStream(Engine(), "r", aggregate=True)
            stream.put(out("a", False))
            stream.put(out("b", finished))
            stream.put(RuntimeError("gone"))
            try:
                async for o in stream:
                    read.append((o.outputs[0].text, o.outputs[0].token_ids, o.finished))
            except EngineDeadError:
                read.append("error")
        return read

    assert asyncio.run(main()) == [("ab", [7, 7], True), ("ab", [7, 7], False), "error"]


def test_disconnect_aborts_and_frees_blocks(server, monkeypatch):
    """A client that leaves mid-stream aborts its request (the engine's abort, seen with the
    tokens it had generated; or the engine process's command) and its blocks are freed."""
    url, engine, _, background = server
    aborted = []
    if engine is not None:
        real_abort = engine.abort_request

        def recording_abort(rid):
            aborted.append((rid, engine.groups[rid][0].num_output_tokens if rid in engine.groups else None))
            real_abort(rid)

        monkeypatch.setattr(engine, "abort_request", recording_abort)
    else:
        real_abort = background.abort
        monkeypatch.setattr(background, "abort", lambda rid: (aborted.append((rid, 0)), real_abort(rid)))
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"prompt": "Hello", "max_tokens": 200, "stream": True, "ignore_eos": True},
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break  # leave mid-stream
    deadline = time.time() + 10
    while time.time() < deadline and (
        background.get_metrics()["num_running"] or background.get_metrics()["num_waiting"] or not aborted
    ):
        time.sleep(0.05)
    assert engine is None or not engine.has_unfinished_requests()
    assert len(aborted) == 1 and aborted[0][0].startswith("cmpl-")
    assert aborted[0][1] is not None and aborted[0][1] < 200  # stopped mid-generation
    metrics = httpx.get(url + "/metrics").text
    assert "picovllm:num_requests_running 0.0" in metrics and "picovllm:time_to_first_token_seconds_bucket" in metrics
    m = background.get_metrics()
    assert m["num_running"] == m["num_waiting"] == 0
    assert m["kv_blocks_free"] + m["kv_blocks_cached"] == m["kv_blocks_total"]


def test_serving_benchmark(server, tmp_path):
    from picovllm.bench.serve import EngineProbe, run_serve_bench

    engine = server[3]
    on_step = engine.on_step
    probe = EngineProbe(engine)
    summary = run_serve_bench(
        server[0],
        MODEL,
        num_prompts=12,
        concurrency=4,
        input_len=20,
        output_len=6,
        vocab_size=300,
        api_key=KEY,
        save_dir=str(tmp_path),
        probe=probe,
    )
    assert summary["failed"] == summary["rejected_503"] == summary["server_errors"] == 0 and summary["requests"] == 12
    after = summary["engine_after"]
    assert (after["num_running"], after["num_waiting"], after["kv_blocks_held"]) == (0, 0, 0)
    assert summary["itl_ms"]["p99"] >= summary["itl_ms"]["p50"] > 0
    # the engine stepped at least once per output token of a request, and is unwrapped again
    assert len(probe.starts) >= 6 and summary["engine_step_ms"]["p99"] >= summary["engine_step_ms"]["p50"] > 0
    assert engine.on_step == on_step
    cpu = summary["cpu_ms_per_step"]
    assert cpu["http"] > 0 and cpu["engine" if server[1] is not None else "engine-process"] > 0
    assert 0 < summary["engine_host_ms_per_step"] < 10 * summary["engine_step_ms"]["mean"]
    assert (tmp_path / "serve_latency.png").exists()
    text = (tmp_path / "serve_results.json").read_text()
    saved = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))  # (strict JSON)
    assert saved["summary"]["request_rate"] is None  # (unbounded: inf has no JSON, null says so)
    saved = saved["requests"]  # every stream read to its end: 6 tokens, in up to 6 chunks (a client behind
    # the engine may read two steps' tokens in one)
    assert [r["output_len"] for r in saved] == [6] * 12 and all(len(r["itl"]) <= 5 for r in saved)


def test_echo_token_prompts_and_chat_tokenize(server, client):
    url, llm = server[0], server[2]
    tok = llm.get_tokenizer()
    echoed = (
        client.completions.create(
            model=MODEL, prompt="Hello world", max_tokens=4, temperature=0, echo=True, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    plain = (
        client.completions.create(
            model=MODEL, prompt="Hello world", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    assert echoed == "Hello world" + plain
    by_ids = (
        client.completions.create(
            model=MODEL, prompt=tok.encode("Hello world"), max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    assert by_ids == plain
    ids_echoed = {  # a token-id prompt echoes its text, streamed or not
        stream: "".join(
            c.choices[0].text
            for c in (lambda r: r if stream else [r])(
                client.completions.create(
                    model=MODEL,
                    prompt=tok.encode("Hello world"),
                    max_tokens=4,
                    temperature=0,
                    echo=True,
                    stream=stream,
                    extra_body={"ignore_eos": True},
                )
            )
        )
        for stream in (False, True)
    }
    assert ids_echoed == {False: "Hello world" + plain, True: "Hello world" + plain}
    # echo with logprobs: the prompt's tokens first (as vLLM: the first without a log-probability),
    # their text offsets in the echoed text, streamed or not; 4 generated tokens after them
    prompt_ids = tok.encode("Hello world")
    for stream in (False, True):
        r = client.completions.create(
            model=MODEL, prompt="Hello world", max_tokens=4, temperature=0, echo=True, logprobs=1, stream=stream,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = list(r) if stream else [r]
        lp = chunks[0].choices[0].logprobs
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
        assert len(tokens) == len(prompt_ids) + 4 and "".join(tokens) == "Hello world" + plain
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x < 0 for x in lp.token_logprobs[1 : len(prompt_ids)])
        assert lp.text_offset[: len(prompt_ids)] == [len(tok.decode(prompt_ids[:i])) for i in range(len(prompt_ids))]
    msgs = [{"role": "user", "content": "Hi"}]
    toks = httpx.post(url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    assert toks == tok.encode(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    assert chat.usage.prompt_tokens == len(toks)


def test_frozen_heap_freezes_the_start_up_heap_and_unfreezes_it():
    import gc

    from picovllm.entrypoints.openai.async_engine import frozen_heap

    try:
        with frozen_heap():
            assert gc.get_freeze_count() > 1000  # every module and object alive at start-up
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_requests_default_to_the_models_generation_config_under_serves_flags(tiny_qwen_generation_config):
    """What a request leaves out comes from serve's sampling flags (sampling_defaults), then the
    model's generation config (reaching the server from the engine's process); the config's
    max_new_tokens (5) bounds every request's max_tokens, as vLLM's."""
    engine = EngineProcess(engine_args(tiny_qwen_generation_config, max_model_len=256, block_size=4))
    url, stop = serve_in_thread(build_app(engine, MODEL, sampling_defaults={"max_tokens": 3}))
    try:
        llm = make_llm(tiny_qwen_generation_config, max_model_len=256, block_size=4)
        conv = [{"role": "user", "content": "Hello"}]
        defaults = llm.get_default_sampling_params()
        for max_tokens, expected_tokens in ((None, 3), (50, 5), (4, 4)):
            body = {"model": MODEL, "messages": conv, "max_tokens": max_tokens, "ignore_eos": True}
            r = _post(url, "/v1/chat/completions", body, key=None).json()
            params = dataclasses.replace(defaults, max_tokens=expected_tokens, ignore_eos=True)
            assert r["choices"][0]["message"]["content"] == llm.chat(conv, params, use_tqdm=False)[0].outputs[0].text
            assert r["usage"]["completion_tokens"] == expected_tokens
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 50, "ignore_eos": True}
        assert _post(url, "/v1/completions", body, key=None).json()["usage"]["completion_tokens"] == 5
    finally:
        stop()
        engine.shutdown()


def test_engine_process_start_up_error_and_death(tiny_qwen):
    """Bad engine options fail at start-up, in the server's process, with the engine's message;
    an engine process that dies fails the waiting streams and new requests (EngineDeadError), and
    /health turns 503."""
    from picovllm.entrypoints.openai.async_engine import EngineDeadError

    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineProcess(engine_args(tiny_qwen[0], max_num_batched_tokens=4, max_num_seqs=8))
    engine = EngineProcess(engine_args(tiny_qwen[0], max_model_len=256, block_size=4))
    url, stop = serve_in_thread(build_app(engine, MODEL))
    try:
        assert httpx.get(url + "/health").status_code == 200
        engine._process.kill()
        deadline = time.time() + 10
        while engine.error is None and time.time() < deadline:
            time.sleep(0.02)
        assert isinstance(engine.error, EngineDeadError)
        assert httpx.get(url + "/health").status_code == 503
        r = _post(url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}, key=None)
        assert r.status_code == 500 and "engine" in r.json()["error"]["message"]
    finally:
        stop()
        engine.shutdown()


def test_sse_event_templates_serialise_as_json_dumps():
    """The per-token SSE events filled into a pre-serialised chunk are byte for byte what
    json.dumps of the chunk gives, for text that JSON must escape, per choice index."""
    import json

    from picovllm.entrypoints.openai.serving import EventTemplates

    def chunk(index, text):
        return {"id": "cmpl-1", "model": 'm"\x00', "choices": [{"index": index, "text": text, "logprobs": None}]}

    templates = EventTemplates(chunk)
    for index, text in [(0, "ab"), (0, 'quote " back \\ nl \n'), (1, "é😀\x00\u2028"), (0, "")]:
        assert templates.event(index, text) == f"data: {json.dumps(chunk(index, text))}\n\n"
    assert sorted(templates.parts) == [0, 1]


def test_a_dead_tensor_parallel_worker_fails_the_server_loudly(tiny_qwen):
    """With tensor_parallel_size 2, killing the engine's worker fails the request in flight with
    an error that names the rank, /health turns 503, and shutting down leaves no process."""
    import os
    import signal
    import subprocess

    engine = EngineProcess(engine_args(tiny_qwen[0], max_model_len=256, block_size=4, tensor_parallel_size=2))
    url, stop = serve_in_thread(build_app(engine, MODEL))
    try:
        assert _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, key=None).status_code == 200
        (worker,) = subprocess.run(["pgrep", "-P", str(engine.pid)], capture_output=True, text=True).stdout.split()
        os.kill(int(worker), signal.SIGKILL)
        r = _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 50, "ignore_eos": True}, key=None)
        assert r.status_code == 500 and "tensor-parallel rank 1" in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 503
    finally:
        stop()
        engine.shutdown()
    engine._process.join(timeout=10)
    assert not engine._process.is_alive()
    assert subprocess.run(["pgrep", "-P", str(engine.pid)], capture_output=True).stdout == b""


def test_a_whole_answer_whose_client_left_as_it_came_aborts_its_requests():
    """An answer sent whole, ready in the same moment its client disconnects, is not sent
    (ClientGone) and its requests are aborted, finished as they are: that frees what the engine
    still holds for them, a prefill instance's lease that no one will pull now (before, it was held
    until kv_lease_s ran out: test_pd_faults' frozen-prefill test found it held, 1 run in 6). With
    the client there, the outputs come back and nothing is aborted."""
    from picovllm.entrypoints.openai.async_engine import RequestStream
    from picovllm.entrypoints.openai.metrics import ServerMetrics
    from picovllm.entrypoints.openai.serving import ClientGone, collect
    from picovllm.outputs import CompletionOutput, RequestOutput

    class Engine:
        def __init__(self):
            self._streams, self.aborted = {}, []

        def abort(self, request_id):
            self.aborted.append(request_id)

    class Client:  # (the route's Request, as far as collect reads it)
        def __init__(self, gone: bool):
            self.gone = gone

        async def receive(self):
            if not self.gone:
                await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        async def is_disconnected(self):
            return self.gone

    async def answer(gone: bool):
        engine = Engine()
        streams = [RequestStream(engine, rid, aggregate=True) for rid in ("a", "b")]
        for stream in streams:
            stream.put(RequestOutput(stream.request_id, None, [1], [CompletionOutput(0, "x", [7])], True))
        try:
            outputs = [o.request_id for o in await collect(Client(gone), streams, ServerMetrics(dict))]
        except ClientGone:
            outputs = "gone"
        return outputs, engine.aborted

    assert asyncio.run(answer(gone=True)) == ("gone", ["a", "b"])
    assert asyncio.run(answer(gone=False)) == (["a", "b"], [])
