"""`picovllm serve --api-server-count N`: N HTTP processes on one port and one engine process,
each with its own pair of pipes to the engine (async_engine.EngineClient)."""

import asyncio
import json
import re
import signal
import time

import httpx
import psutil
import pytest
from conftest import assert_group_gone, engine_args, start_cli_server, stop_cli_server

from picovllm.entrypoints.openai.async_engine import EngineClient, EngineProcess
from picovllm.sampling_params import RequestOutputKind, SamplingParams


def _http_processes(proc, port: int, count: int = 2) -> list[psutil.Process]:
    """serve's processes listening on its port, once `count` are: its own and its other HTTP
    processes (not the engine's, nor multiprocessing's tracker). (/health answers once one of
    them listens.)"""
    deadline = time.monotonic() + 30
    while True:
        procs = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children()
        listening = [
            p for p in procs if any(c.status == "LISTEN" and c.laddr.port == port for c in p.net_connections("tcp"))
        ]
        if len(listening) == count or time.monotonic() > deadline:
            return listening
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_two_http_processes_share_the_port_the_engine_and_the_metrics(tiny_qwen, how):
    """32 streams at once, each on a connection of its own, all answered whole (the steps a stream
    held back missed come in one event); both processes hold some of them; /metrics (either
    process's) counts every request; the signal stops every process, said once."""
    proc, url = start_cli_server(
        "serve", tiny_qwen[0], "--device", "cpu", "--dtype", "float32", "--api-server-count", "2"
    )
    try:
        port = int(url.rsplit(":", 1)[1])
        assert len(_http_processes(proc, port)) == 2
        held: dict[int, int] = {}

        async def main():
            first, release, started = asyncio.Event(), asyncio.Event(), []

            async def one(i: int) -> tuple[int, int]:
                body = {"prompt": [5, 6, 7 + i], "max_tokens": 24, "ignore_eos": True, "stream": True}
                body["stream_options"] = {"include_usage": True}
                async with httpx.AsyncClient(timeout=60) as client:  # (a connection of its own)
                    async with client.stream("POST", url + "/v1/completions", json=body) as r:
                        events, tokens = 0, 0
                        async for line in r.aiter_lines():
                            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                                events += 1
                                if events == 1:  # (the connection held open until every stream has begun)
                                    started.append(i)
                                    if len(started) == 32:
                                        first.set()
                                    await release.wait()
                            elif line.startswith("data: {"):
                                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                        return r.status_code, events <= 24, tokens

            streams = asyncio.gather(*(one(i) for i in range(32)))
            await first.wait()
            for p in _http_processes(proc, port):
                held[p.pid] = sum(c.status == "ESTABLISHED" and c.laddr.port == port for c in p.net_connections("tcp"))
            release.set()
            return await streams

        results = asyncio.run(main())
        assert results == [(200, True, 24)] * 32
        serving = [pid for pid, n in held.items() if n > 0]
        assert sum(held.values()) == 32 and len(serving) == 2, held
        metrics = httpx.get(url + "/metrics").text
        assert 'picovllm:request_success_total{finished_reason="length"} 32.0' in metrics, metrics
        assert "picovllm:generation_tokens_total 768.0" in metrics
        code, err = stop_cli_server(proc, how, timeout=60, reap_s=15)
        assert code == 0, err[-2000:]
        assert "2 HTTP processes" in err and err.rstrip().endswith("stopped") and err.count("stopped") == 1
        assert "Traceback" not in err, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_dead_http_process_stops_the_server_with_1_leaving_no_process(tiny_qwen):
    proc, url = start_cli_server("serve", tiny_qwen[0], "--device", "cpu", "--api-server-count", "2")
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        (other,) = [p for p in _http_processes(proc, int(url.rsplit(":", 1)[1])) if p.pid != proc.pid]
        other.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
        err = proc.stderr.read()
        assert re.search(r"HTTP process picovllm-http-1 exited \(code -9\): the server stops", err), err[-2000:]
        gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, alive
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_client_gone_has_its_requests_aborted_and_the_other_client_goes_on(tiny_qwen):
    """Two clients of one engine process: the second closes (its HTTP process stopped or died)
    with a request running: that request is aborted, its blocks freed, and the first client's
    request finishes whole, its stream untouched."""

    async def main():
        engine = EngineProcess(engine_args(tiny_qwen[0], max_model_len=512), api_server_count=2)
        try:
            other = EngineClient(*engine.clients()[0])  # (in this process: its pipes are the engine's copies)
            long = SamplingParams(max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            mine = engine.generate("a", None, [5, 6, 7], long)
            theirs = other.generate("b", None, [5, 6, 8], long)
            first = await anext(theirs)
            assert first.outputs[0].token_ids
            other.close()
            tokens = [t async for out in mine for t in out.outputs[0].token_ids]
            assert len(tokens) == 400
            for _ in range(200):  # (the metrics of the step after the last)
                m = engine.get_metrics()
                if m["num_running"] == 0 and m["kv_blocks_free"] + m["kv_blocks_cached"] == m["kv_blocks_total"]:
                    break
                await asyncio.sleep(0.05)
            assert m["num_running"] == m["num_waiting"] == 0, m
            assert m["kv_blocks_free"] + m["kv_blocks_cached"] == m["kv_blocks_total"], m
            assert engine.error is None and engine.num_running == 0, (engine.error, engine.num_running)
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_bench_serve_measures_each_http_process(tiny_qwen):
    """`picovllm bench serve --api-server-count 2`: every request answered, the CPU per step of
    each HTTP process reported, and nothing of its group left when it returns."""
    import os
    import subprocess
    import sys

    cli = [sys.executable, "-m", "picovllm.entrypoints.cli", "bench", "serve", "--model", tiny_qwen[0], "--device"]
    cli += ["cpu", "--num-prompts", "16", "--concurrency", "8", "--input-len", "8", "--output-len", "8"]
    proc = subprocess.Popen(
        [*cli, "--api-server-count", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-2000:]
    assert "16/16 requests" in out and "0 other failures" in out, out
    cpu = re.search(r"CPU per step \(ms\): http ([\d.]+), http-1 ([\d.]+), engine-process ([\d.]+)", out)
    assert cpu and all(float(x) > 0 for x in cpu.groups()), out
    assert_group_gone(proc.pid, "bench serve")


def test_several_http_processes_need_the_engine_process_said_before_the_model_loads(tiny_qwen):
    import subprocess
    import sys

    cli = [sys.executable, "-m", "picovllm.entrypoints.cli", "serve", tiny_qwen[0]]
    out = subprocess.run(
        [*cli, "--api-server-count", "2", "--disable-frontend-multiprocessing"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "loading" not in out.stderr, out.stderr
    assert out.stderr.strip() == (
        "picovllm serve: error: --api-server-count needs the engine in a process of its own: "
        "drop --disable-frontend-multiprocessing"
    )
