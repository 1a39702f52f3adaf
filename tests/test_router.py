"""Disaggregated serving end to end: a prefill and a decode server (each engine in a process of its
own, KV over NIXL on loopback TCP) behind `picovllm router`, driven by the openai client; their
answers equal the colocated server's."""

import json
import time

import httpx
import pytest
from conftest import engine_args, need_nixl

need_nixl()
openai = pytest.importorskip("openai")


from picovllm.bench.pd import scrape_metrics as _metrics  # noqa: E402
from picovllm.entrypoints.openai.async_engine import EngineProcess  # noqa: E402
from picovllm.entrypoints.openai.server import build_app, serve_in_thread  # noqa: E402
from picovllm.entrypoints.openai.serving import KV_SECRET_HEADER, kv_transfer_secret  # noqa: E402
from picovllm.entrypoints.router import build_router_app  # noqa: E402

MODEL = "tiny"
ROUTER = {KV_SECRET_HEADER: kv_transfer_secret()}  # (what this machine's router sends its instances)


def _server(path, **kwargs):
    engine = EngineProcess(
        engine_args(path, max_model_len=256, block_size=4, max_num_batched_tokens=32, max_num_seqs=16, **kwargs)
    )
    url, stop = serve_in_thread(build_app(engine, MODEL))
    return url, stop, engine


@pytest.fixture(scope="module", params=["async", "sync"])
def pd(tiny_qwen, request):
    """(router URL, prefill URL, decode URL, colocated URL)."""
    servers = [
        _server(tiny_qwen[0], kv_role="prefill", kv_transfer_mode=request.param),
        _server(tiny_qwen[0], kv_role="decode", kv_transfer_mode=request.param),
        _server(tiny_qwen[0]),
    ]
    (p, *_), (d, *_), (c, *_) = servers
    router, stop_router = serve_in_thread(build_router_app([p], [d]))
    yield router, p, d, c
    stop_router()
    for _, stop, engine in servers:
        stop()
        engine.shutdown()


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a land far away,"]


def test_completions_through_the_router_equal_the_colocated_server(pd):
    router, _, decode, colocated = pd
    ours, ref = _client(router), _client(colocated)
    for kwargs in [
        dict(max_tokens=10, temperature=0, extra_body={"ignore_eos": True}),
        dict(max_tokens=8, temperature=0.9, seed=5, n=2, extra_body={"ignore_eos": True}),
        dict(max_tokens=12, temperature=0, stop=[" the"]),
        dict(max_tokens=6, temperature=0, logprobs=2, extra_body={"min_tokens": 4}),  # (not for the prefill)
    ]:
        for prompt in PROMPTS:
            got = ours.completions.create(model=MODEL, prompt=prompt, **kwargs)
            want = ref.completions.create(model=MODEL, prompt=prompt, **kwargs)
            assert [(c.text, c.finish_reason) for c in got.choices] == [(c.text, c.finish_reason) for c in want.choices]
            assert got.usage.prompt_tokens == want.usage.prompt_tokens
    streamed = "".join(
        chunk.choices[0].text
        for chunk in ours.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=0, stream=True)
    )
    assert (
        streamed == ref.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=0).choices[0].text
    )
    m = _metrics(decode)
    assert m["picovllm:kv_transfers_done"] >= 3 * len(PROMPTS) and m["picovllm:kv_transfers_failed"] == 0
    # the pulls' time histogram: every completed pull counted once, under 10 s (loopback)
    assert m["picovllm:kv_transfer_time_seconds_count"] == m["picovllm:kv_transfers_done"]
    assert m['picovllm:kv_transfer_time_seconds_bucket{le="10.0"}'] == m["picovllm:kv_transfers_done"]
    assert 0 < m["picovllm:kv_transfer_time_seconds_sum"] < 10 * m["picovllm:kv_transfers_done"]


def test_chat_through_the_router_streamed_and_not(pd):
    router, _, _, colocated = pd
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    want = _client(colocated).chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    got = _client(router).chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    chunks = _client(router).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.choices[0].message.content


def test_structured_outputs_through_the_router_equal_the_colocated_server(pd):
    """The decode instance samples every token under the grammar (the prefill instance's one
    token is not the answer's): the answers are the colocated server's."""
    router, _, decode, colocated = pd
    done = _metrics(decode)["picovllm:kv_transfers_done"]
    schema = {
        "type": "object",
        "properties": {"n": {"enum": [1, 2, 3]}},
        "required": ["n"],
        "additionalProperties": False,
    }
    for extra in [{"guided_regex": "[ab]{2,5}"}, {"guided_json": schema}, {"guided_choice": ["up", "down"]}]:
        kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0.8, seed=2, extra_body=extra)
        got = _client(router).completions.create(**kwargs).choices[0]
        want = _client(colocated).completions.create(**kwargs).choices[0]
        assert (got.text, got.finish_reason) == (want.text, "stop"), extra
    assert _metrics(decode)["picovllm:kv_transfers_done"] == done + 3


def test_several_prompts_go_to_the_decode_instance_alone(pd):
    router, _, _, colocated = pd
    got = _client(router).completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=0)
    want = _client(colocated).completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=0)
    assert [c.text for c in got.choices] == [c.text for c in want.choices]


def test_errors_models_health_and_nothing_held_afterwards(pd):
    router, prefill, decode, _ = pd
    bad = httpx.post(router + "/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"  # the prefill instance's answer
    own = httpx.post(router + "/v1/completions", json={"prompt": "x", "kv_transfer_params": {}})
    assert own.status_code == 400 and own.json()["error"]["param"] == "kv_transfer_params"
    assert httpx.get(router + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(router + "/health").status_code == 200
    before = _metrics(router)
    # 40 tokens, one SSE event a decode step: the router relays them in more than one chunk (a
    # short answer may reach it in one read, with no gap to time)
    stream = _client(router).completions.create(
        model=MODEL, prompt="Hi", max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    list(stream)
    m = _metrics(router)
    assert (
        m['picovllm:router_requests_total{outcome="ok"}']
        == before.get('picovllm:router_requests_total{outcome="ok"}', 0) + 1
    )
    assert m['picovllm:router_requests_total{outcome="refused"}'] >= 1  # (the bad temperature above)
    first_bytes = "picovllm:router_time_to_first_byte_seconds_count"
    assert m[first_bytes] == before.get(first_bytes, 0) + 1
    assert m["picovllm:router_inter_chunk_seconds_count"] > before.get("picovllm:router_inter_chunk_seconds_count", 0)
    # every lease released by the decode instance's pulls; no request left on either side
    deadline = time.monotonic() + 5
    while _metrics(prefill)["picovllm:kv_blocks_held_for_pickup"] and time.monotonic() < deadline:
        time.sleep(0.05)
    for url in (prefill, decode):
        m = _metrics(url)
        assert m["picovllm:kv_blocks_held_for_pickup"] == 0 and m["picovllm:num_requests_running"] == 0


def test_the_routers_page_and_its_dashboard_of_instances(pd):
    router, prefill, decode, _ = pd
    assert "Pico-vLLM" in httpx.get(router + "/").text
    instances = httpx.get(router + "/stats").json()["instances"]
    assert [(i["url"], i["role"], i["model"]) for i in instances] == [
        (prefill, "prefill", MODEL),
        (decode, "decode", MODEL),
    ]
    assert all(i["now"]["kv_usage"] >= 0 and "series" in i for i in instances)


def test_no_instance_up_is_a_503_that_names_them(tiny_qwen):
    app = build_router_app(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    url, stop = serve_in_thread(app)
    try:
        start = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
        message = r.json()["error"]["message"]
        assert r.status_code == 503 and "prefill" in message and "http://127.0.0.1:9" in message, message
        assert time.monotonic() - start < 5
        assert httpx.get(url + "/health").status_code == 503
        assert json.loads(httpx.get(url + "/health").text)["down"] == ["http://127.0.0.1:9"] * 2
    finally:
        stop()


@pytest.fixture
def fragile(tiny_qwen):
    """A prefill and a decode server of their own behind a router, for tests that break them."""
    servers = [_server(tiny_qwen[0], kv_role="prefill", kv_lease_s=1.0), _server(tiny_qwen[0], kv_role="decode")]
    (p, *_), (d, *_) = servers
    router, stop_router = serve_in_thread(build_router_app([p], [d]))
    yield router, servers
    stop_router()
    for _, stop, engine in servers:
        stop()
        engine.shutdown()


def _idle(url, timeout=5.0) -> dict[str, float]:
    """The instance's metrics once it has nothing running, waiting or held for pickup."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        busy = m["picovllm:num_requests_running"] + m["picovllm:num_requests_waiting"]
        if not busy + m["picovllm:kv_blocks_held_for_pickup"] or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_a_client_that_disconnects_aborts_on_the_decode_instance(fragile):
    router, ((prefill, *_), (decode, *_)) = fragile
    body = {"prompt": PROMPTS[2], "max_tokens": 220, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # generating
    m = _idle(decode)
    assert m["picovllm:num_requests_running"] == 0 and m["picovllm:num_requests_waiting"] == 0
    assert m["picovllm:generation_tokens_total"] < 100  # aborted, far from its 220 tokens
    assert _idle(prefill)["picovllm:kv_blocks_held_for_pickup"] == 0


def test_a_dead_prefill_instance_is_a_502_and_the_decode_instance_holds_nothing(fragile):
    """Its engine killed: its 500 is a 502, or once the router's health check has seen it, a 503
    (the pool has no instance up); both name it."""
    router, ((prefill, _, prefill_engine), (decode, *_)) = fragile
    prefill_engine._process.kill()
    start = time.monotonic()
    r = httpx.post(router + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
    assert r.status_code in (502, 503) and prefill in r.json()["error"]["message"], r.text
    assert time.monotonic() - start < 5
    m = _idle(decode)
    assert m["picovllm:num_requests_running"] == 0 and m["picovllm:kv_transfers_started"] == 0


def test_a_dead_decode_instance_ends_the_stream_with_an_error_and_the_lease_frees_the_blocks(fragile):
    router, ((prefill, *_), (_, _, decode_engine)) = fragile
    body = {"prompt": PROMPTS[2], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        decode_engine._process.kill()
        rest = [line for line in lines if line]
    assert any('"error"' in line for line in rest), rest[-3:]
    assert _idle(prefill)["picovllm:kv_blocks_held_for_pickup"] == 0
    assert httpx.get(router + "/health").status_code == 503


def test_bench_pd_runs_both_setups_and_times_the_transfer(tiny_qwen):
    from picovllm.bench.pd import run_pd_bench

    kwargs = engine_args(tiny_qwen[0], max_model_len=256, block_size=4, max_num_batched_tokens=32, max_num_seqs=16)
    result = run_pd_bench(kwargs, num_prompts=8, concurrency=4, input_len=32, output_len=8, transfer_len=120)
    assert result["colocated"]["failed"] == 0 and result["pd"]["failed"] == 0
    assert result["colocated"]["requests"] == result["pd"]["requests"] == 8
    nixl = result["transfer"]["nixl"]
    # 119 tokens before the last, in 4-token blocks: 30 blocks of 3 layers' K and V (fp32, 2 KV heads of 16)
    assert nixl["transfer_mb"] == 30 * 2 * 3 * 4 * 2 * 16 * 4 / 1e6 and nixl["transfer_ms"] > 0
    assert result["ttft_split_ms"]["prefill_ms"] > 0 and result["ttft_split_ms"]["transfer_ms"] > 0


@pytest.mark.parametrize(
    "arch,heads,kv_heads,tp_p,tp_d,mode",
    [
        ("qwen2", 6, 2, 2, 1, "async"),  # the one decode rank reads a head from each prefill rank, block by block
        ("qwen2", 6, 2, 1, 2, "sync"),  # each decode rank reads its head from the one prefill rank, block by block
        ("qwen2", 6, 2, 2, 2, "async"),  # rank to rank, runs of whole blocks
        ("llama", 4, 1, 1, 2, "sync"),  # one KV head, replicated on both decode ranks
        ("llama", 4, 1, 2, 1, "async"),  # replicated on both prefill ranks: the first one is read
    ],
)
def test_prefill_and_decode_with_other_tensor_parallel_sizes(tmp_path, arch, heads, kv_heads, tp_p, tp_d, mode):
    """Heterogeneous TP: each decode rank pulls exactly its KV heads from the prefill ranks that
    hold them; the completions are a colocated tp=1 engine's."""
    from tiny_models import build_model

    from picovllm import LLM, SamplingParams

    path = str(tmp_path)
    build_model(path, arch, heads=heads, kv_heads=kv_heads, tie=arch == "qwen2", seed=4)
    llm = LLM(**engine_args(path, max_model_len=256, block_size=4))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    servers = [
        _server(path, kv_role="prefill", tensor_parallel_size=tp_p, kv_transfer_mode=mode),
        _server(path, kv_role="decode", tensor_parallel_size=tp_d, kv_transfer_mode=mode),
    ]
    router, stop_router = serve_in_thread(build_router_app([servers[0][0]], [servers[1][0]]))
    try:
        client = _client(router)
        got = [
            client.completions.create(
                model=MODEL, prompt=p, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
            for p in PROMPTS
        ]
        assert got == want
        assert _metrics(servers[1][0])["picovllm:kv_transfers_done"] == len(PROMPTS)
    finally:
        stop_router()
        for _, stop, engine in servers:
            stop()
            engine.shutdown()


def test_sigterm_drains_the_router(pd):
    """SIGTERM: the router takes no new connection, the stream in flight finishes whole, then it exits."""
    import signal
    import threading

    from conftest import start_cli_server

    _, prefill, decode, _ = pd
    proc, url = start_cli_server("router", "--prefill", prefill, "--decode", decode)
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 150, "temperature": 0, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        lines, started = [], threading.Event()

        def stream():
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):
            httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=5)
        reader.join(60)
        events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"  # every token (an event may carry several), then the end
        assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 150
        assert proc.wait(30) in (0, -signal.SIGTERM)  # (uvicorn ends by the signal it drained for)
        ups = [line.split(" ", 3)[3] for line in proc.stderr.read().splitlines() if line.endswith(" is up")]
        assert sorted(ups) == [f"the decode instance {decode} is up", f"the prefill instance {prefill} is up"]  # (once)
    finally:
        proc.kill()


def test_a_stopping_prefill_instance_waits_for_its_held_kv(tiny_qwen):
    """Its server's shutdown waits until the KV it holds is pulled or the lease ends (here: ends)."""
    url, stop, engine = _server(tiny_qwen[0], kv_role="prefill", kv_lease_s=1.0)
    try:
        body = {"prompt": PROMPTS[1], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        answer = httpx.post(url + "/v1/completions", json=body, headers=ROUTER, timeout=30).json()
        assert answer["kv_transfer_params"]["remote_block_ids"]
        assert _metrics(url)["picovllm:kv_blocks_held_for_pickup"] > 0
        start = time.monotonic()
        stop()
        assert 0.5 < time.monotonic() - start < 5 and engine.get_metrics()["kv_blocks_held_for_pickup"] == 0
    finally:
        engine.shutdown()
