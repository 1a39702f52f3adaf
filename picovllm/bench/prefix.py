"""`picovllm bench prefix`: what prefix caching buys and what it costs.

(a) 3 system prompts of 144 tokens x 3 rounds, each request adding 16 tokens of its own;
(b) one 2,083-token shared prefix + 8 queries of 28-48 tokens;
(c) no shared prefix at all: 64 requests of 256 random tokens;
(d) (after them, from bench/offload.py) multi-turn chats whose histories outgrow the GPU pool,
the KV cache's host tier off and on.
TTFT (a max_tokens=1 request, one at a time) cold and warm with the cache on and off; wall time of
each workload generating 32 tokens a request, on against off; hit rates; and the CPU time of
PrefixCache match + insert for a 2,000-token prompt.

Each TTFT is also set against its floor on this machine: the larger of its forward's FLOPs over
the measured GEMM throughput and its bytes (weights, KV cache) over the measured copy bandwidth.
"bound x" is the warm TTFT speedup the cache would give were both settings at their floors: for a
long shared prefix, the ratio of a compute-bound prefill to a bandwidth-bound forward of a few
tokens (benchmarks/README.md).
"""

from __future__ import annotations

import gc
import random
import time

import torch

from picovllm.bench.common import (
    Floors,
    print_json,
    print_table,
    progress,
    sync,
)
from picovllm.sampling_params import SamplingParams


def _scenarios(rng: random.Random, vocab: int, scale: float) -> dict[str, list[list[int]]]:
    """The three workloads; `scale` shrinks every length (for tests on tiny models)."""

    def toks(n):
        return [rng.randrange(100, vocab) for _ in range(max(1, round(n * scale)))]

    systems = [toks(144) for _ in range(3)]
    shared = toks(2083)
    return {
        "a: 3 system prompts x 3 rounds": [s + toks(16) for _ in range(3) for s in systems],
        f"b: {len(shared)}-token prefix + 8 queries": [shared + toks(rng.randint(28, 48)) for _ in range(8)],
        "c: no shared prefix": [toks(256) for _ in range(64)],
    }


def _ttfts(llm, prompts: list[list[int]]) -> tuple[list[float], list[int]]:
    """Each prompt's TTFT (seconds) and the tokens it found cached."""
    times, cached = [], []
    for p in prompts:
        sync(llm.llm_engine.device)
        start = time.perf_counter()
        out = llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
        sync(llm.llm_engine.device)
        times.append(time.perf_counter() - start)
        cached.append(out.num_cached_tokens)
    return times, cached


def _wall(llm, prompts: list[list[int]], rounds: int) -> float:
    """The workload in `rounds` batches (a round's requests together, rounds one after another)."""
    per_round = len(prompts) // rounds
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    sync(llm.llm_engine.device)
    start = time.perf_counter()
    for r in range(rounds):
        batch = prompts[r * per_round : (r + 1) * per_round]
        llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    sync(llm.llm_engine.device)
    return time.perf_counter() - start


def match_insert_us(prompt_len: int = 2000, iters: int = 2000, seed: int = 0) -> float:
    """Median CPU time of PrefixCache.acquire (match, lock, take references) + insert for a
    prompt whose first prompt_len - 10 tokens are cached (as when many requests share a long
    system prompt)."""
    from picovllm.engine.block_manager import BlockManager
    from picovllm.engine.prefix_cache import PrefixCache
    from picovllm.engine.request import Request

    bm = BlockManager(4 * prompt_len // 16 + 16, 16)
    cache = PrefixCache(bm, enabled=True)
    rng = random.Random(seed)
    prompt = [rng.randrange(150000) for _ in range(prompt_len)]

    def request(tokens):
        return Request("r", "r", 0, None, tokens, SamplingParams(), 0, None)

    first = request(prompt)
    cache.allocate(first, cache.acquire(first))
    cache.insert(first, first.num_tokens)
    cache.release(first)
    times = []
    for i in range(iters):
        req = request(prompt[:-10] + [i % 997, 5, 6, 7, 8, 9, 10, 11, 12, 13])
        start = time.perf_counter()
        needed = cache.acquire(req)
        elapsed = time.perf_counter() - start
        cache.allocate(req, needed)
        start = time.perf_counter()
        cache.insert(req, req.num_tokens)
        times.append(elapsed + time.perf_counter() - start)
        cache.release(req)
        if bm.num_free_blocks < prompt_len // 16 + 2:
            cache.reset()  # keep the pool from filling with the requests' distinct tails
            cache.allocate(first, cache.acquire(first))
            cache.insert(first, first.num_tokens)
            cache.release(first)
    times.sort()
    return times[len(times) // 2] * 1e6


def _measure(llm, mode: str, scenarios: dict, warmup: dict, floors: Floors, repeat: int) -> dict[str, dict]:
    """One engine (prefix caching `mode`, "on" or "off") through every scenario: its columns of
    each scenario's row. A warm-up first runs every scenario on other random tokens of the same
    lengths, so that kernel compilation (a GPU JIT) falls outside the timings; "cold" means the
    cache is."""
    for prompts in warmup.values():
        _ttfts(llm, prompts[:9])
        _wall(llm, prompts, 1)
        llm.reset_prefix_cache()
    rows = {}
    for name, prompts in scenarios.items():
        progress(f"prefix caching {mode}: {name}")
        rounds = 3 if name.startswith("a") else 1
        llm.reset_prefix_cache()
        before = llm.get_metrics()
        ttft, cached = _ttfts(llm, prompts[: 9 if rounds == 3 else 8])
        after = llm.get_metrics()
        queried = after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
        hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
        first = 3 if rounds == 3 else 1  # the cold requests
        cold, warm = ttft[:first], ttft[first:]
        floor = [floors.seconds(len(p), c) for p, c in zip(prompts[first:], cached[first:])]
        row = rows[name] = {
            f"ttft_cold_ms_{mode}": 1e3 * sum(cold) / len(cold),
            f"ttft_warm_ms_{mode}": 1e3 * sum(warm) / len(warm),
            f"hit_rate_{mode}": hits / max(queried, 1),
            f"ttft_warm_floor_ms_{mode}": 1e3 * sum(floor) / len(floor),
        }
        row[f"warm_{mode}_of_floor"] = row[f"ttft_warm_floor_ms_{mode}"] / row[f"ttft_warm_ms_{mode}"]
        walls = []
        for _ in range(repeat):  # the best of `repeat`
            llm.reset_prefix_cache()
            walls.append(_wall(llm, prompts, rounds))
        row[f"wall_s_{mode}"] = min(walls)
    return rows


def run_prefix(llm_kwargs: dict, seed: int = 0, repeat: int = 3, scale: float = 1.0) -> list[dict]:
    """The cache on, then off: one engine at a time (so that tensor-parallel engines, one a
    process, run it too)."""
    from picovllm import LLM

    kwargs = {**llm_kwargs, "skip_tokenizer_init": True}
    kwargs.pop("enable_prefix_caching", None)  # both settings are run
    columns, floors_of, scenarios, device = {}, None, None, None
    for mode in ("on", "off"):
        llm = LLM(**kwargs, enable_prefix_caching=mode == "on")
        if floors_of is None:
            vocab = min(llm.llm_engine.model_config.vocab_size, 30000)
            scenarios = _scenarios(random.Random(seed), vocab, scale)
            warmup = _scenarios(random.Random(seed + 1), vocab, scale)
            floors_of, device = Floors(llm), str(llm.llm_engine.device)
        for name, cols in _measure(llm, mode, scenarios, warmup, floors_of, repeat).items():
            columns.setdefault(name, {}).update(cols)
        llm.shutdown()
        del llm
        gc.collect()  # (the next engine sizes its KV pool from the memory this one leaves)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    rows = []
    for name, row in columns.items():
        row = {"scenario": name, **row}
        row["wall_on_vs_off"] = row["wall_s_on"] / row["wall_s_off"] - 1
        row["warm_ttft_speedup"] = row["ttft_warm_ms_off"] / row["ttft_warm_ms_on"]
        row["warm_ttft_bound"] = row["ttft_warm_floor_ms_off"] / row["ttft_warm_floor_ms_on"]
        rows.append(row)
    us = match_insert_us(iters=200 if scale < 1 else 2000)
    print_table(
        rows,
        [
            ("scenario", "scenario", ""),
            ("ttft_cold_ms_off", "TTFT cold off", ".1f"),
            ("ttft_warm_ms_off", "warm off", ".1f"),
            ("ttft_cold_ms_on", "cold on", ".1f"),
            ("ttft_warm_ms_on", "warm on", ".1f"),
            ("warm_ttft_speedup", "warm x", ".2f"),
            ("warm_ttft_bound", "bound x", ".2f"),
            ("warm_off_of_floor", "off at floor", ".0%"),
            ("warm_on_of_floor", "on at floor", ".0%"),
            ("hit_rate_on", "hit rate", ".1%"),
            ("wall_on_vs_off", "wall on vs off", "+.1%"),
        ],
    )
    print(f"PrefixCache match + insert, 2,000-token prompt: {us:.1f} us median (CPU)")
    print(
        f"floors: GEMM {floors_of.flop_s / 1e12:.3g} TFLOP/s, copy {floors_of.byte_s / 1e9:.1f} GB/s (measured); "
        "bound x: warm speedup with both settings at their floors; at floor: floor / TTFT"
    )
    print_json(
        "prefix",
        {
            "model": llm_kwargs.get("model"),
            "device": device,
            "match_insert_us": us,
            "gemm_tflop_s": floors_of.flop_s / 1e12,
            "copy_bandwidth_gb_s": floors_of.byte_s / 1e9,
            "results": rows,
        },
    )
    return rows
