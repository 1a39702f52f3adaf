"""The server under a minute of mixed load (the engine in its own process, as `picovllm serve`
runs it): 32 clients with random valid parameters (streamed or not, n, stop strings, logprobs,
seeds), disconnects mid-stream, bad requests between them, in a KV pool small enough to preempt.
Afterwards nothing is running or waiting, every KV block is free (or only cached), each client
request is accounted for, the engine process grew by less than a bound, and /health is 200."""

import asyncio
import json
import random
import time

import httpx
import psutil
from conftest import engine_args

from picovllm.entrypoints.openai.async_engine import EngineProcess
from picovllm.entrypoints.openai.server import build_app, serve_in_thread

SOAK_S = 60
CLIENTS = 32
GROWTH_BOUND_MB = 200


def _valid(rng: random.Random) -> tuple[str, dict]:
    params = {
        "model": "tiny",
        "max_tokens": rng.randint(1, 24),
        "temperature": rng.choice([0, 0.7, 1.2]),
        "n": rng.choice([1, 1, 1, 2, 3]),
        "stream": rng.random() < 0.5,
    }
    if rng.random() < 0.3:
        params["seed"] = rng.randrange(1000)
    if rng.random() < 0.2:
        params["stop"] = [rng.choice(["a", "the", "\n"])]
    if rng.random() < 0.5:
        return "/v1/chat/completions", {
            **params,
            "messages": [{"role": "user", "content": " ".join(rng.choice(["hi", "cat", "blue"]) for _ in range(5))}],
            **({"logprobs": True, "top_logprobs": 2} if rng.random() < 0.2 else {}),
        }
    prompt = rng.choice(["Once upon a time", [rng.randrange(10, 300) for _ in range(rng.randint(1, 60))]])
    return "/v1/completions", {**params, "prompt": prompt, **({"logprobs": 1} if rng.random() < 0.2 else {})}


def _bad(rng: random.Random) -> tuple[str, dict]:
    return rng.choice(
        [
            ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}),
            ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": True}),
            ("/v1/completions", {"model": "tiny", "prompt": [10**9]}),
            ("/v1/chat/completions", {"model": "tiny", "messages": []}),
            ("/v1/completions", {"model": "other", "prompt": "x"}),
        ]
    )


async def _client(url: str, seed: int, deadline: float, tally: dict) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            tally["sent"] += 1
            roll = rng.random()
            if roll < 0.15:
                path, body = _bad(rng)
                r = await client.post(path, json=body)
                assert 400 <= r.status_code < 500, r.text  # (never a 5xx)
                assert r.json()["error"]["code"] == r.status_code
                tally["rejected"] += 1
                continue
            path, body = _valid(rng)
            if roll < 0.3:  # a client that goes away mid-stream
                body = {**body, "stream": True, "max_tokens": 24, "ignore_eos": True}
                async with client.stream("POST", path, json=body) as r:
                    assert r.status_code == 200
                    async for _ in r.aiter_lines():
                        if rng.random() < 0.3:
                            break
                tally["disconnected"] += 1
                continue
            if body["stream"]:
                async with client.stream("POST", path, json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                assert lines[-1] == "data: [DONE]" and all("error" not in json.loads(x[6:]) for x in lines[:-1])
            else:
                r = await client.post(path, json=body)
                assert r.status_code == 200, r.text
                assert len(r.json()["choices"]) == body["n"]
            tally["ok"] += 1


def test_a_minute_of_mixed_load_leaves_nothing_behind(tiny_qwen):
    args = engine_args(tiny_qwen[0], max_model_len=256, block_size=4, max_num_seqs=16, num_gpu_blocks_override=64)
    engine = EngineProcess(args)
    url, stop = serve_in_thread(build_app(engine, "tiny"))
    process = psutil.Process(engine._process.pid)
    try:
        httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "warm", "max_tokens": 4}, timeout=60)
        before_mb = process.memory_info().rss / 2**20
        tally = dict.fromkeys(["sent", "ok", "rejected", "disconnected"], 0)

        async def load():
            deadline = time.monotonic() + SOAK_S
            await asyncio.gather(*(_client(url, seed, deadline, tally) for seed in range(CLIENTS)))

        asyncio.run(load())
        assert tally["sent"] == tally["ok"] + tally["rejected"] + tally["disconnected"]
        assert tally["ok"] > 100 and tally["rejected"] > 10 and tally["disconnected"] > 10
        deadline = time.monotonic() + 10  # (the disconnected requests' aborts reach the engine)
        while time.monotonic() < deadline:
            m = engine.get_metrics()
            if m["num_running"] == m["num_waiting"] == 0 and m["kv_blocks_free"] + m["kv_blocks_cached"] == 64:
                break
            time.sleep(0.1)
        assert (m["num_running"], m["num_waiting"]) == (0, 0)
        assert m["kv_blocks_free"] + m["kv_blocks_cached"] == m["kv_blocks_total"] == 64  # (no block held)
        assert m["num_preemptions"] > 0  # (the pool was small enough to make requests take turns)
        assert httpx.get(url + "/health").status_code == 200
        grown = process.memory_info().rss / 2**20 - before_mb
        assert grown < GROWTH_BOUND_MB, f"the engine process grew by {grown:.0f} MB"
    finally:
        stop()
        engine.shutdown()
