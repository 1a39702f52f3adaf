"""GPU time per kernel of a decode step, Qwen2.5-1.5B shapes with random weights (GPU only).

Usage: PYTHONPATH=. python benchmarks/profile_decode.py [BATCH] [graphs]
(without "graphs" the step runs eagerly)."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from picovllm import LLM, SamplingParams

STEPS = 10


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    eager = len(sys.argv) < 3 or sys.argv[2] != "graphs"
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
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events)
    print(f"batch {batch}: GPU kernel time per step {total / STEPS / 1e3:.3f} ms, "
          f"kernels per step {sum(e.count for e in events) / STEPS:.0f}")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"{e.self_device_time_total / STEPS:9.1f} us/step  x{e.count / STEPS:5.0f}  {e.key[:90]}")


if __name__ == "__main__":
    main()
