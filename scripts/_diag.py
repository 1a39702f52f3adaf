import time, torch, sys
sys.path.insert(0, "tests")
from picovllm import LLM, SamplingParams
from torch.profiler import profile, ProfilerActivity
llm = LLM("dummy:qwen2.5-1.5b", skip_tokenizer_init=True, gpu_memory_utilization=0.5)
p = [{"prompt_token_ids": list(range(100, 228))}]
sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
llm.generate(p, sp, use_tqdm=False)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate(p, sp, use_tqdm=False)
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=50))
del llm
import gc; gc.collect(); torch.cuda.empty_cache()
# parity diagnostics at Qwen2.5-1.5B shape
from transformers import Qwen2Config, Qwen2ForCausalLM
from picovllm.model.loader.builtin import DUMMY_CONFIGS
import tempfile
cfg = {k: v for k, v in DUMMY_CONFIGS["qwen2.5-1.5b"].items() if k not in ("architectures", "torch_dtype")}
for std in (0.02,):
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = Qwen2ForCausalLM(Qwen2Config(**cfg, initializer_range=std)).float().eval()
    d = tempfile.mkdtemp(); hf.save_pretrained(d)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 150000, (n,), generator=g).tolist() for n in [7, 100, 300]]
    for dt in ("float32", "bfloat16"):
        hf = hf.to(getattr(torch, dt))
        llm = LLM(d, dtype=dt, device="cuda", skip_tokenizer_init=True, gpu_memory_utilization=0.3)
        e = llm.llm_engine
        for i, pr in enumerate(prompts): e.add_request(f"{i}", pr, SamplingParams(max_tokens=1))
        b = e.scheduler.schedule()
        ours = e.model_runner.logits(b.requests, True).float()
        with torch.no_grad():
            ref = torch.stack([hf(torch.tensor([pr], device="cuda")).logits[0, -1].float() for pr in prompts])
            # single-sequence ours
        print(std, dt, "maxdiff", (ours-ref).abs().max().item(), "refmax", ref.abs().max().item(), "argmax eq", (ours.argmax(-1)==ref.argmax(-1)).tolist())
        e.abort_request([f"{i}" for i in range(3)])
        del llm, e; gc.collect(); torch.cuda.empty_cache()
