"""FP8 weights (quantization="fp8", model/layers/fp8.py): the quantization's error bound, which
layers it quantizes, and the engine's output under it against the unquantized model's. The
kernels' FP8 path is in tests/test_kernels.py."""

import os
import shutil

import pytest
import torch
from conftest import make_llm

from picovllm import SamplingParams
from picovllm.model.layers.fp8 import FP8, FP8_MAX, dequantize_fp8, quantize_fp8


def test_quantize_fp8_bounds_each_weights_error_by_its_rows_scale():
    """e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most 1/16 of a normal value, and
    by half the smallest step (2^-10 of the row's scale) below the normal range; each row's
    largest magnitude maps to e4m3's largest (448); an all-zero row stays zero."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 300, generator=g) * torch.logspace(-4, 2, 64)[:, None]
    w[5] = 0.0
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (64,)
    back = dequantize_fp8(q, scale, torch.float32)
    bound = torch.maximum(w.abs() / 16, scale[:, None] * 2.0**-10)
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    rows = [r for r in range(64) if r != 5]
    assert torch.equal(q[rows].float().abs().amax(1), torch.full((63,), FP8_MAX))
    assert (back[5] == 0).all()


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _dequantized_copy(path: str, out: str) -> None:
    """The checkpoint at path with each projection's weight replaced by what its FP8 quantization
    stands for (quantized per row, then dequantized, in fp32): what an FP8 engine computes with,
    in a form the unquantized engine loads. (Per row, the fused layers' quantization is the
    checkpoint tensors': a fused row is one of theirs.)"""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            tensors[name] = dequantize_fp8(*quantize_fp8(t), torch.float32).to(t.dtype)
    save_file(tensors, os.path.join(out, "model.safetensors"))


@pytest.mark.parametrize("model", ["tiny_qwen", "tiny_llama"])
def test_fp8_engine_computes_with_the_quantized_weights(model, request, tmp_path):
    """The engine with quantization="fp8": every linear layer's weight in e4m3 with its scale, the
    embedding and the LM head not; its log-probabilities equal, to fp32's rounding, those of the
    unquantized engine on a checkpoint whose projections were quantized and dequantized, and its
    greedy tokens are the same, on the paths a request takes (chunked prompts in a 16-token
    budget, async scheduling, prefix cache hits). (How far FP8 is from the unquantized model is
    the quantization's error: the bound above.)"""
    path = request.getfixturevalue(model)[0]
    _dequantized_copy(path, str(tmp_path / "dequantized"))
    prompts = [{"prompt_token_ids": list(range(3 + i, 3 + i + 5 + 3 * i))} for i in range(8)]
    prompts += prompts[:2]  # (prefix cache hits)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=4)
    opts = dict(max_num_batched_tokens=16, max_num_seqs=4)
    expect = make_llm(str(tmp_path / "dequantized"), **opts).generate(prompts, params, use_tqdm=False)
    llm = make_llm(path, quantization="fp8", **opts)
    net = llm.llm_engine.executor.driver.model_runner.model
    layers = [m for n, m in net.named_modules() if n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))]
    assert len(layers) == 4 * net.config.num_hidden_layers
    assert all(m.weight.dtype == FP8 and m.weight_scale.shape == (m.weight.shape[0],) for m in layers)
    assert net.lm_head.weight.dtype != FP8 and net.model.embed_tokens.weight.dtype != FP8
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expect]
    for a, b in zip(got, expect):
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert step_a.keys() == step_b.keys()
            for token, lp in step_a.items():
                assert abs(lp.logprob - step_b[token].logprob) < 1e-4
