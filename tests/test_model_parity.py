"""Token-for-token and logit parity with Hugging Face transformers (fp32, CPU)."""

import pytest
import torch
from conftest import make_llm
from hf_reference import assert_greedy_match, hf_greedy
from tiny_models import build_model

from picovllm import SamplingParams
from picovllm.engine.step_launcher import step_inputs
from picovllm.messages import SamplerOutput

TOL = 1e-3  # fp32 near-tie tolerance on the reference's top-2 logits
PROMPT_LENS = [1, 5, 15, 16, 17, 33, 47]


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _check_generate(llm, hf, prompts, n_tokens=12):
    params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    compared = 0
    for p, out in zip(prompts, outs):
        assert out.prompt_token_ids == p
        ref, gaps = hf_greedy(hf, p, n_tokens)
        compared += assert_greedy_match(out.outputs[0].token_ids, ref, gaps, TOL)
    assert compared >= len(prompts) * n_tokens * 0.8, "too many near-ties: the test compares too little"


VARIANTS = [
    dict(arch="qwen2", tie=True, bias=True),
    dict(arch="qwen2", tie=False, bias=True),
    dict(arch="llama", tie=True, bias=False),
    dict(arch="llama", tie=False, bias=True),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v['arch']}-tie{v['tie']}-bias{v['bias']}")
def test_greedy_parity_variants(tmp_path, variant):
    hf = build_model(str(tmp_path), tokenizer=False, seed=3, **variant)
    llm = make_llm(str(tmp_path), skip_tokenizer_init=True)
    _check_generate(llm, hf, _prompts(307))


def test_logits_close_prefill_and_decode(tiny_qwen):
    path, hf = tiny_qwen
    llm = make_llm(path, skip_tokenizer_init=True)
    engine = llm.llm_engine
    prompts = _prompts(307, [3, 16, 17, 40])
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    batch = engine.scheduler.schedule()
    assert batch.num_new_tokens == [len(p) for p in prompts] and not batch.is_decode
    ours = engine.executor.driver.model_runner.step_logits(step_inputs(batch))
    with torch.no_grad():
        for row, p in zip(ours, prompts):
            ref = hf(torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(row.cpu(), ref, atol=1e-4, rtol=1e-4)
    _process(engine, batch, _greedy(ours))
    for _ in range(3):  # decode steps: compare logits of the next position
        batch = engine.scheduler.schedule()
        assert batch.is_decode
        ours = engine.executor.driver.model_runner.step_logits(step_inputs(batch))
        with torch.no_grad():
            for row, req in zip(ours, batch.requests):
                ref = hf(torch.tensor([req.token_ids])).logits[0, -1]
                torch.testing.assert_close(row.cpu(), ref, atol=1e-4, rtol=1e-4)
        _process(engine, batch, _greedy(ours))


def _process(engine, batch, sampled):
    """What LLMEngine.step does after the forward (every request here samples)."""
    for req, n in zip(batch.requests, batch.num_new_tokens):
        req.num_computed_tokens += n
    engine.core_outputs.process(batch.requests, sampled.sampled.tolist(), sampled, [None] * len(batch.requests))


def _greedy(logits):
    return SamplerOutput(logits.argmax(dim=-1), None, None, None, None)


def _bf16_prompts_error(tiny_qwen):
    """(want, error) for three prompts: transformers' fp32 logits at their last positions, and
    error(): a new bf16 CPU engine's logits for the prompts' step, (their largest distance from
    want, its model)."""
    path, hf = tiny_qwen
    prompts = _prompts(307, [3, 16, 40])
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])

    def error():
        engine = make_llm(path, dtype="bfloat16", device="cpu", skip_tokenizer_init=True).llm_engine
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=1))
        runner = engine.executor.driver.model_runner
        logits = runner.step_logits(step_inputs(engine.scheduler.schedule()))
        return (logits.float() - want).abs().max().item(), runner.model

    return want, error


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_block_sizes_and_batching(tiny_qwen, block_size):
    """More prompts than max_num_seqs, contexts crossing many block boundaries."""
    path, hf = tiny_qwen
    llm = make_llm(path, skip_tokenizer_init=True, block_size=block_size, max_num_seqs=3)
    _check_generate(llm, hf, _prompts(307, seed=block_size), n_tokens=10)


def test_preemption_keeps_outputs_exact(tiny_llama):
    """A pool far too small for the batch: requests are preempted and recomputed, outputs unchanged,
    blocks conserved after every step."""
    path, hf = tiny_llama
    llm = make_llm(path, skip_tokenizer_init=True, block_size=4, num_gpu_blocks_override=14, max_model_len=56)
    engine = llm.llm_engine
    prompts = _prompts(307, [9, 13, 6, 17, 11, 4], seed=7)
    n_tokens = 20
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
    assert engine.scheduler.num_preemptions > 0
    assert engine.reset_prefix_cache() and engine.block_manager.num_free_blocks == 14
    for i, p in enumerate(prompts):
        ref, gaps = hf_greedy(hf, p, n_tokens)
        assert_greedy_match(done[str(i)].outputs[0].token_ids, ref, gaps, TOL)


def test_packed_cpu_weights_are_as_close_to_fp32_as_the_plain_path(tiny_qwen, monkeypatch):
    """On a CPU whose oneDNN has a bf16 GEMM (torch says so), the weights are packed into its
    layout (model/layers/linear.py pack_weights), the tied LM head's embedding untouched. Its
    GEMM rounds in another order than F.linear's, so the check is against transformers in fp32:
    the packed path's bf16 logits are no further from them than the plain path's (and close)."""
    from picovllm.model.layers import linear

    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("this CPU's oneDNN has no bf16 GEMM: the plain path is the only one")
    want, error = _bf16_prompts_error(tiny_qwen)
    packed, model = error()
    assert model.lm_head.weight.is_mkldnn and not model.model.embed_tokens.weight.is_mkldnn
    assert all(m.weight.is_mkldnn for m in model.modules() if isinstance(m, linear.LinearBase))
    monkeypatch.setattr("picovllm.worker.model_runner.pack_weights", lambda model: 0)
    plain, model = error()
    assert not model.lm_head.weight.is_mkldnn
    assert packed <= 1.5 * plain + 1e-3 and packed < 0.05 * want.abs().max(), (packed, plain)


def test_without_onednns_bf16_gemm_the_weights_stay_plain(tiny_qwen, monkeypatch, caplog):
    """Where torch reports no bf16 GEMM in oneDNN, a bf16 model's weights are not packed: the layers
    run on the weights as loaded (F.linear in the model's dtype, the op transformers runs, below 16
    rows; upcast_linear from 16), and the engine says so at start-up, with fp32 as the way out. A
    tiny fp32 model's are not packed either (below PACK_MIN_FP32)."""
    import logging

    from picovllm.model.layers.linear import LinearBase, pack_weights

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    with caplog.at_level(logging.INFO, logger="picovllm"):
        engine = make_llm(tiny_qwen[0], dtype="bfloat16", device="cpu").llm_engine
    said = [r.message for r in caplog.records if "has no bfloat16 GEMM" in r.message]
    assert len(said) == 1 and "below 16 rows" in said[0] and "--dtype float32" in said[0], said
    model = engine.executor.driver.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and not any(m.weight.is_mkldnn for m in linears) and not model.lm_head.weight.is_mkldnn
    assert all(m.weight.dtype == torch.bfloat16 for m in linears) and pack_weights(model) == 0
    fp32 = make_llm(tiny_qwen[0], dtype="float32", device="cpu").llm_engine.executor.driver.model_runner.model
    assert pack_weights(fp32) == 0


@pytest.mark.parametrize("variant", VARIANTS[:2], ids=["tied", "untied"])
def test_fp32_weights_past_a_size_are_packed_and_generate_as_transformers(tmp_path, monkeypatch, caplog, variant):
    """On a CPU an fp32 model's weights of PACK_MIN_FP32 elements or more go into oneDNN's layout
    (pack_weights: its GEMM runs decode's rows at twice MKL's rate there), the smaller ones stay
    plain; greedy decoding still matches transformers' fp32. The threshold lowered so that the
    tiny model has both kinds: qkv and gate_up (10,240 elements) and the LM head packed, o (6,144)
    and down (5,120) not. The engine says how many at start-up."""
    import logging

    from picovllm.model.layers import linear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch: nothing is packed")
    monkeypatch.setattr(linear, "PACK_MIN_FP32", 8192)
    hf = build_model(str(tmp_path), tokenizer=False, seed=3, **variant)
    with caplog.at_level(logging.INFO, logger="picovllm"):
        llm = make_llm(str(tmp_path), skip_tokenizer_init=True, dtype="float32", device="cpu")
    model = llm.llm_engine.executor.driver.model_runner.model
    packed = 2 * len(model.model.layers) + 1  # (each layer's qkv and gate_up, the LM head)
    said = [r.message for r in caplog.records if "packed" in r.message]
    assert said == [f"{packed} linear weights packed into oneDNN's layout for its GEMM"], said
    layers = model.model.layers[0]
    packed = {name: m.weight.is_mkldnn for name, m in layers.named_modules() if isinstance(m, linear.LinearBase)}
    assert packed == {
        "self_attn.qkv_proj": True,
        "self_attn.o_proj": False,
        "mlp.gate_up_proj": True,
        "mlp.down_proj": False,
    }, packed
    assert model.lm_head.weight.is_mkldnn and not model.model.embed_tokens.weight.is_mkldnn
    _check_generate(llm, hf, _prompts(307))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_upcast_linear_is_the_fp32_product_rounded(dtype, bias):
    """upcast_linear (a CPU without a GEMM for the weight's dtype): x @ w.T + b summed in fp32 and
    rounded once to the dtype, the weight taken 128 rows at a time (300 rows: the last slice of 44),
    a 3-D x as F.linear takes it. Rows of different magnitudes, so that a slice written to the wrong
    columns shows."""
    from picovllm.model.layers.linear import upcast_linear

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 20, 96, generator=g).to(dtype)
    w = (torch.randn(300, 96, generator=g) * torch.logspace(-1, 1, 300)[:, None]).to(dtype)
    b = torch.randn(300, generator=g).to(dtype) if bias else None
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    got = upcast_linear(x, w, b, rows=128)
    assert got.shape == (2, 20, 300) and got.dtype == dtype
    # (the fp32 sum can round to the neighbour of the exact sum's rounding: one unit in the last place)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=eps, atol=1e-6 * want.abs().max().item())


def test_without_a_bf16_gemm_prompts_run_in_fp32_as_close_to_fp32_as_the_plain_path(tiny_qwen, monkeypatch):
    """On a CPU whose oneDNN has no bf16 GEMM, a step of 16 tokens or more runs its layers through
    upcast_linear (the step's LM head, 3 rows, through F.linear): its bf16 logits no further from
    transformers' fp32 ones than those of F.linear's bf16 GEMM everywhere (and close)."""
    from picovllm.model.layers import linear

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    want, error = _bf16_prompts_error(tiny_qwen)
    calls, upcast = [], linear.upcast_linear
    monkeypatch.setattr(linear, "upcast_linear", lambda x, *args: calls.append(x.shape[0]) or upcast(x, *args))

    upcasts, _ = error()
    assert calls and set(calls) == {59}  # (every layer's GEMM of the step's 59 tokens; the LM head's 3 rows not)
    monkeypatch.setattr(linear, "UPCAST_ROWS", 10**9)
    calls.clear()
    plain, _ = error()
    assert not calls and upcasts <= 1.5 * plain + 1e-3 and upcasts < 0.05 * want.abs().max(), (upcasts, plain)


def test_without_a_bf16_gemm_attention_runs_in_fp32_as_close_to_fp32_as_in_bf16(tiny_qwen, monkeypatch):
    """On a CPU whose oneDNN has no bf16 GEMM, torch's attention multiplies bf16 at a fraction of
    its fp32 speed: the reference attention then takes the queries in fp32 (the cache read into
    fp32 with them) and its output is rounded once; the logits no further from transformers' fp32
    ones than with the attention in bf16 (and close). With the GEMM, bf16 stays."""
    from picovllm.model.layers import attention

    want, error = _bf16_prompts_error(tiny_qwen)
    dtypes, ref = [], attention.paged_attention_ref
    monkeypatch.setattr(attention, "paged_attention_ref", lambda q, *args: dtypes.append(q.dtype) or ref(q, *args))

    def error_with(has_gemm: bool) -> float:
        monkeypatch.setattr(attention, "cpu_gemm", lambda dtype: has_gemm)
        dtypes.clear()
        return error()[0]

    upcast = error_with(has_gemm=False)
    assert dtypes == [torch.float32] * 3  # (each of the three layers)
    plain = error_with(has_gemm=True)
    assert dtypes == [torch.bfloat16] * 3
    assert upcast <= 1.5 * plain + 1e-3 and upcast < 0.05 * want.abs().max(), (upcast, plain)
