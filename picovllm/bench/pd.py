"""`picovllm bench pd`: disaggregated serving against the colocated server, in one run.

First the colocated server (one engine) under the serving workload of `bench serve`; then a
prefill instance, a decode instance (each its own engine process, on the same device unless the
machine has two: then one each) and the router, under the same workload. Before the workload,
one prompt of --transfer-len tokens goes through the router alone, once per KV transfer backend
(NIXL; on GPUs also CUDA IPC): its pull's time and bandwidth, set against the prefill of the same
prompt on the prefill instance.
TTFT through the router is split, on average, into the prefill instance's answer, the pull, and
the rest (the decode instance's first step and the hops).
"""

from __future__ import annotations

import contextlib
import random
import sys
import time

import httpx
import torch

from picovllm.bench.common import print_json, print_table
from picovllm.bench.serve import run_serve_bench

_PULL_SECONDS = "picovllm:kv_transfer_time_seconds_sum"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def scrape_metrics(url: str) -> dict[str, float]:
    """A server's /metrics as {sample with its labels: value}."""
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines if line and not line.startswith("#")}


def _servers(engine_kwargs: dict, roles: list[str]):
    """A server per role (engine processes), on GPU i when there are as many GPUs as roles."""
    from picovllm.entrypoints.openai.async_engine import EngineProcess
    from picovllm.entrypoints.openai.server import build_app, serve_in_thread

    gpus = torch.cuda.device_count() if engine_kwargs.get("device", "auto") in ("auto", "cuda") else 0
    share = 1 if gpus >= len(roles) else len(roles)
    servers = []
    try:
        for i, role in enumerate(roles):
            kwargs = {**engine_kwargs, "kv_role": role}
            kwargs["gpu_memory_utilization"] = engine_kwargs.get("gpu_memory_utilization", 0.9) / share
            if gpus >= len(roles) > 1:
                kwargs["device"] = f"cuda:{i}"
            engine = EngineProcess(kwargs)
            url, stop = serve_in_thread(build_app(engine, "bench"))
            servers.append((url, stop, engine))
    except BaseException:  # (one failed to start: the others must not outlive the benchmark)
        _stop(servers)
        raise
    return servers


def _stop(servers) -> None:
    for _, stop, engine in servers:
        stop()
        engine.shutdown()


@contextlib.contextmanager
def _pd_servers(engine_kwargs: dict):
    """A prefill and a decode instance and the router: (router URL, prefill URL, decode URL)."""
    from picovllm.entrypoints.openai.server import serve_in_thread
    from picovllm.entrypoints.router import build_router_app

    servers = _servers(engine_kwargs, ["prefill", "decode"])
    (prefill, *_), (decode, *_) = servers
    try:
        router, stop_router = serve_in_thread(build_router_app([prefill], [decode]))
        try:
            yield router, prefill, decode
        finally:
            stop_router()
    finally:
        _stop(servers)


def _transfer(router: str, prefill: str, decode: str, length: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompt = [rng.randrange(100, vocab) for _ in range(length)]
    body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    other = [rng.randrange(100, vocab) for _ in range(length)]  # (warm-up: kernels, the UCX connection)
    httpx.post(router + "/v1/completions", json={**body, "prompt": other}, timeout=120).raise_for_status()
    start = time.perf_counter()
    httpx.post(prefill + "/v1/completions", json={**body, "prompt": prompt[::-1]}, timeout=120).raise_for_status()
    prefill_s = time.perf_counter() - start
    before = scrape_metrics(decode)
    httpx.post(router + "/v1/completions", json=body, timeout=120).raise_for_status()
    after = scrape_metrics(decode)
    seconds = after[_PULL_SECONDS] - before.get(_PULL_SECONDS, 0.0)
    nbytes = after["picovllm:kv_transfer_bytes"] - before["picovllm:kv_transfer_bytes"]
    return {
        "transfer_len": length,
        "transfer_ms": seconds * 1e3,
        "transfer_mb": nbytes / 1e6,
        "transfer_gb_s": nbytes / max(seconds, 1e-9) / 1e9,
        "prefill_ms": prefill_s * 1e3,
        "transfer_of_prefill": seconds / prefill_s,
    }


def _transfer_line(path: str, t: dict) -> str:
    return (
        f"one {t['transfer_len']}-token prompt over {path}: {t['transfer_mb']:.1f} MB pulled in "
        f"{t['transfer_ms']:.2f} ms ({t['transfer_gb_s']:.2f} GB/s), "
        f"{t['transfer_of_prefill']:.1%} of its {t['prefill_ms']:.1f} ms prefill"
    )


def _vocab_size(engine_kwargs: dict) -> int:
    from picovllm.model_source import resolve_model

    return resolve_model(engine_kwargs["model"])[0].vocab_size


def run_pd_bench(
    engine_kwargs: dict,
    num_prompts: int,
    concurrency: int,
    input_len: int,
    output_len: int,
    transfer_len: int = 2083,
    seed: int = 0,
) -> dict:

    workload = dict(num_prompts=num_prompts, concurrency=concurrency, input_len=input_len, output_len=output_len)
    vocab = min(30000, _vocab_size(engine_kwargs))
    transfers = {}
    on_gpu = torch.cuda.is_available() and engine_kwargs.get("device", "auto") != "cpu"
    for backend in ("auto", "nixl") if on_gpu else ("nixl",):  # (auto: CUDA IPC between GPU pools)
        kwargs = {**engine_kwargs, "kv_transfer_backend": backend, "enforce_eager": True}
        _say(f"bench pd: one {transfer_len}-token prompt's transfer, kv_transfer_backend {backend}")
        with _pd_servers(kwargs) as (router, prefill, decode):
            transfer = _transfer(router, prefill, decode, transfer_len, vocab, seed)
            path = "cuda_ipc" if scrape_metrics(decode)["picovllm:kv_transfers_cuda_ipc"] else "nixl"
            transfers[path] = transfer
        _say(_transfer_line(path, transfer))
    _say("bench pd: the colocated server")
    servers = _servers(engine_kwargs, ["both"])
    try:
        colocated = run_serve_bench(servers[0][0], "bench", vocab_size=vocab, seed=seed, **workload)
    finally:
        _stop(servers)
    _say("bench pd: prefill and decode instances behind the router")
    with _pd_servers(engine_kwargs) as (router, prefill, decode):
        before_r, before_d = scrape_metrics(router), scrape_metrics(decode)
        pd = run_serve_bench(router, "bench", vocab_size=vocab, seed=seed, **workload)
        after_r, after_d = scrape_metrics(router), scrape_metrics(decode)

    def delta(after, before, name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    pulls = max(delta(after_d, before_d, "picovllm:kv_transfers_done"), 1)
    prefills = max(delta(after_r, before_r, "picovllm:router_prefill_seconds_count"), 1)
    split = {
        "prefill_ms": 1e3 * delta(after_r, before_r, "picovllm:router_prefill_seconds_sum") / prefills,
        "transfer_ms": 1e3 * delta(after_d, before_d, _PULL_SECONDS) / pulls,
    }
    split["rest_ms"] = pd["ttft_ms"]["mean"] - split["prefill_ms"] - split["transfer_ms"]
    rows = [
        {"setup": name, "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"], "itl_p50": s["itl_ms"]["p50"]}
        | {"itl_p99": s["itl_ms"]["p99"], "tok_s": s["output_tok_s"], "failed": s["failed"]}
        for name, s in (("colocated", colocated), ("prefill + decode", pd))
    ]
    print_table(
        rows,
        [
            ("setup", "setup", ""),
            ("ttft_p50", "TTFT p50 ms", ".1f"),
            ("ttft_p99", "p99", ".1f"),
            ("itl_p50", "ITL p50 ms", ".2f"),
            ("itl_p99", "p99", ".2f"),
            ("tok_s", "output tok/s", ".0f"),
            ("failed", "failed", "d"),
        ],
    )
    print(
        f"TTFT through the router, mean: prefill {split['prefill_ms']:.1f} ms + transfer "
        f"{split['transfer_ms']:.1f} ms + first decode and hops {split['rest_ms']:.1f} ms"
    )
    for path, t in transfers.items():
        print(_transfer_line(path, t))
    result = {"colocated": colocated, "pd": pd, "ttft_split_ms": split, "transfer": transfers, **workload}
    print_json("pd", {"model": engine_kwargs.get("model"), **result})
    return result
