"""GPU time per kernel of a step, Qwen2.5-1.5B shapes with random weights (GPU only).

Usage: PYTHONPATH=. python benchmarks/profile_decode.py [BATCH] [graphs]
         a decode step at BATCH (without "graphs" the step runs eagerly);
       PYTHONPATH=. python benchmarks/profile_decode.py prefix [CACHED] [NEW]
         the warm request of `picovllm bench prefix` scenario b: a prompt whose first CACHED
         tokens (default 2083) are in the prefix cache and NEW (default 40) are not, with the
         default engine (graphs); prints its wall time (TTFT) next to the GPU kernel time.
         `prefix 0 2123`: the same prompt's cold prefill;
       PYTHONPATH=. python benchmarks/profile_decode.py mixed [BATCH] [NEW]
         a serving step: BATCH (default 64) decodes plus a NEW-token prompt (default 448) in every
         step, with the default engine (mixed-step graphs); prints the wall time per step.

Programmatic dependent launch is off here unless PICOVLLM_PDL=1 is set: with it, each kernel starts
while the previous one drains, so the kernels' times overlap and no longer add up to the step
(2.19 ms of kernel time in a 1.50 ms step at batch 1). The wall times printed are without it too."""
import os
import sys
import time

os.environ.setdefault("PICOVLLM_PDL", "0")  # before picovllm is imported (see above)

import torch
from torch.profiler import ProfilerActivity, profile

from picovllm import LLM, SamplingParams

STEPS = 10


def report(prof, steps: int, label: str) -> None:
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events)
    print(f"{label}: GPU kernel time per step {total / steps / 1e3:.3f} ms, "
          f"kernels per step {sum(e.count for e in events) / steps:.0f}")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"{e.self_device_time_total / steps:9.1f} us/step  x{e.count / steps:5.0f}  {e.key[:90]}")


def decode(batch: int, eager: bool) -> None:
    llm = LLM("dummy:qwen2.5-1.5b", device="cuda", skip_tokenizer_init=True, enforce_eager=eager,
              gpu_memory_utilization=0.5)
    engine = llm.llm_engine
    for i in range(batch):
        engine.add_request(str(i), list(range(100, 228)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            engine.step()
        torch.cuda.synchronize()
    report(prof, STEPS, f"decode batch {batch}")


def warm_prefill(cached: int = 2083, new: int = 40) -> None:
    llm = LLM("dummy:qwen2.5-1.5b", device="cuda", skip_tokenizer_init=True, gpu_memory_utilization=0.5)
    prefix = [100 + i % 1000 for i in range(cached)]
    one = SamplingParams(max_tokens=1)
    if cached:
        llm.generate({"prompt_token_ids": prefix}, one, use_tqdm=False)
    queries = [{"prompt_token_ids": prefix + [2000 + 7 * q + i for i in range(new)]} for q in range(2 * STEPS)]
    for q in queries[:STEPS]:  # warm-up (kernel compilation)
        llm.generate(q, one, use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for q in queries[STEPS:]:
            out = llm.generate(q, one, use_tqdm=False)[0]
            assert out.num_cached_tokens == cached // 16 * 16, out.num_cached_tokens
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / STEPS
    print(f"{'warm' if cached else 'cold'} prefill, {cached} cached + {new} new tokens: wall {wall * 1e3:.2f} ms per request (profiled)")
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
    print(f"mixed step, {batch} decodes + {new} prompt tokens: wall {(time.perf_counter() - start) / STEPS * 1e3:.2f} "
          f"ms per step (not profiled)")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    report(prof, STEPS, "mixed step")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "prefix":
        warm_prefill(*(int(a) for a in sys.argv[2:4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "mixed":
        mixed(*(int(a) for a in sys.argv[2:4]))
    else:
        decode(int(sys.argv[1]) if len(sys.argv) > 1 else 1, len(sys.argv) < 3 or sys.argv[2] != "graphs")
