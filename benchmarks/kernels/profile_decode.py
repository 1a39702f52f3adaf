"""GPU time per kernel of a step, Qwen2.5-1.5B shapes with random weights (GPU only).

Usage: PYTHONPATH=. python benchmarks/kernels/profile_decode.py [BATCH] [graphs] [fp8]
         a decode step at BATCH (without "graphs" the step runs eagerly; "fp8": FP8 weights);
       PYTHONPATH=. python benchmarks/kernels/profile_decode.py prefix [CACHED] [NEW]
         the warm request of `picovllm bench prefix` scenario b: a prompt whose first CACHED
         tokens (default 2083) are in the prefix cache and NEW (default 40) are not, with the
         default engine (graphs); prints its wall time (TTFT) next to the GPU kernel time, and
         the time line of one request (host phases, GPU time; see timeline());
         `prefix 0 2123`: the same prompt's cold prefill;
       PYTHONPATH=. python benchmarks/kernels/profile_decode.py mixed [BATCH] [NEW]
         a serving step: BATCH (default 64) decodes plus a NEW-token prompt (default 448) in every
         step, with the default engine (mixed-step graphs); prints the wall time per step.
       PYTHONPATH=. python benchmarks/kernels/profile_decode.py serve [BUDGET] [CLIENTS]
         the engine alone under `picovllm bench serve`'s closed loop (CLIENTS requests of 512
         prompt and 128 output tokens, a new one as each finishes, max_num_seqs CLIENTS, a step
         budget of BUDGET tokens): the interval between steps (what a stream's inter-token latency
         is made of, before HTTP), the GPU and host time per step, and what the slowest steps carry;
         `serve BUDGET CLIENTS profile`: then the kernels of 50 more steps (PDL off);
         `serve BUDGET CLIENTS host`: then where the host time of 300 more steps goes (cProfile).
       PYTHONPATH=. python benchmarks/kernels/profile_decode.py throughput
         `picovllm bench throughput`'s workload, stepped by hand: its wall time by the kind of step
         (with prompt tokens; decodes only, by batch), each kind's GPU and host time per step.

Programmatic dependent launch is off here unless `pdl` ends the arguments: with it, each
kernel starts while the previous one drains, so the kernels' times overlap and no longer add up
to the step (2.19 ms of kernel time in a 1.50 ms step at batch 1). The wall times printed are
without it too, except in `serve` and `throughput`, which run the engine's defaults (PDL on) and read
no kernel times."""

import collections
import gc
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from picovllm import LLM, SamplingParams
from picovllm.kernels import triton_utils

if (sys.argv[1:2] not in (["serve"], ["throughput"]) or "profile" in sys.argv) and "pdl" not in sys.argv:
    triton_utils.PDL = False  # (serve, throughput: the engine's defaults, PDL on; see above)

STEPS = 10


def report(prof, steps: int, label: str) -> None:
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events)
    print(
        f"{label}: GPU kernel time per step {total / steps / 1e3:.3f} ms, "
        f"kernels per step {sum(e.count for e in events) / steps:.0f}"
    )
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"{e.self_device_time_total / steps:9.1f} us/step  x{e.count / steps:5.0f}  {e.key[:90]}")


def decode(batch: int, eager: bool, quantization: str | None) -> None:
    llm = LLM(
        "dummy:qwen2.5-1.5b",
        device="cuda",
        skip_tokenizer_init=True,
        enforce_eager=eager,
        gpu_memory_utilization=0.5,
        quantization=quantization,
    )
    engine = llm.llm_engine
    for i in range(batch):
        engine.add_request(
            str(i), list(range(100, 228)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        )
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            engine.step()
        torch.cuda.synchronize()
    report(prof, STEPS, f"decode batch {batch}")


def timeline(llm, prompts: list, params: SamplingParams) -> None:
    """Median phases of one-request generate() calls: host time before the engine's step, in the
    scheduler, launching the step (prepare, graph replay, LM head and sampler launches), and the
    GPU time from the launch's start to its end (CUDA events)."""
    engine = llm.llm_engine
    marks: dict = {}

    def timed(name, fn):  # (the first call of each generate())
        def call(*args, **kwargs):
            marks.setdefault(name + "0", time.perf_counter())
            out = fn(*args, **kwargs)
            marks.setdefault(name + "1", time.perf_counter())
            return out

        return call

    def launch(*args, **kwargs):
        first = "events" not in marks
        if first:
            marks["events"] = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            marks["events"][0].record()
        out = timed("launch", original[1])(*args, **kwargs)
        if first:
            marks["events"][1].record()
        return out

    original = engine.scheduler.schedule, engine.launcher.launch, engine.step
    engine.scheduler.schedule, engine.launcher.launch, engine.step = (
        timed("schedule", original[0]),
        launch,
        timed("step", original[2]),
    )
    rows = []
    try:
        for p in prompts:
            marks.clear()
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(p, params, use_tqdm=False)
            end = time.perf_counter()
            torch.cuda.synchronize()
            rows.append(
                (
                    (end - start) * 1e3,
                    (marks["step0"] - start) * 1e3,
                    (marks["schedule1"] - marks["schedule0"]) * 1e3,
                    (marks["launch1"] - marks["launch0"]) * 1e3,
                    marks["events"][0].elapsed_time(marks["events"][1]),
                )
            )
    finally:
        engine.scheduler.schedule, engine.launcher.launch, engine.step = original
    med = [sorted(col)[len(col) // 2] for col in zip(*rows)]
    print(
        f"timeline (median ms of {len(rows)}): generate {med[0]:.2f} = before the step {med[1]:.2f}, schedule "
        f"{med[2]:.2f}, launch (host) {med[3]:.2f}; GPU from the launch's start to its end {med[4]:.2f}"
    )


def warm_prefill(cached: int = 2083, new: int = 40) -> None:
    llm = LLM("dummy:qwen2.5-1.5b", device="cuda", skip_tokenizer_init=True, gpu_memory_utilization=0.5)
    prefix = [100 + i % 1000 for i in range(cached)]
    one = SamplingParams(max_tokens=1)
    if cached:
        llm.generate({"prompt_token_ids": prefix}, one, use_tqdm=False)
    queries = [{"prompt_token_ids": prefix + [2000 + 7 * q + i for i in range(new)]} for q in range(2 * STEPS)]
    for q in queries[:STEPS]:  # warm-up (kernel compilation)
        llm.generate(q, one, use_tqdm=False)
    timeline(llm, [{"prompt_token_ids": prefix + [3000 + 7 * q + i for i in range(new)]} for q in range(STEPS)], one)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for q in queries[STEPS:]:
            out = llm.generate(q, one, use_tqdm=False)[0]
            assert out.num_cached_tokens == cached // 16 * 16, out.num_cached_tokens
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / STEPS
    print(
        f"{'warm' if cached else 'cold'} prefill, {cached} cached + {new} new tokens: "
        f"wall {wall * 1e3:.2f} ms per request (profiled)"
    )
    report(prof, STEPS, "warm prefill")


def mixed(batch: int = 64, new: int = 448) -> None:
    llm = LLM("dummy:qwen2.5-1.5b", device="cuda", skip_tokenizer_init=True, gpu_memory_utilization=0.5)
    engine = llm.llm_engine
    for i in range(batch):
        engine.add_request(f"d{i}", list(range(100, 612)), SamplingParams(max_tokens=1000, ignore_eos=True))
    one = SamplingParams(max_tokens=1)
    steps = [0]

    def step():  # one new prompt per step; it leaves once its first token is sampled
        engine.add_request(f"p{steps[0]}", [1000 + (steps[0] * 7 + i) % 5000 for i in range(new)], one)
        steps[0] += 1
        engine.step()

    for _ in range(40):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    print(
        f"mixed step, {batch} decodes + {new} prompt tokens: wall {(time.perf_counter() - start) / STEPS * 1e3:.2f} "
        f"ms per step (not profiled)"
    )
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    report(prof, STEPS, "mixed step")


def count_launches(engine) -> collections.deque:
    """Wraps engine.launcher.launch: for each step launched, appends (decodes, prompt tokens,
    launched ahead, prompts, one of them a first chunk, host ms of the launch, two CUDA events
    around it) to the deque returned; steps return in launch order, so the engine's step pops
    the oldest."""
    launched, launch = collections.deque(), engine.launcher.launch

    def counted_launch(batch, num_pending=0, pending_rows=None, before=None):
        new = batch.num_new_tokens
        prompts = [r for r, n in zip(batch.requests, new) if n > 1]
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        marks[0].record()
        t0 = time.perf_counter()
        step = launch(batch, num_pending, pending_rows, before)
        took = (time.perf_counter() - t0) * 1e3
        marks[1].record()  # the GPU time between the two marks is this step's own work (and any wait for the host)
        launched.append(
            (
                sum(n == 1 for n in new),
                sum(n for n in new if n > 1),
                num_pending > 0,
                len(prompts),
                any(r.num_computed_tokens == n for r, n in zip(batch.requests, new) if n > 1),
                took,
                marks,
            )
        )
        return step

    engine.launcher.launch = counted_launch
    return launched


def serve_steps(
    budget: int = 128,
    clients: int = 64,
    profiled: bool = False,
    host_profiled: bool = False,
    steps: int = 1500,
    warmup: int = 300,
    model: str = "dummy:qwen2.5-1.5b",
    device: str = "cuda",
) -> list[tuple]:
    llm = LLM(
        model,
        device=device,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.5,
        max_num_seqs=clients,
        max_num_batched_tokens=budget,
    )
    engine = llm.llm_engine
    launched = count_launches(engine)
    collections_started = [0]

    def on_gc(phase, info):
        collections_started[0] += phase == "start"

    gc.callbacks.append(on_gc)
    added = [0]

    def add():
        i = added[0]
        added[0] += 1
        engine.add_request(
            str(i),
            [(100 + i * 7 + j) % engine.model_config.vocab_size for j in range(512)],
            SamplingParams(max_tokens=128, ignore_eos=True),
        )

    def run(n: int) -> None:  # (after the timed loop: the profiles' steps)
        for _ in range(n):
            for out in engine.step():
                if out.finished:
                    add()

    for _ in range(clients):
        add()
    rows, last = [], time.perf_counter()
    for i in range(warmup + steps):
        before, host = collections_started[0], engine.host_time_s
        outs = engine.step()
        now = time.perf_counter()
        decodes, prompt_tokens, ahead, prompts, first_chunk, took, marks = launched.popleft()
        if i >= warmup:  # (interval ms, decodes, prompt tokens, launched ahead, a collection ran, ...)
            rows.append(
                [
                    (now - last) * 1e3,
                    decodes,
                    prompt_tokens,
                    ahead,
                    collections_started[0] > before,
                    prompts,
                    first_chunk,
                    took,
                    (engine.host_time_s - host) * 1e3,
                    marks,
                ]
            )
        last = now
        for out in outs:
            if out.finished:
                add()
    torch.cuda.synchronize()
    gc.callbacks.remove(on_gc)
    for r in rows:  # GPU ms of the step's own work (launched ahead, so not the time it waited)
        r[-1] = r[-1][0].elapsed_time(r[-1][1])

    def pick(values: list[float], q: float) -> float:  # (values sorted)
        return values[min(len(values) - 1, int(q * len(values)))]

    ms = sorted(r[0] for r in rows)
    print(
        f"serving steps, budget {budget}, {clients} clients, {len(rows)} steps: interval ms p50 {pick(ms, 0.5):.2f} "
        f"p90 {pick(ms, 0.9):.2f} p99 {pick(ms, 0.99):.2f} max {ms[-1]:.2f}"
    )
    for label, sel in (
        ("all steps", rows),
        ("slowest 5%", [r for r in rows if r[0] >= pick(ms, 0.95)]),
        ("slowest 1%", [r for r in rows if r[0] >= pick(ms, 0.99)]),
    ):
        k = max(len(sel), 1)
        print(
            f"  {label:11s} ({len(sel):4d}): decodes {sum(r[1] for r in sel) / k:5.1f}, prompt tokens "
            f"{sum(r[2] for r in sel) / k:5.1f}, no prompt tokens {sum(r[2] == 0 for r in sel) / k:5.1%}, "
            f"launched ahead {sum(r[3] for r in sel) / k:5.1%}, a GC collection {sum(r[4] for r in sel) / k:5.1%}"
        )
    gpu, host = sorted(r[-1] for r in rows), sorted(r[-2] for r in rows)
    print(
        f"  mean interval {sum(ms) / len(ms):.2f} ms, mean GPU time {sum(gpu) / len(gpu):.2f} ms; host ms per step "
        f"(not waiting for the GPU) p50 {pick(host, 0.5):.2f} p90 {pick(host, 0.9):.2f} p99 {pick(host, 0.99):.2f}"
    )
    print(
        f"  GPU ms per step p50 {pick(gpu, 0.5):.2f} p90 {pick(gpu, 0.9):.2f} p99 {pick(gpu, 0.99):.2f} "
        f"max {gpu[-1]:.2f}"
    )
    for k in sorted({r[5] for r in rows}):
        for first in (False, True):
            sel = sorted(r[-1] for r in rows if r[5] == k and r[6] == first)
            took = sorted(r[7] for r in rows if r[5] == k and r[6] == first)
            if sel:
                print(
                    f"  {k} prompts{', one a first chunk' if first else ''}: {len(sel)} steps, GPU ms p50 "
                    f"{pick(sel, 0.5):.2f} p90 {pick(sel, 0.9):.2f} max {sel[-1]:.2f}; "
                    f"launch (host) ms p50 {pick(took, 0.5):.2f} p90 {pick(took, 0.9):.2f}"
                )
    if host_profiled:  # where the host time of 300 more steps goes (cProfile: slower steps, the same calls)
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        run(300)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if profiled:  # the kernels of 50 more steps (run with PDL off: kernel times then add up)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(50)
            torch.cuda.synchronize()
        report(prof, 50, f"serving step, budget {budget}")
    return rows


def throughput_steps(
    model: str = "dummy:qwen2.5-1.5b", device: str = "cuda", num_prompts: int = 256, max_len: int = 1024
) -> list[list]:
    """`picovllm bench throughput`'s workload (its requests, lengths and seed) stepped by hand: where
    its wall time goes, by the kind of step (carrying prompt tokens or decodes only, by batch)."""
    from picovllm.bench.throughput import workload

    llm = LLM(model, device=device, skip_tokenizer_init=True, max_model_len=4 * max_len)
    engine = llm.llm_engine
    prompts, params = workload(engine.model_config.vocab_size, num_prompts, 100, max_len)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4), use_tqdm=False)
    torch.cuda.synchronize()
    launched = count_launches(engine)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    rows, start = [], time.perf_counter()
    last = start
    while engine.has_unfinished_requests():
        host = engine.host_time_s
        engine.step()
        now = time.perf_counter()
        decodes, prompt_tokens, _, _, _, _, marks = launched.popleft()
        rows.append([(now - last) * 1e3, decodes, prompt_tokens, (engine.host_time_s - host) * 1e3, marks])
        last = now
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e3
    for r in rows:
        r[-1] = r[-1][0].elapsed_time(r[-1][1])
    tokens = sum(sp.max_tokens for sp in params)
    print(
        f"throughput workload: {num_prompts} requests, {tokens} output tokens in {wall / 1e3:.2f} s "
        f"({tokens / wall * 1e3:.0f} output tok/s), {len(rows)} steps; the steps' GPU spans "
        f"(launch to end) {sum(r[-1] for r in rows) / wall:.1%} of the wall time"
    )
    kinds = [("with prompt tokens", lambda r: r[2] > 0)]
    for lo, hi in ((1, 8), (9, 32), (33, 64), (65, 128), (129, 192), (193, 256)):
        kinds.append((f"decodes only, {lo}-{hi}", lambda r, lo=lo, hi=hi: r[2] == 0 and lo <= r[1] <= hi))
    for label, pick in kinds:
        sel = [r for r in rows if pick(r)]
        if sel:
            k, span = len(sel), sum(r[0] for r in sel)
            print(
                f"  {label:24s} {k:5d} steps, {span / wall:6.1%} of the wall: ms a step {span / k:6.2f} "
                f"(GPU {sum(r[4] for r in sel) / k:6.2f}, host {sum(r[3] for r in sel) / k:5.2f}), decodes "
                f"{sum(r[1] for r in sel) / k:6.1f}, prompt tokens {sum(r[2] for r in sel) / k:6.1f}, "
                f"{sum(r[1] for r in sel) / span:6.1f} decodes a ms"
            )
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "prefix":
        warm_prefill(*(int(a) for a in sys.argv[2:4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "mixed":
        mixed(*(int(a) for a in sys.argv[2:4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "throughput":
        throughput_steps()
    elif len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve_steps(*(int(a) for a in sys.argv[2:4]), profiled="profile" in sys.argv, host_profiled="host" in sys.argv)
    else:
        decode(
            int(sys.argv[1]) if len(sys.argv) > 1 else 1,
            "graphs" not in sys.argv,
            "fp8" if "fp8" in sys.argv else None,
        )
