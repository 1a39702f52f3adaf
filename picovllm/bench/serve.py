"""`picovllm bench serve`: drive the OpenAI-compatible server over HTTP with streaming clients.

Concurrency-limited clients (and optionally Poisson arrivals at a request rate), spread over a few
client processes, send random-token prompts to /v1/completions with stream=true and ignore_eos;
an SSE chunk carries the tokens of the steps since the stream's last chunk (one, unless the server
fell behind), and the usage chunk the count (as vLLM's benchmark takes it). Reports request and
token throughput, TTFT, TPOT (per output token after the first) and ITL (between chunks): mean,
p50, p90, p99; saves the raw per-request timings and a plot.
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import os
import random
import signal
import threading
import time

import numpy as np

from picovllm.bench.common import ms_stats, print_json, print_table, progress, to_json


def _body(prompt: list[int], max_tokens: int, model: str) -> bytes:
    return json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
    ).encode()


async def _one(session, url: str, headers: dict, body: bytes, prompt_len: int) -> dict:
    """One streaming request of a body serialised beforehand (not while other streams wait)."""
    start, start_wall = time.perf_counter(), time.time()
    stamps, num_tokens = [], 0
    async with session.post(url + "/v1/completions", data=body, headers=headers) as resp:
        if resp.status != 200:
            return {"ok": False, "status": resp.status, "error": (await resp.text())[:200]}
        async for line in resp.content:  # (line by line)
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    stamps.append(time.perf_counter())
                if chunk.get("usage"):
                    num_tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if not stamps or not num_tokens:
        return {"ok": False, "status": 200, "error": "no tokens"}
    ttft = stamps[0] - start
    return {
        "ok": True,
        "start": start_wall,
        "prompt_len": prompt_len,
        "output_len": num_tokens,
        "ttft": ttft,
        "e2e": end - start,
        "tpot": (stamps[-1] - stamps[0]) / max(num_tokens - 1, 1),
        "itl": np.diff(stamps).tolist(),
    }


async def _drive(
    url: str,
    headers: dict,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    request_rate: float,
    model: str,
    seed: int,
) -> list[dict]:
    # aiohttp, as vLLM's benchmark: a streaming request costs its client process a fraction of the
    # CPU it costs with httpx (bodies serialised beforehand); while a process is busy its other
    # streams' tokens wait
    import aiohttp

    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None), read_bufsize=1 << 20
    ) as session:
        headers = {**headers, "Content-Type": "application/json"}
        bodies = [_body(p, output_len, model) for p in prompts]

        async def bounded(body, prompt_len):
            async with limit:
                return await _one(session, url, headers, body, prompt_len)

        tasks = []
        for p, body in zip(prompts, bodies):
            tasks.append(asyncio.create_task(bounded(body, len(p))))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        return await asyncio.gather(*tasks)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _client_process(args: tuple) -> tuple[list[dict], float]:
    """One client process: waits for the common start instant (wall clock), drives its share of
    the clients; returns their results and its end instant. Its start-up heap (it imports the
    package, torch included) is frozen first, as the server's is: a collection that walked it
    would hold all of this process's streams at once."""
    from picovllm.entrypoints.openai.async_engine import frozen_heap

    start_at, *drive_args = args
    with frozen_heap():
        time.sleep(max(0.0, start_at - time.time()))
        results = asyncio.run(_drive(*drive_args))
    return results, time.time()


def _thread_cpu_s(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


IDLE_GAP_S = 0.25  # an interval between steps this long or longer: the engine was idle, waiting for requests


class EngineProbe:
    """With the server in this process: the intervals between the engine's steps as the server
    sees them (through the engine's on_step hook), and the CPU time per step of the engine (its
    thread, or its process) and of the HTTP thread (and of the other HTTP processes, `others`): to
    tell engine-side stalls from HTTP-side ones in the ITL; and the engine's own host time per
    step, its waits for the device left out."""

    def __init__(self, engine, others: list = ()):
        self.starts: list[float] = []
        self._engine, self._inner = engine, engine.on_step

        def on_step(e, outputs):
            self.starts.append(time.perf_counter())
            if self._inner is not None:
                self._inner(e, outputs)

        engine.on_step = on_step
        names = ("picovllm-engine", "picovllm-http")
        self._clocks = {
            t.name.removeprefix("picovllm-"): functools.partial(_thread_cpu_s, t)
            for t in threading.enumerate()
            if t.name in names
        }
        for p in others:  # (serve's other HTTP processes: --api-server-count)
            self._clocks[p.name.removeprefix("picovllm-")] = functools.partial(_process_cpu_s, p.pid)
        if getattr(engine, "pid", None) is not None:
            self._clocks["engine-process"] = functools.partial(_process_cpu_s, engine.pid)
        self._cpu = {k: clock() for k, clock in self._clocks.items()}
        self._host = self._host_time()

    def settled(self, timeout_s: float = 10.0) -> dict:
        """The engine once nothing runs or waits (the aborts of requests whose clients went away
        reach it after they do), or after timeout_s: requests running and waiting, KV blocks held
        (neither free nor only cached)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self._engine.get_metrics()
            held = m["kv_blocks_total"] - m["kv_blocks_free"] - m["kv_blocks_cached"]
            if (m["num_running"], m["num_waiting"], held) == (0, 0, 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        return {
            "num_running": m["num_running"],
            "num_waiting": m["num_waiting"],
            "kv_blocks_held": held,
            "kv_blocks_total": m["kv_blocks_total"],
        }

    def report(self) -> dict:
        """Stops probing (the engine's own on_step again) and returns the figures."""
        self._engine.on_step = self._inner
        steps = ms_stats(_busy_gaps(self.starts).tolist())
        cpu = {k: 1e3 * (clock() - self._cpu[k]) / max(len(self.starts), 1) for k, clock in self._clocks.items()}
        (us0, n0), (us1, n1) = self._host, self._host_time()
        host = (us1 - us0) / 1e3 / max(n1 - n0, 1)
        print(
            f"engine step interval (ms): {_stats_line(steps)}; CPU per step (ms): "
            + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
            + f"; the engine's host work per step, without its waits for the device: {host:.2f} ms"
        )
        return {"engine_step_ms": steps, "cpu_ms_per_step": cpu, "engine_host_ms_per_step": host}

    def _host_time(self) -> tuple[int, int]:
        """The engine's host time in its steps (us) and its steps (LLMEngine.get_metrics): a process
        that waits for a GPU by spinning spends its CPU waiting too."""
        m = self._engine.get_metrics()
        return m["host_time_us"], m["num_steps"]


def _busy_gaps(times: list[float]) -> np.ndarray:
    """The intervals between steps, those of IDLE_GAP_S or more left out."""
    gaps = np.diff(times)
    return gaps[gaps < IDLE_GAP_S]


def _stats_line(stats: dict) -> str:
    return " ".join(f"{k} {stats[k]:.2f}" for k in ("mean", "p50", "p90", "p99"))


def run_serve_bench(
    url: str,
    model: str,
    num_prompts: int = 256,
    concurrency: int = 64,
    request_rate: float = float("inf"),
    input_len: int = 512,
    output_len: int = 128,
    vocab_size: int = 30000,
    api_key: str | None = None,
    seed: int = 0,
    save_dir: str | None = None,
    client_processes: int | None = None,
    probe: EngineProbe | None = None,
) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # The clients run in processes of their own, as vLLM's benchmark does: parsing thousands of
    # SSE chunks a second must not take the GIL from a server running in this process.
    # While a process starts or ends a request its other streams' tokens wait: the fewer streams a
    # process holds, the fewer wait.
    if client_processes is None:
        client_processes = min(8, max(1, (os.cpu_count() or 2) // 2))
    procs = max(1, min(client_processes, concurrency))
    start_at = time.time() + 3.0  # after every process has started and imported its modules
    shards = [
        (
            start_at,
            url,
            headers,
            prompts[i::procs],
            output_len,
            concurrency // procs + (i < concurrency % procs),
            request_rate / procs,
            model,
            seed + i,
        )
        for i in range(procs)
    ]
    clients = f"{procs} client process" + ("es" if procs > 1 else "")
    progress(f"{num_prompts} requests from {clients}, {concurrency} streams at a time")
    # (Ctrl-C is this process's to handle: the clients ignore it, and leaving the block ends them)
    with multiprocessing.get_context("spawn").Pool(procs, initializer=_ignore_sigint) as pool:
        done = pool.map(_client_process, shards)
    results = [r for shard, _ in done for r in shard]
    elapsed = max(end for _, end in done) - start_at
    summary = _summary(results, elapsed, concurrency, request_rate, input_len, output_len, probe)
    _report(summary, results, probe)
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
        with open(os.path.join(save_dir, "serve_results.json"), "w") as f:
            f.write(to_json({"summary": summary, "requests": results}))
        _plot([r for r in results if r["ok"]], os.path.join(save_dir, "serve_latency.png"))
    print_json("serve", summary)
    return summary


def _summary(results, elapsed, concurrency, request_rate, input_len, output_len, probe) -> dict:
    """The run's counts, rates and latency percentiles (and the engine's, from the probe)."""
    probed = probe.report() if probe is not None else {}
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["output_len"] for r in ok)
    rejected = sum(r.get("status") == 503 for r in results)  # (the server's queue was full: max_num_waiting)
    server_errors = sum(r.get("status", 0) >= 500 for r in results) - rejected
    summary = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "rejected_503": rejected,
        "server_errors": server_errors,
        "seconds": elapsed,
        "request_s": len(ok) / elapsed,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (out_tokens + sum(r["prompt_len"] for r in ok)) / elapsed,
        "concurrency": concurrency,
        "request_rate": request_rate,
        "input_len": input_len,
        "output_len": output_len,
        "ttft_ms": ms_stats([r["ttft"] for r in ok]),
        "tpot_ms": ms_stats([r["tpot"] for r in ok]),
        "itl_ms": ms_stats([x for r in ok for x in r["itl"]]),
        **probed,
    }
    if probe is not None:
        summary["engine_after"] = probe.settled()
    return summary


def _report(summary: dict, results: list[dict], probe: EngineProbe | None) -> None:
    ok, elapsed = len(results) - summary["failed"], summary["seconds"]
    rejected, server_errors = summary["rejected_503"], summary["server_errors"]
    rows = [
        {"metric": name, **summary[key]}
        for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"))
        if summary[key]
    ]
    print(
        f"{ok}/{len(results)} requests in {elapsed:.2f} s: {summary['request_s']:.2f} req/s, "
        f"{summary['output_tok_s']:.1f} output tok/s, {summary['total_tok_s']:.1f} total tok/s; "
        f"{rejected} refused with 503 (queue full), {server_errors} other 5xx, "
        f"{summary['failed'] - rejected - server_errors} other failures"
    )
    failed = next((r for r in results if not r["ok"]), None)
    if failed is not None:
        print(f"first failure: {failed.get('status', '-')} {failed.get('error', '')}")
    if probe is not None:
        after = summary["engine_after"]
        print(
            f"engine afterwards: {after['num_running']} running, {after['num_waiting']} waiting, "
            f"{after['kv_blocks_held']} of {after['kv_blocks_total']} KV blocks held"
        )
    print_table(
        rows,
        [
            ("metric", "ms", ""),
            ("mean", "mean", ".2f"),
            ("p50", "p50", ".2f"),
            ("p90", "p90", ".2f"),
            ("p99", "p99", ".2f"),
        ],
    )


def _plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    axes[0].hist([r["ttft"] * 1e3 for r in results], bins=40)
    axes[0].set(title="time to first token", xlabel="ms", ylabel="requests")
    axes[1].hist([x * 1e3 for r in results for x in r["itl"]], bins=60)
    axes[1].set(title="inter-token latency", xlabel="ms", ylabel="tokens", yscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
