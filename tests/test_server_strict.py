"""The server's door: strict wire types (a 400 naming the field), nothing escaping as a bare 500,
and the bounded waiting queue (503 with Retry-After)."""

import asyncio
import logging
import re
import time

import httpx
import pytest
from conftest import make_llm, start_cli_server, stop_cli_server

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


def test_unknown_paths_wrong_methods_and_bodies_are_openai_errors(server):
    url = server[0]
    for method, path, body, status, type_, said in [
        ("GET", "/v1/nothing", None, 404, "NotFoundError", "Not Found"),
        ("GET", "/v1/completions", None, 405, "MethodNotAllowedError", "Method Not Allowed"),
        ("POST", "/v1/completions", [1, 2], 400, "BadRequestError", "invalid request body: "),
    ]:
        r = httpx.request(method, url + path, json=body, timeout=30)
        error = r.json()["error"]
        assert r.status_code == error["code"] == status and error["type"] == type_, r.text
        assert error["message"].startswith(said) and error["param"] is None, r.text
    assert r.status_code == 400 and "None" not in error["message"]
    assert httpx.get(url + "/v1/completions").headers["allow"] == "POST"


def test_a_bad_prompt_in_a_list_starts_none_of_them(server):
    """The prompts of a request are validated before any starts: a bad second prompt leaves no
    request in the engine; good ones start together (both stream at once, in one batch)."""
    url, engine = server
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "prompt": [[5, 6], [10**6]]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert engine.num_open_requests == 0 and not engine.engine.has_unfinished_requests()
    steps, on_step = [], engine.on_step

    def record(e, outputs):
        steps.append({out.request_id[-2:] for out in outputs})
        if on_step is not None:
            on_step(e, outputs)

    engine.on_step = record
    try:
        body = {**COMPLETION, "prompt": [[5, 6], [7, 8]], "max_tokens": 8, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    finally:
        engine.on_step = on_step
    assert [c["index"] for c in r.json()["choices"]] == [0, 1] and engine.num_open_requests == 0
    assert {"-0", "-1"} in steps  # (a step that carried both)


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
        # (the limit as this process holds it: with --api-server-count N, its share of --max-num-waiting)
        assert refused.json()["error"]["message"].startswith("2 requests are waiting already (at most 2 in this ")
        assert "picovllm:request_rejected_total 1.0" in httpx.get(url + "/metrics").text
        deadline = time.monotonic() + 10
        while engine.num_open_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30).status_code == 200  # (room again)
    finally:
        stop()
        engine.shutdown()


def test_the_serving_benchmark_counts_the_queues_503s(tiny_qwen):
    """Six streams at once, one sequence running and one waiting at most: the others are refused;
    the benchmark counts them as 503s (no other failure) and finds the engine empty afterwards."""
    from picovllm.bench.serve import EngineProbe, run_serve_bench

    engine = AsyncEngine(make_llm(tiny_qwen[0], max_num_seqs=1, max_model_len=256).llm_engine)
    url, stop = serve_in_thread(build_app(engine, "tiny", max_num_waiting=1))
    try:
        summary = run_serve_bench(
            url, "tiny", num_prompts=6, concurrency=6, input_len=8, output_len=40, vocab_size=300,
            client_processes=1, probe=EngineProbe(engine),
        )  # fmt: skip
    finally:
        stop()
        engine.shutdown()
    assert summary["requests"] == 6 and summary["server_errors"] == 0
    assert summary["rejected_503"] >= 4 and summary["failed"] == summary["rejected_503"]
    after = summary["engine_after"]
    assert (after["num_running"], after["num_waiting"], after["kv_blocks_held"]) == (0, 0, 0)


def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on(tiny_qwen):
    """An injected error in one step (the executor raises once): the requests that were running
    end, a stream with an error event and a plain request with a 500; their blocks are free; the
    next requests are served."""
    llm = make_llm(tiny_qwen[0], max_model_len=512)
    executor, real_run, armed = llm.llm_engine.executor, llm.llm_engine.executor.execute_step, []

    def run(*args, **kwargs):
        if armed:
            armed.clear()
            raise RuntimeError("injected")
        return real_run(*args, **kwargs)

    executor.execute_step = run
    engine = AsyncEngine(llm.llm_engine)
    url, stop = serve_in_thread(build_app(engine, "tiny"))
    long = {**COMPLETION, "max_tokens": 400, "ignore_eos": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                lines = r.aiter_lines()
                assert (await lines.__anext__()).startswith("data: ")  # (running)
                plain = asyncio.create_task(client.post("/v1/completions", json=long))
                while llm.llm_engine.get_metrics()["num_running"] < 2:
                    await asyncio.sleep(0.01)
                armed.append(True)
                events = [line async for line in lines if line.startswith("data: ")]
            return events, await plain

    try:
        events, plain = asyncio.run(scenario())
        assert "the step failed: RuntimeError: injected" in events[-1] and '"error"' in events[-1]
        assert plain.status_code == 500 and "injected" in plain.json()["error"]["message"]
        m = llm.llm_engine.get_metrics()
        assert m["num_running"] == m["num_waiting"] == 0 and m["kv_blocks_free"] == m["kv_blocks_total"]
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30).status_code == 200
    finally:
        stop()
        engine.shutdown()
    armed.append(True)  # offline: generate raises, and the engine still serves the next call
    with pytest.raises(RuntimeError, match="the step failed: RuntimeError: injected"):
        llm.generate("Hi", use_tqdm=False)
    assert llm.generate("Hi", use_tqdm=False)[0].outputs[0].text


def test_when_the_engine_process_dies_streams_end_with_an_error_and_serve_exits_1(tiny_qwen):
    """`picovllm serve` with its engine in a process of its own: the engine killed mid-stream, the
    stream ends with an error event, /health is 503 (while the server is still there), and the
    server exits with 1 within seconds."""
    import signal

    import psutil

    proc, url = start_cli_server("serve", tiny_qwen[0], "--dtype", "float32", "--device", "cpu")
    try:
        body = {"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            (engine,) = [p for p in psutil.Process(proc.pid).children() if "spawn" in " ".join(p.cmdline())]
            engine.send_signal(signal.SIGKILL)
            events = [line for line in lines if line.startswith("data: ")]
        assert '"error"' in events[-1] and "engine" in events[-1]
        assert proc.wait(timeout=20) == 1
        assert "the engine has stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_serve_logs_and_stops_in_one_line_leaving_no_process(tiny_qwen, how):
    """`picovllm serve`: its log on stderr (at --log-level info: a request field it does not know);
    Ctrl-C (SIGINT) or SIGTERM: "stopped", exit 0, no traceback, no process of its left."""
    import psutil

    proc, url = start_cli_server("serve", tiny_qwen[0], "--dtype", "float32", "--device", "cpu")
    try:
        assert psutil.Process(proc.pid).children(recursive=True)  # (the engine's process)
        assert (
            httpx.post(
                url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "frobnicate": 1}, timeout=60
            ).status_code
            == 200
        )
        code, err = stop_cli_server(proc, how)
        assert code == 0, err[-2000:]
        assert "request field 'frobnicate' is not one this server knows: ignored" in err, err[-2000:]
        assert re.search(r"ready in [\d.]+ s: '.*' \(\d+ KV blocks, max_model_len \d+\)\nserving on http://", err), err
        assert err.rstrip().endswith("stopped") and "Traceback" not in err, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_port_in_use_is_one_line_before_the_model_loads(tiny_qwen):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cli = [sys.executable, "-m", "picovllm.entrypoints.cli", "serve", tiny_qwen[0], "--port", str(port)]
        out = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "loading" not in out.stderr, out.stderr
    assert out.stderr.strip() == f"picovllm serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_the_server_logs_its_throughput_every_few_seconds_not_while_idle(monkeypatch, caplog):
    from picovllm.entrypoints import web

    monkeypatch.setattr(web, "SAMPLE_S", 0.01)
    monkeypatch.setattr(web, "LOG_STATS_S", 0.05)
    idle = {
        "prompt_tokens": 0.0,
        "generation_tokens": 0.0,
        "running": 0,
        "waiting": 0,
        "kv_usage": 0.25,
        "hit_rate": 0.5,
    }
    busy = {**idle, "prompt_tokens": 100.0, "generation_tokens": 50.0, "running": 2}
    said = "Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 50.0%"
    assert web.stats_line(idle, idle, 10.0) is None
    line = web.stats_line(idle, busy, 10.0)
    assert line == f"Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 5.0 tokens/s, {said}"
    counters = dict(idle)

    async def serve(history):
        async with history.sampling():
            await asyncio.sleep(0.15)  # idle: no line
            counters.update(busy)
            await asyncio.sleep(0.15)

    for log_stats in (True, False):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="picovllm"):
            asyncio.run(serve(web.StatsHistory(lambda: dict(counters), log_stats)))
        lines = [r.getMessage() for r in caplog.records if "throughput" in r.getMessage()]
        assert all(said in line for line in lines) and bool(lines) == log_stats, lines


def test_each_completion_counts_once_in_the_success_counter_and_the_latencies():
    """n = 2: two requests finished, two times to first token, two end-to-end latencies (as vLLM
    counts its child requests), whatever steps their tokens came in. The engine's gauges are what
    its metrics say when they are collected."""
    from picovllm.entrypoints.openai.metrics import ServerMetrics
    from picovllm.outputs import CompletionOutput, RequestOutput

    engine = {"num_running": 3, "num_waiting": 1, "kv_blocks_free": 30, "kv_blocks_total": 40}
    engine |= {"prefix_cache_hit_tokens": 5, "prefix_cache_queried_tokens": 20, "kv_transfers_started": 2}
    metrics = ServerMetrics(lambda: engine)
    tracker = metrics.track()
    steps = [([5], []), ([6], [7]), ([], [8])]  # (completion 0's new tokens, completion 1's)
    for i, (a, b) in enumerate(steps):
        last = i == len(steps) - 1
        outs = [
            CompletionOutput(0, "", a, finish_reason="stop" if last else None),
            CompletionOutput(1, "", b, finish_reason="length" if last else None),
        ]
        tracker.update(RequestOutput("r", None, [1, 2, 3], outs, finished=last))
    value = metrics.registry.get_sample_value
    assert value("picovllm:request_success_total", {"finished_reason": "stop"}) == 1
    assert value("picovllm:request_success_total", {"finished_reason": "length"}) == 1
    assert value("picovllm:e2e_request_latency_seconds_count") == 2
    assert value("picovllm:time_to_first_token_seconds_count") == 2
    assert value("picovllm:generation_tokens_total") == 4 and value("picovllm:prompt_tokens_total") == 3
    gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate")
    assert [value(f"picovllm:{g}") for g in gauges] == [3, 1, 0.25, 0.25]
    assert value("picovllm:kv_transfers_started") == 2
    engine.update(num_running=0, kv_blocks_free=40)
    assert value("picovllm:num_requests_running") == 0 and value("picovllm:kv_cache_usage_perc") == 0
    assert value("picovllm:kv_transfer_time_seconds_count") is None  # (a decode instance's alone)


def test_access_log_leaves_out_the_paths_it_is_told(tiny_qwen):
    """uvicorn's line for each request (on stdout, as uvicorn's), less those to the paths of
    --disable-access-log-for-endpoints (vLLM's option: what a router or a probe polls), and none
    at all with --disable-uvicorn-access-log."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    def access_lines(*flags: str) -> list[str]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cli = [sys.executable, "-m", "picovllm.entrypoints.cli", "serve", tiny_qwen[0], "--device", "cpu"]
        proc = subprocess.Popen([*cli, "--port", str(port), *flags], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
        try:
            while True:
                try:
                    if httpx.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
                    time.sleep(0.1)
            assert httpx.get(url + "/health?probe=1").status_code == httpx.get(url + "/v1/models").status_code == 200
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        return [line.split('"')[1] for line in out.decode().splitlines() if '"' in line]

    assert access_lines("--disable-access-log-for-endpoints", "/health,/metrics") == ["GET /v1/models HTTP/1.1"]
    assert access_lines("--disable-uvicorn-access-log") == []
