# Usage: PYTHONPATH=. python benchmarks/host_step.py  (CPU; needs the test dependencies)
"""Host time of a step at batch 256 with the forward stubbed out (tiny vocab logits): scheduler,
input building, sampling tensors, sampler on 307-wide logits, output processing."""
import sys, time
sys.path.insert(0, "tests")
import torch
from picovllm import LLM, SamplingParams, RequestOutputKind
from tiny_models import build_model
import tempfile
d = tempfile.mkdtemp()
build_model(d, tokenizer=False, seed=0)
llm = LLM(d, device="cpu", dtype="float32", skip_tokenizer_init=True, max_num_seqs=256, kv_cache_memory=256 << 20)
e = llm.llm_engine
r = e.model_runner
vocab = e.model_config.vocab_size
def fake_logits(batch):
    r.prepare(batch)
    return torch.randn(len(r.sampling_requests(batch)), vocab)
r.logits = fake_logits
for i in range(256):
    e.add_request(str(i), [3 + (j * 7 + i) % 300 for j in range(100 + i)],
                  SamplingParams(temperature=0.6, max_tokens=300, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY))
for _ in range(5): e.step()
best = 1e9
for _ in range(5):
    t = time.perf_counter()
    for _ in range(20): e.step()
    best = min(best, (time.perf_counter() - t) / 20)
print(f"host step at batch 256: {best*1e3:.2f} ms")
