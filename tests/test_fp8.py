"""FP8 weights (quantization="fp8", model/layers/fp8.py): the quantization's error bound, which
layers it quantizes, and the engine's output under it against the unquantized model's. The
kernels' FP8 path is in tests/test_kernels.py."""

import json
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


def _rewritten(path: str, out: str, change, config=None) -> None:
    """A copy at out of the checkpoint at path, its tensors (name -> tensor) changed in place by
    change, and its config.json by config (a function of the dict, if given)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    change(tensors)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    if config is not None:
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
        config(cfg)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f)


def _projections(tensors: dict) -> list[str]:
    return [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]


def _dequantized_copy(path: str, out: str) -> None:
    """The checkpoint at path with each projection's weight replaced by what its FP8 quantization
    stands for (quantized per row, then dequantized, in fp32): what an FP8 engine computes with,
    in a form the unquantized engine loads. (Per row, the fused layers' quantization is the
    checkpoint tensors': a fused row is one of theirs.)"""

    def change(tensors):
        for name in _projections(tensors):
            tensors[name] = dequantize_fp8(*quantize_fp8(tensors[name]), torch.float32).to(tensors[name].dtype)

    _rewritten(path, out, change)


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
    _assert_same_outputs(llm.generate(prompts, params, use_tqdm=False), expect)


def _assert_same_outputs(got, expect) -> None:
    """The same tokens, and log-probabilities equal to fp32's rounding."""
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expect]
    for a, b in zip(got, expect):
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert step_a.keys() == step_b.keys()
            for token, lp in step_a.items():
                assert abs(lp.logprob - step_b[token].logprob) < 1e-4


def _fp8_checkpoint(path: str, out: str, per_tensor: bool) -> None:
    """The checkpoint at path as an FP8 one, in the format vLLM and llm-compressor write: each
    projection's weight in e4m3 with `weight_scale` (one per tensor, or one per row as [rows, 1]),
    a static `input_scale` beside it, config.json's quantization_config saying so."""

    def change(tensors):
        for name in _projections(tensors):
            w = tensors[name]
            if per_tensor:  # (one scale: the tensor's largest magnitude at e4m3's largest)
                scale = (w.abs().max().float() / FP8_MAX).reshape(())
                tensors[name] = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            else:
                tensors[name], scale = quantize_fp8(w)
                scale = scale[:, None]
            tensors[name.removesuffix("weight") + "weight_scale"] = scale
            tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.01)

    def config(cfg):
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}

    _rewritten(path, out, change, config)


@pytest.mark.parametrize("per_tensor", [False, True])
def test_an_fp8_checkpoint_loads_as_it_is(tiny_qwen, tmp_path, per_tensor):
    """A checkpoint with quant_method "fp8" loads its e4m3 weights and scales without quantizing
    again (quantization need not be given): the same tokens and log-probabilities as the
    unquantized engine on those weights dequantized; a scale per tensor serves every row of it.
    What the engine cannot run is refused when the config is read: block-wise FP8, another method."""
    from picovllm.config import ModelConfig

    ckpt = str(tmp_path / "fp8")
    _fp8_checkpoint(tiny_qwen[0], ckpt, per_tensor)

    def dequantize(tensors):  # (the FP8 checkpoint's weights as the unquantized engine loads them)
        for name in [n for n in tensors if n.endswith("weight_scale")]:
            weight = name.removesuffix("_scale")
            scale = tensors.pop(name).float().reshape(-1).expand(tensors[weight].shape[0])
            tensors[weight] = dequantize_fp8(tensors[weight], scale, torch.float32)
            tensors.pop(weight.removesuffix("weight") + "input_scale")

    _rewritten(ckpt, str(tmp_path / "dequantized"), dequantize, lambda cfg: cfg.pop("quantization_config"))

    prompts = [{"prompt_token_ids": list(range(3 + i, 3 + i + 4 + 5 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    expect = make_llm(str(tmp_path / "dequantized")).generate(prompts, params, use_tqdm=False)
    llm = make_llm(ckpt)
    qkv = llm.llm_engine.executor.driver.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8
    if per_tensor:  # (q, k and v each had one scale: three runs of equal rows)
        assert len(set(qkv.weight_scale.tolist())) == 3
    _assert_same_outputs(llm.generate(prompts, params, use_tqdm=False), expect)
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    for quant, error in (
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise FP8"),
        ({"quant_method": "gptq"}, "'gptq' is not supported"),
    ):
        with pytest.raises(ValueError, match=error):
            ModelConfig.from_dict({**cfg, "quantization_config": quant})
