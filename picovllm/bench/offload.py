"""The KV cache's host tier (kv_offload_memory) and swap preemption, benchmarked: the multi-turn
scenario of `picovllm bench prefix`, and `picovllm bench preemption`.

Multi-turn chats (run_multi_turn): --conversations conversations of --turns turns; the first prompt has
--first-len tokens, each later one the whole history (earlier prompts and answers) and
--turn-len new tokens; --answer-len tokens an answer. A round submits every conversation's next
turn at once. The GPU pool holds 1/--pressure of the final histories (their working set), and
max_num_seqs sequences run at a time. The host tier off, then on (sized for the whole working
set): hit rate, mean and p99 TTFT, wall time; the promotions' bytes, and the time of promoting
one history's blocks against a plain pinned host-to-device copy of as many bytes.
Preemption under KV pressure (run_preemption): --requests requests of --input-len prompt and
--output-len output tokens at once, in a pool that holds 1/--pressure of what they need; preemption_mode
"recompute", then "swap": throughput, preemptions, p50 / p99 request latency (and a line saying
so when nothing was preempted: the comparison is void then).
"""

from __future__ import annotations

import gc
import random
import time

import torch

from picovllm.bench.common import measure_rate, ms_stats, print_json, print_table, progress, sync
from picovllm.sampling_params import SamplingParams


def _drive(engine, prompts: list[list[int]], params: SamplingParams, ids: list[str]) -> dict[str, tuple]:
    """Submit prompts at once and step until all finish: id -> (TTFT s, latency s, output ids)."""
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    first, done = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, now - start)
            if out.finished:
                done[out.request_id] = (first[out.request_id], now - start, out.outputs[0].token_ids)
    return done


def _engine(kwargs: dict, **over):
    from picovllm import LLM

    return LLM(**{**kwargs, **over}, skip_tokenizer_init=True)


def _release(llm) -> None:
    llm.shutdown()
    del llm
    gc.collect()  # (the next engine sizes its pools from the memory this one leaves)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class CopyTimer:
    """The time the copies between the KV pools hold the compute stream during a run (their
    gathers and scatters, and waiting for the copy stream's PCIe transfers): CUDA events around
    each copy_blocks call on the compute stream (no synchronisation added), or the wall time of
    the calls on the CPU, where they are all there is."""

    def __init__(self, runner):
        self._runner, self._inner = runner, runner.copy_blocks
        self._cuda = runner.device.type == "cuda"
        self._events: list = []
        self._cpu_s = 0.0
        runner.copy_blocks = self._timed

    def _timed(self, copies) -> None:
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._inner(copies)
            end.record()
            self._events.append((start, end))
        else:
            t = time.perf_counter()
            self._inner(copies)
            self._cpu_s += time.perf_counter() - t

    def seconds(self) -> float:
        """Stops timing (the runner's own copy_blocks again); the copies' time in all."""
        del self._runner.copy_blocks
        if self._cuda:
            torch.cuda.synchronize(self._runner.device)
            return sum(start.elapsed_time(end) for start, end in self._events) / 1e3
        return self._cpu_s


def _block_bytes(kwargs: dict) -> tuple[int, int]:
    """(bytes of a KV block, the vocabulary) of the model, from a throwaway engine with a tiny pool."""
    llm = _engine(kwargs, kv_cache_memory=64 << 20, enforce_eager=True, max_model_len=256)  # (what 64 MiB holds)
    engine = llm.llm_engine
    sizes = engine.kv_block_bytes, min(engine.model_config.vocab_size, 30000)
    _release(llm)
    return sizes


def run_multi_turn(
    kwargs: dict,
    conversations: int,
    turns: int,
    first_len: int,
    turn_len: int,
    output_len: int,
    pressure: float,
    max_num_seqs: int,
    seed: int = 0,
) -> dict:
    block_bytes, vocab = _block_bytes(kwargs)
    bs = kwargs.get("block_size", 16)
    final = first_len + (turns - 1) * (turn_len + output_len) + output_len
    working_set = conversations * -(-final // bs) * block_bytes
    pool = max(int(working_set / pressure), max_num_seqs * -(-final // bs) * block_bytes)
    shape = dict(conversations=conversations, turns=turns, first_len=first_len, turn_len=turn_len)
    shape.update(output_len=output_len, vocab=vocab, final=final, seed=seed)
    results = {}
    for offload in (0, int(working_set * 1.25)):
        progress(f"{conversations} multi-turn chats of {turns} turns, the host tier {'on' if offload else 'off'}")
        llm = _engine(
            kwargs, kv_cache_memory=pool, kv_offload_memory=offload, max_num_seqs=max_num_seqs, max_model_len=final + bs
        )
        row = _multi_turn_chats(llm.llm_engine, offload > 0, **shape)
        results[row["tier"]] = row
        _release(llm)
    _print_multi_turn(results, final)
    result = {
        "conversations": conversations,
        "turns": turns,
        "gpu_pool_gb": pool / 1e9,
        "working_set_gb": working_set / 1e9,
        "off": results["off"],
        "on": results["on"],
    }
    print_json("offload_multi_turn", {"model": kwargs.get("model"), **result})
    return result


def _multi_turn_chats(
    engine, tier: bool, conversations, turns, first_len, turn_len, output_len, vocab, final, seed
) -> dict:
    """The chats on one engine (the host tier on or off): hit rates, TTFT, wall time, copies."""
    bs = engine.config.block_size
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    rng = random.Random(seed)
    history = [[rng.randrange(100, vocab) for _ in range(first_len - turn_len)] for _ in range(conversations)]
    _drive(engine, [[rng.randrange(100, vocab) for _ in range(turn_len)]], params, ["warm-up"])
    engine.reset_prefix_cache()
    before, ttfts = engine.get_metrics(), []
    timer = CopyTimer(engine.executor.driver.model_runner)
    sync(engine.device)
    start = time.perf_counter()
    for turn in range(turns):
        for h in history:
            h += [rng.randrange(100, vocab) for _ in range(turn_len)]
        ids = [f"{turn}-{c}" for c in range(conversations)]
        done = _drive(engine, [list(h) for h in history], params, ids)
        for h, rid in zip(history, ids):
            ttfts.append(done[rid][0])
            h += done[rid][2]
    sync(engine.device)
    wall = time.perf_counter() - start
    copy_s = timer.seconds()
    m = engine.get_metrics()
    queried = m["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
    row = {
        "tier": "on" if tier else "off",
        "hit_rate": (m["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]) / queried,
        "ttft_ms": ms_stats(ttfts),
        "wall_s": wall,
        "preemptions": m["num_preemptions"] - before["num_preemptions"],
    }
    if tier:
        row["host_hit_rate"] = (m["prefix_cache_host_hit_tokens"] - before["prefix_cache_host_hit_tokens"]) / queried
        row["promoted_gb"] = (m["kv_offload_bytes_to_gpu"] - before["kv_offload_bytes_to_gpu"]) / 1e9
        row["demoted_gb"] = (m["kv_offload_bytes_to_host"] - before["kv_offload_bytes_to_host"]) / 1e9
        row["copy_s"], row["copy_share"] = copy_s, copy_s / wall
        row.update(_promotion_bandwidth(engine, -(-final // bs)))
    return row


def _print_multi_turn(results: dict, final: int) -> None:
    rows = list(results.values())
    print_table(
        [{**r, "ttft_mean": r["ttft_ms"]["mean"], "ttft_p99": r["ttft_ms"]["p99"]} for r in rows],
        [
            ("tier", "host tier", ""),
            ("hit_rate", "hit rate", ".1%"),
            ("ttft_mean", "TTFT mean ms", ".1f"),
            ("ttft_p99", "p99", ".1f"),
            ("wall_s", "wall s", ".2f"),
            ("preemptions", "preemptions", "d"),
        ],
    )
    on = results["on"]
    print(
        f"host tier: {on['host_hit_rate']:.1%} of prompt tokens from the host; {on['promoted_gb']:.2f} GB promoted, "
        f"{on['demoted_gb']:.2f} GB demoted; one {final}-token history promoted in {on['promote_ms']:.2f} ms "
        f"({on['promote_gb_s']:.1f} GB/s; a pinned host-to-device copy of as many bytes: {on['h2d_gb_s']:.1f} GB/s); "
        f"the copies held the compute stream {on['copy_s']:.3f} s, {on['copy_share']:.1%} of the wall time"
    )


def _promotion_bandwidth(engine, num_blocks: int) -> dict[str, float]:
    """The model runner promoting num_blocks host blocks into GPU blocks (as a hit does), timed,
    against a pinned host-to-device copy of as many bytes."""
    runner, device = engine.executor.driver.model_runner, engine.device
    num_blocks = min(num_blocks, runner.host_kv.shape[0], runner.kv_cache.shape[2])
    nbytes = num_blocks * runner.kv_block_bytes()
    copy = [(False, list(range(num_blocks)), list(range(num_blocks)))]  # (the run is over: what they held is moot)

    promote = measure_rate(lambda: runner.copy_blocks(copy), nbytes, device, 10)  # (bytes/s)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    plain = measure_rate(lambda: target.copy_(host, non_blocking=True), nbytes, device, 10)
    return {"promote_ms": nbytes / promote * 1e3, "promote_gb_s": promote / 1e9, "h2d_gb_s": plain / 1e9}


def run_preemption(
    kwargs: dict, requests: int, prompt_len: int, output_len: int, pressure: float, seed: int = 0
) -> dict:
    block_bytes, vocab = _block_bytes(kwargs)
    bs = kwargs.get("block_size", 16)
    need = requests * -(-(prompt_len + output_len) // bs) * block_bytes
    pool = max(int(need / pressure), 2 * -(-(prompt_len + output_len) // bs) * block_bytes)
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(requests)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    rows, tokens = [], {}
    for mode in ("recompute", "swap"):
        progress(f"{requests} requests at once, preemption by {mode}")
        llm = _engine(
            kwargs,
            kv_cache_memory=pool,
            kv_offload_memory=need if mode == "swap" else 0,
            preemption_mode=mode,
            max_model_len=prompt_len + output_len + bs,
        )
        engine = llm.llm_engine
        _drive(engine, prompts[:1], SamplingParams(max_tokens=2), ["warm-up"])
        sync(engine.device)
        start = time.perf_counter()
        done = _drive(engine, prompts, params, [str(i) for i in range(requests)])
        sync(engine.device)
        wall = time.perf_counter() - start
        tokens[mode] = [done[str(i)][2] for i in range(requests)]
        m = engine.get_metrics()
        rows.append(
            {
                "preemption_mode": mode,
                "output_tok_s": requests * output_len / wall,
                "latency_ms": ms_stats([d[1] for d in done.values()]),
                "preemptions": m["num_preemptions"],
                "swapped": m.get("num_swapped_out", 0),
            }
        )
        _release(llm)
    print_table(
        [{**r, "p50": r["latency_ms"]["p50"], "p99": r["latency_ms"]["p99"]} for r in rows],
        [
            ("preemption_mode", "preemption", ""),
            ("output_tok_s", "output tok/s", ".0f"),
            ("p50", "latency p50 ms", ".0f"),
            ("p99", "p99", ".0f"),
            ("preemptions", "preemptions", "d"),
            ("swapped", "swapped", "d"),
        ],
    )
    result = {
        "requests": requests,
        "gpu_pool_gb": pool / 1e9,
        "need_gb": need / 1e9,
        "results": rows,
        "identical_outputs": sum(a == b for a, b in zip(tokens["recompute"], tokens["swap"])),
        "preempted": any(r["preemptions"] for r in rows),
    }
    if not result["preempted"]:
        print(
            "nothing was preempted: the pool held every request's KV, so the two runs compare nothing of "
            "preemption; raise --pressure or --requests"
        )
    print(
        f"{result['identical_outputs']} of {requests} requests generated the same tokens in both modes (a recomputed "
        "KV is computed by other kernels than the original: in bf16 it differs in its last bits)"
    )
    print_json("offload_preemption", {"model": kwargs.get("model"), **result})
    return result
