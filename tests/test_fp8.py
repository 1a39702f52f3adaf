"""FP8 weights (quantization="fp8", model/layers/fp8.py): the quantization's error bound, which
layers it quantizes, and the engine's output under it (W8A8: the activations quantized per token)
against transformers' model computing the same. The kernels' FP8 path is in tests/test_kernels.py."""

import json
import os
import shutil

import pytest
import torch
from conftest import FP32_ONLY, make_llm

from picovllm import SamplingParams
from picovllm.kernels.fp8_gemm import per_token_fp8_ref
from picovllm.model.layers.fp8 import FP8, FP8_MAX, quantize_fp8


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The weight an e4m3 one with its scale per row stands for, in fp32."""
    return weight.float() * scale[:, None]


def test_quantize_fp8_bounds_each_weights_error_by_its_rows_scale():
    """e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most 1/16 of a normal value, and
    by half the smallest step (2^-10 of the row's scale) below the normal range; each row's
    largest magnitude maps to e4m3's largest (448); an all-zero row stays zero."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 300, generator=g) * torch.logspace(-4, 2, 64)[:, None]
    w[5] = 0.0
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (64,)
    back = dequantize_fp8(q, scale)
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
            tensors[name] = dequantize_fp8(*quantize_fp8(tensors[name])).to(tensors[name].dtype)

    _rewritten(path, out, change)


@FP32_ONLY
@pytest.mark.parametrize("model", ["tiny_qwen", "tiny_llama"])
def test_fp8_engine_computes_with_the_quantized_weights(model, request, tmp_path):
    """The engine with quantization="fp8": every linear layer's weight in e4m3 with its scale, the
    embedding and the LM head not; its tokens and log-probabilities those of transformers' model
    on the weights the FP8 ones stand for, each projection's input quantized per token (W8A8), on
    the paths a request takes (chunked prompts in a 16-token budget, async scheduling, prefix
    cache hits). (How far FP8 is from the unquantized model is the quantization's error: the
    bound above.)"""
    path = request.getfixturevalue(model)[0]
    _dequantized_copy(path, str(tmp_path / "dequantized"))
    llm = make_llm(path, quantization="fp8", max_num_batched_tokens=16, max_num_seqs=4)
    net = llm.llm_engine.executor.driver.model_runner.model
    layers = [m for n, m in net.named_modules() if n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))]
    assert len(layers) == 4 * net.config.num_hidden_layers
    assert all(m.weight.dtype == FP8 and m.weight_scale.shape == (m.weight.shape[0],) for m in layers)
    assert net.lm_head.weight.dtype != FP8 and net.model.embed_tokens.weight.dtype != FP8
    prompts = [list(range(3 + i, 3 + i + 5 + 3 * i)) for i in range(8)]
    # (the last two: prefix cache hits)
    assert_like_reference(llm, prompts + prompts[:2], _w8a8_reference(str(tmp_path / "dequantized")))


def _w8a8_reference(path: str, tp: int = 1):
    """transformers' model (fp32) on the checkpoint at path, each projection's input quantized per
    token and dequantized (per_token_fp8_ref) before it: with weights that are FP8 ones
    dequantized, what quantization="fp8" computes. Under tensor parallelism tp > 1 a row-parallel
    layer's (o, down) ranks each quantize their slice of the input with its own scales (as vLLM's
    do): here its input in tp slices."""
    from transformers import AutoModelForCausalLM

    def quantized(x):
        a, a_scale = per_token_fp8_ref(x)
        return a.float() * a_scale

    def quantized_input(module, args):
        return (quantized(args[0]),)

    def quantized_slices(module, args):
        return (torch.cat([quantized(x) for x in args[0].chunk(tp, dim=-1)], dim=-1),)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for name, module in model.named_modules():
        if name.split(".")[-1] in PROJECTIONS:
            row_parallel = name.split(".")[-1] in ("o_proj", "down_proj")
            module.register_forward_pre_hook(quantized_slices if row_parallel and tp > 1 else quantized_input)
    return model


def assert_like_reference(llm, prompts: list[list[int]], ref) -> None:
    """The engine's greedy tokens (8 a prompt) and top-4 log-probabilities against those of ref, a
    transformers model computing what the engine's FP8 does (_w8a8_reference, the FP8 KV cache's
    test). Quantizing an activation (or a key) amplifies fp32's rounding differences: a value
    near a midpoint of e4m3's steps may round the other way (a 6% change of it), and these tiny
    random models' sharp logits carry that far (up to 0.2 in a log-probability, measured; where
    one such step falls moves with the scales), so the bounds are on the whole: at least 8 of the
    10 prompts' tokens the same, and the median difference of a log-probability under 1e-3
    (measured: 5e-7 to 2e-4; without the activations' quantization, or with a scale misapplied,
    the tokens part at once and the differences are tenths)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    same, diffs = 0, []
    with torch.no_grad():
        for p, out in zip(prompts, outs):
            ids, tokens = torch.tensor([p]), []
            for step in out.outputs[0].logprobs:
                logprobs = torch.log_softmax(ref(ids).logits[0, -1].float(), -1)
                diffs += [abs(lp.logprob - logprobs[t].item()) for t, lp in step.items()]
                tokens.append(int(logprobs.argmax()))
                ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
            same += tokens == out.outputs[0].token_ids
    assert same >= 8, f"{same} of {len(prompts)} prompts' tokens the same"
    assert torch.tensor(diffs).median().item() < 1e-3


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
    again (quantization need not be given): the tokens and log-probabilities of transformers'
    model on those weights dequantized, computing as FP8 does (_w8a8_reference); a scale per
    tensor serves every row of it.
    What the engine cannot run is refused when the config is read: block-wise FP8, another method."""
    from picovllm.config import ModelConfig

    ckpt = str(tmp_path / "fp8")
    _fp8_checkpoint(tiny_qwen[0], ckpt, per_tensor)

    def dequantize(tensors):  # (the FP8 checkpoint's weights as the unquantized engine loads them)
        for name in [n for n in tensors if n.endswith("weight_scale")]:
            weight = name.removesuffix("_scale")
            scale = tensors.pop(name).float().reshape(-1).expand(tensors[weight].shape[0])
            tensors[weight] = dequantize_fp8(tensors[weight], scale)
            tensors.pop(weight.removesuffix("weight") + "input_scale")

    _rewritten(ckpt, str(tmp_path / "dequantized"), dequantize, lambda cfg: cfg.pop("quantization_config"))

    llm = make_llm(ckpt)
    qkv = llm.llm_engine.executor.driver.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8
    if per_tensor:  # (q, k and v each had one scale: three runs of equal rows)
        assert len(set(qkv.weight_scale.tolist())) == 3
    prompts = [list(range(3 + i, 3 + i + 4 + 5 * i)) for i in range(10)]
    assert_like_reference(llm, prompts, _w8a8_reference(str(tmp_path / "dequantized")))
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    for quant, error in (
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise FP8"),
        ({"quant_method": "gptq"}, "'gptq' is not supported"),
    ):
        with pytest.raises(ValueError, match=error):
            ModelConfig.from_dict({**cfg, "quantization_config": quant})


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """x as an FP8 KV cache holds it (kernels/kv_store.py to_cache), back in its dtype."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype)


@FP32_ONLY
@pytest.mark.parametrize("model,scales", [("tiny_qwen", None), ("tiny_llama", None), ("tiny_qwen", (0.5, 2.0))])
def test_fp8_kv_cache(model, scales, request, monkeypatch, tmp_path):
    """kv_cache_dtype="fp8": the pool in e4m3, four times fp32's blocks (twice bf16's) in the same
    memory; the engine's tokens and log-probabilities those of transformers' model with each key
    (after RoPE) and value rounded to e4m3 as the cache stores it, on the paths a request takes
    (chunked prompts in a 16-token budget, async scheduling, prefix cache hits, which read
    another request's FP8 blocks); disaggregated peers see the KV's dtype in its description.
    scales: a checkpoint's k_scale and v_scale (each layer's self_attn.k_scale, as llm-compressor
    writes them): the cache holds K / k_scale and V / v_scale; a cache in the model's dtype
    ignores them."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    path = request.getfixturevalue(model)[0]
    k_scale, v_scale = scales or (1.0, 1.0)
    if scales:

        def with_scales(tensors):
            layers = {n.split(".")[2] for n in tensors if n.startswith("model.layers.")}
            for i in layers:
                tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale)
                tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale)

        _rewritten(path, str(tmp_path / "scaled"), with_scales)
        path = str(tmp_path / "scaled")
    opts = dict(max_num_batched_tokens=16, max_num_seqs=4, kv_cache_memory=1 << 20)
    llm = make_llm(path, kv_cache_dtype="fp8", **opts)
    engine = llm.llm_engine
    attention = engine.executor.driver.model_runner.model.attention_layers()
    assert all(a.k_cache.dtype == a.v_cache.dtype == FP8 and a.kv_scales() == (k_scale, v_scale) for a in attention)
    fp32 = make_llm(path, **opts).llm_engine
    assert all(a.kv_scales() == (1.0, 1.0) for a in fp32.executor.driver.model_runner.model.attention_layers())
    block_bytes = engine.executor.driver.model_runner.kv_block_bytes()
    assert 4 * block_bytes == fp32.executor.driver.model_runner.kv_block_bytes()
    assert (
        engine.block_manager.num_total_blocks == (1 << 20) // block_bytes > 4 * fp32.block_manager.num_total_blocks - 4
    )
    assert engine.kv_compat["kv_cache_dtype"] == "float8_e4m3fn" and engine.kv_compat["dtype"] == "float32"

    for module in (modeling_qwen2, modeling_llama):  # (keys rounded after RoPE, as the engine stores them)
        rotate = module.apply_rotary_pos_emb
        monkeypatch.setattr(
            module,
            "apply_rotary_pos_emb",
            lambda q, k, *args, rotate=rotate: (lambda q, k: (q, _e4m3(k)))(*rotate(q, k, *args)),
        )
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for layer in ref.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda module, args, out: _e4m3(out / v_scale) * v_scale)
    prompts = [list(range(3 + i, 3 + i + 5 + 3 * i)) for i in range(8)]
    assert_like_reference(llm, prompts + prompts[:2], ref)


def test_fp8_to_float_is_torchs_cast_of_every_byte():
    """model/layers/fp8.py's fp8_to_float (the CPU's table of e4m3 values): every byte's value as
    torch's cast gives it (NaN for NaN's two, zero's sign kept), in the tensor's shape, also for a
    view whose rows are not contiguous."""
    from picovllm.model.layers.fp8 import FP8, fp8_to_float

    x = torch.arange(256, dtype=torch.uint8).view(FP8).view(16, 16)
    got, expect = fp8_to_float(x), x.float()
    assert got.shape == (16, 16) and got.dtype == torch.float32
    assert torch.equal(got.isnan(), expect.isnan()) and int(expect.isnan().sum()) == 2
    assert torch.equal(got.nan_to_num(), expect.nan_to_num()) and torch.equal(got.signbit(), expect.signbit())
    view = x.t()[:, 3:]
    assert torch.equal(fp8_to_float(view).nan_to_num(), view.float().nan_to_num())
