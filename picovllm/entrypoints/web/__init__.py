"""The page at `/` (a chat playground and the engine's dashboard: static/, plain HTML, CSS and
JavaScript shipped in the package) and the data behind the dashboard, `GET /stats`.

StatsHistory samples the server's counters once a second (a task of the app's lifespan) and keeps
the last five minutes; /stats answers the latest values and, per second, the throughput, the
mean TTFT and ITL of that second, and the queue and KV use. The router's /stats gathers its
instances' (entrypoints/router.py). Every LOG_STATS_S it also logs a line of the throughput
and queues since the last (stats_line; not while idle; off with serve --disable-log-stats).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
SAMPLE_S = 1.0
HISTORY_S = 300
LOG_STATS_S = 10.0

logger = logging.getLogger("picovllm")


class StatsHistory:
    """sample() -> the counters now (running, waiting, kv_usage, hit_rate, host_usage,
    generation_tokens, requests, ttft_sum, ttft_count, itl_sum, itl_count); the last HISTORY_S
    seconds of them, one a SAMPLE_S."""

    def __init__(self, sample: Callable[[], dict], log_stats: bool = True):
        self.sample, self.log_stats = sample, log_stats
        self.samples: deque[tuple[float, dict]] = deque(maxlen=int(HISTORY_S / SAMPLE_S) + 1)

    def record(self) -> None:
        self.samples.append((time.time(), self.sample()))

    async def run(self) -> None:
        self.record()
        logged = self.samples[-1]  # (the sample the last stats line ran to)
        while True:
            await asyncio.sleep(SAMPLE_S)
            self.record()
            (t0, a), (t1, b) = logged, self.samples[-1]
            if t1 - t0 >= LOG_STATS_S:
                if self.log_stats and (line := stats_line(a, b, t1 - t0)):
                    logger.info(line)
                logged = self.samples[-1]

    def stats(self) -> dict:
        now = self.sample()
        series = []
        for (t0, a), (t1, b) in zip(self.samples, list(self.samples)[1:]):
            dt = max(t1 - t0, 1e-9)
            series.append(
                {
                    "t": t1,
                    "tok_s": (b["generation_tokens"] - a["generation_tokens"]) / dt,
                    "ttft_ms": _mean_ms(a, b, "ttft"),
                    "itl_ms": _mean_ms(a, b, "itl"),
                    "running": b["running"],
                    "waiting": b["waiting"],
                    "kv_usage": b["kv_usage"],
                }
            )
        return {"now": now, "series": series}

    @contextlib.asynccontextmanager
    async def sampling(self):
        task = asyncio.create_task(self.run())
        try:
            yield
        finally:
            task.cancel()


def stats_line(a: dict, b: dict, seconds: float) -> str | None:
    """The server's throughput between samples a and b, seconds apart, its queues and KV use at b,
    as vLLM logs them; None when nothing ran or waited."""
    prompt = (b["prompt_tokens"] - a["prompt_tokens"]) / seconds
    generation = (b["generation_tokens"] - a["generation_tokens"]) / seconds
    if not (prompt or generation or b["running"] or b["waiting"]):
        return None
    return (
        f"Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation throughput: {generation:.1f} tokens/s, "
        f"Running: {b['running']} reqs, Waiting: {b['waiting']} reqs, KV cache usage: {b['kv_usage']:.1%}, "
        f"Prefix cache hit rate: {b['hit_rate']:.1%}"
    )


def _mean_ms(a: dict, b: dict, name: str) -> float | None:
    count = b[f"{name}_count"] - a[f"{name}_count"]
    return 1e3 * (b[f"{name}_sum"] - a[f"{name}_sum"]) / count if count else None


def web_router(stats: Callable[[], dict], page: bool) -> APIRouter:
    """GET /stats (stats() as JSON), and with page the page at / and its files under /static/."""
    router = APIRouter()

    @router.get("/stats")
    async def get_stats():
        result = stats()
        return await result if asyncio.iscoroutine(result) else result

    if page:

        @router.get("/", include_in_schema=False)
        async def index():
            return FileResponse(STATIC / "index.html")

    return router


def mount_web_ui(app: FastAPI, stats: Callable[[], dict], page: bool = True) -> None:
    app.include_router(web_router(stats, page))
    if page:
        app.mount("/static", StaticFiles(directory=STATIC), name="static")
