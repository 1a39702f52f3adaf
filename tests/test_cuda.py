"""bf16 parity with transformers on the GPU, at Qwen2.5-1.5B's exact shapes with random weights.
Runs where CUDA is available (scripts/gpu_check.sh); skipped on CPU-only machines.

bf16 tolerances are measured, not guessed: against an fp32 copy of the same model, our bf16 logits
may be off by at most twice what transformers' own bf16 logits are off by; and a reference top-2
gap within twice that bf16 noise is a near-tie that may legitimately flip."""
import pytest
import torch
from hf_reference import assert_greedy_match, hf_greedy

from picovllm import LLM, SamplingParams
from picovllm.model.loader.builtin import DUMMY_CONFIGS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

N_TOKENS = 48
PROMPT_LENS = [1, 7, 16, 17, 31, 64, 100, 128, 129, 200, 255, 300, 333, 400, 450, 511]


@pytest.fixture(scope="module")
def qwen_1p5b(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = {k: v for k, v in DUMMY_CONFIGS["qwen2.5-1.5b"].items() if k not in ("architectures", "torch_dtype")}
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = Qwen2ForCausalLM(Qwen2Config(**cfg)).to(torch.bfloat16).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(2.5)  # peakier logits: fewer near-ties in random weights
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path = str(tmp_path_factory.mktemp("qwen1p5b"))
    hf.save_pretrained(path)
    return path, hf


@torch.no_grad()
def _last_logits(model, prompts):
    return torch.stack([model(torch.tensor([p], device="cuda")).logits[0, -1].float() for p in prompts])


def test_bf16_parity_qwen2_5_1_5b_shape(qwen_1p5b):
    path, hf = qwen_1p5b
    llm = LLM(path, dtype="bfloat16", device="cuda", skip_tokenizer_init=True, gpu_memory_utilization=0.5)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 150000, (n,), generator=g).tolist() for n in PROMPT_LENS]

    engine = llm.llm_engine  # prefill logits of the whole batch
    for i, p in enumerate(prompts):
        engine.add_request(f"l{i}", p, SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    ours = engine.model_runner.logits(batch.requests, True).float()
    engine.abort_request([f"l{i}" for i in range(len(prompts))])
    hf_bf16 = _last_logits(hf, prompts)
    hf.float()
    ref = _last_logits(hf, prompts)
    hf.to(torch.bfloat16)
    our_err, hf_err = (ours - ref).abs().max().item(), (hf_bf16 - ref).abs().max().item()
    print(f"\nbf16 logits vs fp32: ours max abs err {our_err:.4f}, transformers' {hf_err:.4f} "
          f"(logit max {ref.abs().max().item():.2f})")
    assert our_err <= 2 * hf_err + 1e-3

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True), use_tqdm=False)
    tie_tol = 2 * hf_err
    compared = []
    for p, out in zip(prompts, outs):
        ref_tokens, gaps = hf_greedy(hf, p, N_TOKENS)
        compared.append(assert_greedy_match(out.outputs[0].token_ids, ref_tokens, gaps, tie_tol))
    print(f"greedy tokens equal before the reference's first near-tie (top-2 gap < {tie_tol:.3f}), "
          f"per prompt: {compared}")
    assert sum(c >= 32 for c in compared) > len(prompts) // 2, compared
