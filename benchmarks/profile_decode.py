"""GPU time per kernel of a decode step at batch B (argv[1]; argv[2] = "graphs" replays CUDA graphs,
otherwise eager), Qwen2.5-1.5B shapes, random weights. GPU only."""
import sys, torch, time
from torch.profiler import profile, ProfilerActivity
from picovllm import LLM, SamplingParams
B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
EAGER = len(sys.argv) < 3 or sys.argv[2] != "graphs"
llm = LLM("dummy:qwen2.5-1.5b", device="cuda", skip_tokenizer_init=True, enforce_eager=EAGER, gpu_memory_utilization=0.5)
e = llm.llm_engine
for i in range(B):
    e.add_request(str(i), list(range(100, 228)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
for _ in range(20): e.step()
torch.cuda.synchronize()
N = 10
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(N): e.step()
    torch.cuda.synchronize()
ka = prof.key_averages()
rows = sorted(ka, key=lambda k: -k.self_device_time_total)
tot = sum(k.self_device_time_total for k in ka)
print(f"bs={B}: GPU kernel time per step {tot/N/1e3:.3f} ms, kernels/step {sum(k.count for k in ka)/N:.0f}")
for k in rows[:25]:
    print(f"{k.self_device_time_total/N:9.1f} us/step  x{k.count/N:5.0f}  {k.key[:90]}")
