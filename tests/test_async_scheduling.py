"""async_scheduling: a step is launched before the previous step's tokens are read. The
outputs must be exactly those of the synchronous engine, whatever stops requests meanwhile."""

import random

import pytest
from conftest import make_llm

from picovllm import SamplingParams, StructuredOutputsParams


@pytest.fixture(scope="module")
def engines(tiny_qwen):
    kw = dict(block_size=4, max_num_seqs=4)
    return make_llm(tiny_qwen[0], async_scheduling=True, **kw), make_llm(tiny_qwen[0], async_scheduling=False, **kw)


def _run(llm, prompts, params):
    return [
        [(c.token_ids, c.text, c.finish_reason, c.cumulative_logprob) for c in o.outputs]
        for o in llm.generate(prompts, params, use_tqdm=False)
    ]


def test_outputs_equal_the_synchronous_engine(engines):
    """Greedy and seeded sampling, n=2, EOS, stop strings, different max_tokens, logprobs, more
    prompts than max_num_seqs (admissions in steps launched ahead)."""
    fast, sync = engines
    prompts = ["Hello", "The quick brown fox", "a b c d e f g", "x", "Once upon a time", "1 2 3"]
    params = [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.8, seed=7, max_tokens=9, logprobs=2),
        SamplingParams(temperature=0, max_tokens=20, stop=[" the", "e"]),
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0.5, seed=11, max_tokens=15, min_tokens=3),
    ]
    before = fast.llm_engine.launcher.num_launched_ahead
    assert _run(fast, prompts, params) == _run(sync, prompts, params)
    assert fast.llm_engine.launcher.num_launched_ahead > before  # the fast path was taken


def test_penalties_are_launched_ahead_and_count_the_token_in_flight(engines):
    """Penalties read a request's tokens so far, whose last is still on the device when its next
    step is launched: the model runner counts it there."""
    fast, sync = engines
    prompts = ["Hello", "a b c d e f g", "x"]
    params = [
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=2.0, frequency_penalty=1.0),
        SamplingParams(temperature=0, max_tokens=24, presence_penalty=2.0, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, seed=5, max_tokens=24),
    ]
    before = fast.llm_engine.launcher.num_launched_ahead
    assert _run(fast, prompts, params) == _run(sync, prompts, params)
    assert fast.llm_engine.launcher.num_launched_ahead > before + 10


def test_min_tokens_counts_the_token_in_flight(engines):
    """A min_tokens ban lifts at the step whose token is the min_tokens-th, launched ahead or not:
    a stop token that greedy decoding would take exactly there ends the request there."""
    fast, sync = engines
    prompt = {"prompt_token_ids": list(range(40, 52))}
    free = sync.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    at = next(i for i in range(3, 12) if tokens[i] not in tokens[:i])  # (never banned before it: unchanged)
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=at, stop_token_ids=[tokens[at]])
    before = fast.llm_engine.launcher.num_launched_ahead
    expected = _run(sync, [prompt], params)
    assert expected[0][0][0] == tokens[: at + 1] and expected[0][0][2] == "stop"
    assert _run(fast, [prompt], params) == expected
    assert fast.llm_engine.launcher.num_launched_ahead >= before + at - 1


@pytest.mark.parametrize("engine", ["async", "sync"])
def test_penalties_build_their_tensors_once_while_the_same_requests_sample(engines, engine, monkeypatch):
    """The prompts and outputs (which the penalties read) are padded into tensors once while the
    same requests sample step after step, again when the batch changes (requests finishing at
    different lengths, others admitted in their place): meanwhile the outputs grow on the device
    by the tokens sampled. Tokens as when the outputs are sent every step."""
    from picovllm.engine import step_launcher
    from picovllm.worker import sampler

    llm = engines[0] if engine == "async" else engines[1]
    prompts = [{"prompt_token_ids": list(range(100 + 9 * i, 130 + 14 * i))} for i in range(6)]
    params = [
        SamplingParams(
            temperature=0.8 if i % 2 else 0,
            seed=i,
            max_tokens=6 + 3 * i,
            repetition_penalty=1.2,
            frequency_penalty=0.5,
            presence_penalty=0.3 * i,
            min_tokens=2 * i,
        )
        for i in range(6)
    ]
    batch = step_launcher.sampling_batch
    with monkeypatch.context() as m:  # (no batch continues another: the lists serve every step)
        m.setattr(step_launcher, "sampling_batch", lambda *a, before=None, **k: batch(*a, **k))
        expected = _run(llm, prompts, params)
    padded = []
    pad = sampler._pad
    monkeypatch.setattr(sampler, "_pad", lambda rows, *a: padded.append(rows) or pad(rows, *a))
    steps = llm.llm_engine.num_steps
    assert _run(llm, prompts, params) == expected
    steps = llm.llm_engine.num_steps - steps
    prompt_pads = sum(len(rows[0]) >= 30 for rows in padded)  # (prompts: 30 tokens or more; outputs: 21 at most)
    assert len(padded) - prompt_pads == prompt_pads <= 12 < steps  # (the batch changes as requests join and leave)


def test_stops_and_aborts_while_a_step_is_in_flight(engines, monkeypatch):
    """Requests that stop (EOS, max_tokens) or are aborted while the next step is already
    launched: their extra token is dropped, invariants hold after every step, and every block
    is free at the end."""
    fast, sync = engines
    engine = fast.llm_engine
    monkeypatch.setattr(engine, "debug_invariants", True)
    params = SamplingParams(temperature=0, max_tokens=10)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    expected = [
        o.outputs[0].token_ids
        for o in sync.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    for i, p in enumerate(prompts + [[20, 21]]):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=10 if i < 3 else 40))
    done, steps, dropped = {}, 0, engine.core_outputs.num_dropped
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 4:
            assert engine.launcher.inflight is not None  # a step is in flight: abort under it
            engine.abort_request("r3")
    assert [done[f"r{i}"] for i in range(3)] == expected and "r3" not in done
    assert engine.core_outputs.num_dropped > dropped  # requests did stop under a step launched ahead
    assert engine.block_manager.num_used_blocks == engine.scheduler.cache.num_cached_blocks
    assert fast.reset_prefix_cache() and engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_prompt_chunks_and_admissions_are_launched_ahead_too(tiny_qwen, monkeypatch):
    """Prompts arriving while others decode, prefilled in chunks (an 8-token budget): the steps
    that carry their chunks are launched ahead as well (the decodes' tokens on the device, the
    chunks' from the host), with invariants after every step and the synchronous tokens."""
    kw = dict(skip_tokenizer_init=True, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    fast = make_llm(tiny_qwen[0], async_scheduling=True, **kw)
    sync = make_llm(tiny_qwen[0], async_scheduling=False, **kw)
    engine = fast.llm_engine
    monkeypatch.setattr(engine, "debug_invariants", True)
    prompts = [[5 + i * 3 + j for j in range(n)] for i, n in enumerate([3, 19, 6, 12, 2])]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in sync.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    done, chunks_ahead, step = {}, 0, 0
    while step < 3 * len(prompts) or engine.has_unfinished_requests():
        if step % 3 == 0 and step // 3 < len(prompts):  # a new prompt every third step
            engine.add_request(str(step // 3), prompts[step // 3], params)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
        inflight = engine.launcher.inflight
        chunks_ahead += inflight is not None and any(n > 1 for n in inflight.batch.num_new_tokens)
        step += 1
    assert [done[i] for i in range(len(prompts))] == expected
    assert chunks_ahead >= 3
    assert engine.block_manager.num_used_blocks == engine.scheduler.cache.num_cached_blocks


def _random_params(rng: random.Random) -> SamplingParams:
    """A random mix of the sampling settings (seeded where it samples)."""
    kw = dict(max_tokens=rng.randint(1, 24), seed=rng.randint(0, 999), temperature=rng.choice([0, 0, 0.5, 1.0, 1.5]))
    maybe = [
        ("top_k", [1, 5, 50]),
        ("top_p", [0.5, 0.9]),
        ("min_p", [0.05, 0.2]),
        ("repetition_penalty", [0.9, 1.3]),
        ("frequency_penalty", [-0.5, 1.5]),
        ("presence_penalty", [0.5, 1.0]),
        ("logprobs", [0, 2]),
        ("prompt_logprobs", [0, 1]),
        ("n", [2, 3]),
        ("ignore_eos", [True]),
        ("stop", [["e"], [" the", "a"]]),
    ]
    for name, values in maybe:
        if rng.random() < 0.25:
            kw[name] = rng.choice(values)
    if rng.random() < 0.25:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.25:
        kw["stop_token_ids"] = rng.sample(range(3, 250), 3)
    if rng.random() < 0.15:
        kw["logit_bias"] = {rng.randint(3, 250): rng.choice([-100, 5, 100]) for _ in range(3)}
    elif rng.random() < 0.1:
        kw["allowed_token_ids"] = rng.sample(range(3, 250), 20)
    elif rng.random() < 0.1:
        kw["structured_outputs"] = StructuredOutputsParams(**rng.choice(CONSTRAINTS))
    return SamplingParams(**kw)


CONSTRAINTS = [
    {"regex": "[a-z]{2,8}"},
    {"choice": ["alpha", "beta", "gamma"]},
    {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
]


@pytest.fixture(scope="module")
def tight(tiny_qwen):
    """Engines, async and not, with 32 KV blocks of 4 tokens for 5 sequences of up to 80 tokens
    (preemption) and a 32-token step budget (prompts in chunks); prefix caching on."""
    kw = dict(block_size=4, max_num_seqs=5, num_gpu_blocks_override=32, max_num_batched_tokens=32)
    return make_llm(tiny_qwen[0], async_scheduling=True, **kw), make_llm(tiny_qwen[0], async_scheduling=False, **kw)


@pytest.mark.parametrize("seed", range(3))
def test_random_mixes_of_settings_under_preemption_equal_the_synchronous_engine(tight, seed):
    """Random requests (shared prefixes or not) with random mixes of every sampling setting,
    eight rounds of up to ten: each request's completions as the synchronous engine's (the
    log-probabilities within rounding: batches may differ), none refused by its grammar; KV
    preempted along the way."""
    fast, sync = tight
    preempted = fast.llm_engine.scheduler.num_preemptions
    for round_ in range(8):
        rng = random.Random(1000 * seed + round_)
        base = [rng.randint(3, 250) for _ in range(30)]
        prompts = [
            {"prompt_token_ids": base[: rng.randint(1, 30)] * (i % 2) + [rng.randint(3, 250)] * rng.randint(1, 40)}
            for i in range(rng.randint(1, 10))
        ]
        params = [_random_params(rng) for _ in prompts]
        got = fast.generate(prompts, params, use_tqdm=False)
        want = sync.generate(prompts, params, use_tqdm=False)
        for g, w, p in zip(got, want, params, strict=True):
            assert [(c.token_ids, c.text, c.finish_reason) for c in g.outputs] == [
                (c.token_ids, c.text, c.finish_reason) for c in w.outputs
            ], p
            assert [c.cumulative_logprob for c in g.outputs] == pytest.approx(
                [c.cumulative_logprob for c in w.outputs], abs=1e-3
            )
            assert p.allowed_token_ids or all(c.finish_reason != "abort" for c in g.outputs), p
    assert fast.llm_engine.scheduler.num_preemptions > preempted
