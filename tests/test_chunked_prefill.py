"""Mixed steps and chunked prefill: decodes and prompt chunks share one token budget; a prompt
longer than the budget is computed over several steps and samples only after its last chunk."""

import pytest
from conftest import make_llm

from picovllm import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompts(lengths, seed=0):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def test_a_long_prompt_is_chunked_and_mixed_with_decodes(tiny_qwen):
    llm = make_llm(
        tiny_qwen[0],
        skip_tokenizer_init=True,
        block_size=4,
        max_num_batched_tokens=10,
        max_num_seqs=4,
        enable_prefix_caching=False,
        async_scheduling=False,
    )  # steps by hand below
    engine = llm.llm_engine
    short, long = _prompts([6, 23])
    engine.add_request("short", short, GREEDY)
    engine.step()  # prefill of the short prompt (6 tokens)
    engine.add_request("long", long, GREEDY)
    steps, sampled_by = [], []
    for _ in range(4):
        batch = engine.scheduler.schedule()
        steps.append([(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)])
        _, launched = engine.launcher.launch(batch)  # the forward; the requests that sample and their tokens
        tokens = launched.out.sampled.sampled.tolist()
        engine.core_outputs.process(launched.reqs, tokens, launched.out.sampled, [None] * len(tokens))
        sampled_by.append([r.request_id for r in launched.reqs])
        engine.check_invariants()
    # 23 prompt tokens in chunks of 9, 9, 5 beside the short request's decodes, then a decode;
    # the long request samples once its last prompt token is computed, not before
    assert steps == [
        [("short", 1), ("long", 9)],
        [("short", 1), ("long", 9)],
        [("short", 1), ("long", 5)],
        [("short", 1), ("long", 1)],
    ]
    assert sampled_by == [["short"], ["short"], ["short", "long"], ["short", "long"]]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_chunked_outputs_equal_unchunked(tiny_qwen, prefix_caching):
    """Greedy tokens with a 5-token budget equal those of whole-prompt prefills; more prompts
    than max_num_seqs; the cached prefix tokens are those the shared prompt implies."""
    shared = _prompts([13], seed=1)[0]
    prompts = [shared + p for p in _prompts([1, 9, 20, 3, 31, 7], seed=2)] + _prompts([40, 2], seed=3)
    kw = dict(skip_tokenizer_init=True, block_size=4, max_num_seqs=3, enable_prefix_caching=prefix_caching)
    chunked = make_llm(tiny_qwen[0], max_num_batched_tokens=5, **kw)
    whole = make_llm(tiny_qwen[0], enable_chunked_prefill=False, **kw)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    ours = chunked.generate(inputs, GREEDY, use_tqdm=False)
    ref = whole.generate(inputs, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in ref]
    assert chunked.llm_engine.block_manager.num_used_blocks == chunked.llm_engine.scheduler.cache.num_cached_blocks
    if prefix_caching:  # the first request computes the shared 13 tokens' 3 full blocks in chunks
        assert [o.num_cached_tokens for o in ours][1:6] == [12] * 5


def test_a_prompt_that_waits_for_room_without_chunking(tiny_qwen):
    llm = make_llm(
        tiny_qwen[0],
        skip_tokenizer_init=True,
        block_size=4,
        max_model_len=32,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        enable_chunked_prefill=False,
    )
    engine = llm.llm_engine
    a, b = _prompts([20, 20])
    engine.add_request("a", a, GREEDY)
    engine.add_request("b", b, GREEDY)
    first = engine.scheduler.schedule()  # b does not fit what is left of the budget: it waits
    assert [(r.request_id, n) for r, n in zip(first.requests, first.num_new_tokens)] == [("a", 20)]


def test_budget_validation(tiny_qwen):
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be >= max_model_len"):
        make_llm(
            tiny_qwen[0], max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4, enable_chunked_prefill=False
        )
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        make_llm(tiny_qwen[0], max_num_seqs=8, max_num_batched_tokens=4)
