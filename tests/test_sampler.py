"""Sampler: exact masks on hand-made logits, vLLM's penalty definitions, seeded reproducibility."""

import math

import pytest
import torch

from picovllm.engine.request import Request
from picovllm.engine.step_launcher import sampling_batch
from picovllm.kernels.penalties import apply_penalties_ref
from picovllm.kernels.sampling import apply_min_p, apply_top_k_top_p, sample
from picovllm.sampling_params import SamplingParams
from picovllm.worker import sampler as sampler_module
from picovllm.worker.sampler import Sampler, SamplingTensors

NEG = float("-inf")


def _req(params: SamplingParams, prompt=(1, 2, 3), output=()) -> Request:
    r = Request("r", "r", 0, None, list(prompt), params, 0, params.seed)
    r.token_ids += list(output)
    return r


def _tensors(reqs: list[Request], vocab: int, eos_ids=frozenset(), generators=None) -> SamplingTensors:
    """The sampling tensors of these requests, as the engine and the model runner build them."""
    generators = generators or [None] * len(reqs)
    return SamplingTensors.from_batch(sampling_batch(reqs, []), generators, vocab, set(eos_ids), torch.device("cpu"))


@pytest.fixture(params=["reference", "triton"])
def draw_path(request, monkeypatch):
    """The draw of kernels/sampling.py on its PyTorch reference or, on CPU tensors in Triton's
    interpreter, on its Triton path (the GPU's)."""
    if request.param == "triton":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("the interpreter runs on CPU tensors")
        from picovllm.kernels import triton_utils

        monkeypatch.setattr(triton_utils, "ON_CPU", True)
    return request.param


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    return apply_penalties_ref(
        logits, t.prompt_ids, t.output_ids, t.repetition_penalty, t.frequency_penalty, t.presence_penalty
    )


def _kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row > NEG).flatten().tolist() for row in logits]


def test_top_k_mask_exact():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.5, 0.1, 0.9, 0.3, 0.7]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 4]), None)
    assert _kept(out) == [[1, 3], [0, 2, 3, 4]]
    assert out[0, 1] == 5.0 and out[0, 3] == 4.0  # kept logits unchanged


def test_top_k_keeps_ties_with_kth():
    out = apply_top_k_top_p(torch.tensor([[1.0, 3.0, 3.0, 2.0]]), torch.tensor([1]), None)
    assert _kept(out) == [[1, 2]]


def test_top_p_mask_exact():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    # smallest set reaching p: 0.5+0.2 = 0.7 >= 0.6 -> {0, 1}; p=0.71 needs 0.15 more -> {0, 1, 2}
    assert _kept(apply_top_k_top_p(logits, None, torch.tensor([0.6]))) == [[0, 1]]
    assert _kept(apply_top_k_top_p(logits, None, torch.tensor([0.71]))) == [[0, 1, 2]]
    assert _kept(apply_top_k_top_p(logits, None, torch.tensor([0.1]))) == [[0]]  # never empty
    assert _kept(apply_top_k_top_p(logits, None, torch.tensor([1.0]))) == [[0, 1, 2, 3, 4]]


def test_top_k_then_top_p_renormalises():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # top_k=2 leaves {0.4, 0.3} -> renormalised 0.571, 0.429; top_p=0.5 then keeps only token 0
    out = apply_top_k_top_p(probs.log(), torch.tensor([2]), torch.tensor([0.5]))
    assert _kept(out) == [[0]]


def test_top_p_keeps_ties_with_its_least_likely_token():
    # 0.3 and 0.3 tie: the mass more likely than either is 0.4 < 0.5, so both stay (as top_k's ties)
    logits = torch.tensor([[0.3, 0.4, 0.3, 0.0]]).log()
    assert _kept(apply_top_k_top_p(logits, None, torch.tensor([0.5]))) == [[0, 1, 2]]
    assert _kept(apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.5]), max_top_k=2)) == [[0, 1, 2]]


def _top_k_top_p_reference(row: list[float], k: int, p: float) -> list[int]:
    """The tokens kept, by definition: the k largest and their ties; of those, each token whose more
    likely tokens' probability (renormalised over the k) is below p."""
    kth = sorted(row, reverse=True)[k - 1]
    kept = [i for i, x in enumerate(row) if x >= kth]
    z = sum(math.exp(row[i]) for i in kept)
    return [i for i in kept if sum(math.exp(row[j]) for j in kept if row[j] > row[i]) / z < p]


def test_top_k_top_p_sorting_only_the_top_k_equals_sorting_everything():
    """max_top_k: only that many logits of a row are sorted (torch.topk), not the vocabulary; the
    same tokens stay as sorting every logit, and as the definition, ties included (logits rounded
    to bf16 tie often)."""
    gen = torch.Generator().manual_seed(0)
    vocab = 300
    for trial in range(30):
        logits = (torch.randn(6, vocab, generator=gen) * 2).bfloat16().float()
        logits[0, :] = logits[0, 0]  # (all tied)
        top_k = torch.randint(1, 25, (6,), generator=gen)
        top_p = torch.rand(6, generator=gen) * 0.98 + 0.01
        if trial % 3 == 0:
            top_p = None
        fast = apply_top_k_top_p(logits, top_k, top_p, max_top_k=int(top_k.max()))
        assert _kept(fast) == _kept(apply_top_k_top_p(logits, top_k, top_p))
        p = [1.0] * 6 if top_p is None else top_p.tolist()
        assert _kept(fast) == [_top_k_top_p_reference(r, k, q) for r, k, q in zip(logits.tolist(), top_k.tolist(), p)]
        assert torch.equal(fast[fast > NEG], logits[fast > NEG])  # kept logits unchanged


def test_min_p_mask_exact():
    probs = torch.tensor([[0.5, 0.26, 0.24], [0.9, 0.05, 0.05]])
    out = apply_min_p(probs.log(), torch.tensor([0.5, 0.0]))
    assert _kept(out) == [[0, 1], [0, 1, 2]]  # threshold 0.25 drops 0.24; min_p 0 keeps all


def test_penalties_as_vllm_defines_them():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    req = _req(params, prompt=[0, 1], output=[2, 2, 1])
    t = _tensors([req], 5)
    out = apply_penalties(logits, t)
    # token 0: in prompt -> 2/2 = 1; token 1: prompt+output once -> -2*2 - 0.25 - 0.5 = -4.75
    # token 2: output twice -> 1/2 - 0.5 - 0.5 = -0.5; tokens 3, 4 unseen: unchanged
    torch.testing.assert_close(out, torch.tensor([[1.0, -4.75, -0.5, 0.5, -1.0]]))


def _dense_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The penalties over the whole vocabulary, as their definition reads."""
    vocab = logits.shape[1]
    counts = [torch.bincount(ids[ids < vocab], minlength=vocab).float() for ids in t.output_ids]
    output_counts = torch.stack(counts)
    seen = torch.stack([torch.bincount(ids[ids < vocab], minlength=vocab) > 0 for ids in t.prompt_ids])
    seen |= output_counts > 0
    rep = torch.where(seen, t.repetition_penalty, 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    return logits - t.frequency_penalty * output_counts - t.presence_penalty * (output_counts > 0)


def test_penalties_at_the_seen_tokens_equal_them_over_the_vocabulary():
    """Rows of different lengths (padding), repeated tokens, a token in both prompt and output, a
    row with no output yet, and one without penalties beside them."""
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    reqs = []
    for i in range(6):
        prompt = torch.randint(0, vocab, (1 + 7 * i,), generator=gen).tolist()
        output = torch.randint(0, vocab, (0 if i == 2 else 3 * i + 1,), generator=gen).tolist()
        params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
        reqs.append(_req(SamplingParams() if i == 4 else params, prompt, output + prompt[:2]))
    t = _tensors(reqs, vocab)
    logits = torch.randn(6, vocab, generator=gen) * 3
    before = logits.clone()
    torch.testing.assert_close(apply_penalties(logits, t), _dense_penalties(logits, t), rtol=0, atol=0)
    assert torch.equal(logits, before)  # (the model's logits are left as they were)


def test_penalties_change_the_choice_not_the_models_logits(draw_path):
    """The penalties' kernel writes into the logits it is given: the sampler gives it a copy of
    its own (the model's fp32 logits are left as they were)."""
    logits = torch.tensor([[2.0, 1.5, 0.0, -1.0], [2.0, 1.5, 0.0, -1.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0), SamplingParams(temperature=0)]
    out = Sampler()(logits, _tensors([_req(params[0], prompt=[0]), _req(params[1], prompt=[0])], 4))
    assert out.sampled.tolist() == [1, 0]  # (2.0 / 2 falls below 1.5 where the penalty is asked)
    assert torch.equal(logits, torch.tensor([[2.0, 1.5, 0.0, -1.0], [2.0, 1.5, 0.0, -1.0]]))


def test_min_tokens_masks_eos_and_stop_ids():
    sampler = Sampler()
    logits = torch.tensor([[0.0, 10.0, 9.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    t = _tensors([_req(params)], 4, {1})
    assert sampler(logits, t).sampled.tolist() == [3]  # EOS 1 and stop id 2 banned
    t = _tensors([_req(params, output=[3, 3])], 4, {1})
    assert sampler(logits, t).sampled.tolist() == [1]  # min_tokens reached


def test_logit_bias_is_added_before_the_choice():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    params = [SamplingParams(temperature=0, logit_bias={0: 5.0}), SamplingParams(temperature=0, logit_bias={1: -100})]
    out = Sampler()(logits, _tensors([_req(p) for p in params], 3))
    assert out.sampled.tolist() == [0, 2]
    assert torch.equal(logits, torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]]))  # (the model's, untouched)


def _bitmask(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """xgrammar's layout: [rows, ceil(vocab / 32)] int32, token j's bit j % 32 of word j // 32."""
    words = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for i, ids in enumerate(allowed):
        for j in ids:
            words[i, j // 32] |= 1 << (j % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_grammars_bitmask_alone_is_applied_by_the_draw(draw_path, dtype, monkeypatch):
    """A bitmask with nothing else to mask the logits is applied by the draw as it reads them (no
    masked copy): greedy rows take the argmax of their allowed tokens (the first of a tie), seeded
    rows draw the very token they draw from the masked copy (a zero logit_bias on the batch takes
    that path), every row one of its allowed tokens."""
    import dataclasses

    vocab = 300
    logits = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(4)) * 4).to(dtype)
    allowed = [[3, 40, 41, 299], [0, 31, 32, 33, 64], [7], list(range(100, 200)), [5, 250], list(range(vocab))]
    logits[0, 40] = logits[0, 41] = logits[0].max() + 1  # (a tie among the allowed: the first wins)
    bitmask = _bitmask(allowed, vocab)
    calls = []
    copy = sampler_module.masked_fp32
    monkeypatch.setattr(sampler_module, "masked_fp32", lambda *a: calls.append(1) or copy(*a))

    def draw(params: list[SamplingParams], masked_copy: bool) -> list[int]:
        if masked_copy:
            params = [dataclasses.replace(params[0], logit_bias={0: 0.0}), *params[1:]]
        gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
        t = dataclasses.replace(_tensors([_req(p) for p in params], vocab, generators=gens), bitmask=bitmask)
        calls.clear()
        tokens = Sampler()(logits, t).sampled.tolist()
        assert len(calls) == int(masked_copy)
        return tokens

    greedy = [SamplingParams(temperature=0)] * 6
    tokens = draw(greedy, masked_copy=False)
    best = [max(ids, key=lambda j: (float(logits[i, j]), -j)) for i, ids in enumerate(allowed)]
    assert tokens == best and tokens[0] == 40
    assert draw(greedy, masked_copy=True) == tokens
    mixed = [SamplingParams(temperature=0) if i % 3 == 0 else SamplingParams(temperature=0.8, seed=i) for i in range(6)]
    tokens = draw(mixed, masked_copy=False)
    assert all(j in ids for j, ids in zip(tokens, allowed)) and tokens[::3] == best[::3]
    assert draw(mixed, masked_copy=True) == tokens


def test_allowed_token_ids_keep_only_theirs(draw_path):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0]])
    params = [
        SamplingParams(temperature=0, allowed_token_ids=[0, 3]),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, allowed_token_ids=[3]),
    ]
    out = Sampler()(logits, _tensors([_req(p) for p in params], 4))
    assert out.sampled.tolist() == [0, 1, 3]


def test_greedy_and_logprobs():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    reqs = [_req(SamplingParams(temperature=0, logprobs=2)), _req(SamplingParams(temperature=0))]
    out = Sampler()(logits, _tensors(reqs, 3))
    assert out.sampled.tolist() == [1, 2]
    raw = logits.log_softmax(-1)
    torch.testing.assert_close(out.sampled_logprobs, raw.gather(1, out.sampled[:, None])[:, 0])
    assert out.sampled_ranks.tolist() == [1, 1]
    assert out.top_ids[0].tolist() == [1, 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_models_logits_give_the_tokens_of_their_fp32_values(draw_path, dtype, monkeypatch):
    """The argmax and the temperature's draw read a bf16 or fp16 model's logits as they are (no
    fp32 copy): the same tokens as from the same values in fp32, beside min_tokens' bans and
    allowed_token_ids; top_p takes the fp32 path."""
    vocab = 300
    logits = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # (a tie: the first index wins in both)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.6, seed=1),
        SamplingParams(temperature=1.3, seed=2),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[int(logits[3].argmax())]),
        SamplingParams(temperature=0.8, seed=3, allowed_token_ids=[5, 50, 250]),
        SamplingParams(temperature=0.9, seed=4),
    ]

    def draw(rows: torch.Tensor, ps: list[SamplingParams]) -> list[int]:
        gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in ps]
        return Sampler()(rows, _tensors([_req(p) for p in ps], vocab, generators=gens)).sampled.tolist()

    read = []  # (the dtype of each draw's logits)
    monkeypatch.setattr(sampler_module, "sample", lambda x, *a: read.append(x.dtype) or sample(x, *a))
    tokens = draw(logits, params)
    assert tokens == draw(logits.float(), params)
    assert tokens[0] == 7 and tokens[3] != int(logits[3].argmax()) and tokens[4] in (5, 50, 250)
    top_p = [SamplingParams(temperature=1.0, top_p=0.5, seed=5)] * 6
    assert draw(logits, top_p) == draw(logits.float(), top_p)
    assert read == [dtype, torch.float32, torch.float32, torch.float32]


def _sample_seq(params, others, steps=20, vocab=50):
    """Sample `steps` tokens for a seeded request batched with `others` (fresh requests)."""
    torch.manual_seed(123)
    logits = torch.randn(steps, vocab)
    gen = torch.Generator().manual_seed(params.seed)
    me = _req(params)
    tokens = []
    for s in range(steps):
        batch = others + [me] if s % 2 else [me] + others
        rows = torch.stack([logits[s]] * len(batch))
        t = _tensors(batch, vocab, generators=[gen if r is me else None for r in batch])
        tokens.append(Sampler()(rows, t).sampled[batch.index(me)].item())
    return tokens


def test_seeded_sampling_independent_of_batch(draw_path):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    alone = _sample_seq(params, [])
    with_others = _sample_seq(params, [_req(SamplingParams(temperature=0.7)), _req(SamplingParams(temperature=0))])
    assert alone == with_others
    assert len(set(alone)) > 3  # it really samples
    assert _sample_seq(SamplingParams(temperature=1.0, top_p=0.9, seed=43), []) != alone


def test_seeded_top_k_sampling_independent_of_the_batchs_top_k(draw_path):
    """A seeded row's tokens are the same when the batch sorts only the top 20 of each row and when
    another row (no top_k) makes it sort all of them."""
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.8, seed=42)
    alone = _sample_seq(params, [])
    assert alone == _sample_seq(params, [_req(SamplingParams(temperature=0.7, top_p=0.9))])
    assert len(set(alone)) > 3


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[math.log(0.7), math.log(0.2), math.log(0.1)]]).repeat(4000, 1)
    reqs = [_req(SamplingParams(temperature=1.0)) for _ in range(4000)]
    out = Sampler()(logits, _tensors(reqs, 3)).sampled
    freq = torch.bincount(out, minlength=3).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03, rtol=0)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("min_tokens", -1),
        ("n", 0),
        ("logprobs", -1),
        ("seed", 1.5),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_unknown_parameter_rejected():
    with pytest.raises(ValueError, match="unknown sampling parameter.*beam_width"):
        SamplingParams.from_dict({"temperature": 0.5, "beam_width": 4})
    with pytest.raises(TypeError):
        SamplingParams(beam_width=4)


def test_sampling_tensors_follow_the_batch(tiny_qwen):
    """The runner reuses a step's sampling tensors only when the engine sends the batch it sent
    last (the very same requests, nothing changed): a request reusing a finished one's id with
    other parameters gets its own; a min_tokens ban is rebuilt every step while it lasts."""
    from picovllm import LLMEngine

    engine = LLMEngine.from_engine_args(model=tiny_qwen[0], dtype="float32", device="cpu", kv_cache_memory=16 << 20)
    runner = engine.executor.driver.model_runner
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.5, max_tokens=3, ignore_eos=True))
    engine.step()
    batch, first = runner._sampling_cache
    engine.step()  # same request: same batch, same tensors
    assert runner._sampling_cache[0] is batch and runner._sampling_cache[1] is first
    engine.step()
    assert not engine.has_unfinished_requests()
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=1.5, max_tokens=2, ignore_eos=True))
    engine.step()
    assert runner._sampling_cache[1] is not first
    assert runner._sampling_cache[1].temperature.tolist() == [1.5]
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("b", [5, 6, 7], SamplingParams(temperature=0.5, max_tokens=4, min_tokens=3))
    engine.step()
    banned = runner._sampling_cache[1]
    engine.step()  # a ban in force: rebuilt each step
    assert banned.banned is not None and runner._sampling_cache[1] is not banned
