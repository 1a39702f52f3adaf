"""BlockManager accounting and the scheduler's block invariants under churn."""

import random

import pytest
from conftest import make_llm

from picovllm import SamplingParams
from picovllm.engine.block_manager import BlockManager, NoFreeBlocksError


def _bm(num_blocks=8):
    return BlockManager(num_blocks, 4)


def test_allocate_free_and_refcounts():
    bm = _bm()
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert sorted(a + b) == list(range(8)) and bm.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1)
    bm.inc_ref(a[:1])
    assert bm.ref_count(a[0]) == 2
    bm.free(a)
    assert bm.num_free_blocks == 2 and bm.ref_count(a[0]) == 1  # still held once
    bm.free(a[:1])
    assert bm.num_free_blocks == 3
    bm.check_invariants()
    with pytest.raises(AssertionError, match="double free"):
        bm.free(a[:1])


def test_blocks_conserved_under_random_churn(tiny_qwen):
    """Random arrivals, aborts and a pool small enough to preempt: after every step
    free + used = total, each used block has one holder, and everything is free at the end."""
    path, _ = tiny_qwen
    llm = make_llm(
        path, skip_tokenizer_init=True, block_size=4, num_gpu_blocks_override=20, max_model_len=64, max_num_seqs=5
    )
    engine = llm.llm_engine
    rng = random.Random(0)
    live, next_id, finished = set(), 0, 0
    for _ in range(150):
        if rng.random() < 0.4 and next_id < 40:
            prompt = [rng.randrange(3, 300) for _ in range(rng.randint(1, 30))]
            params = SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randint(1, 30), ignore_eos=True)
            engine.add_request(str(next_id), prompt, params)
            live.add(str(next_id))
            next_id += 1
        if live and rng.random() < 0.08:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                finished += 1
        engine.check_invariants()
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished += out.finished
        engine.check_invariants()
    assert engine.scheduler.num_preemptions > 0
    assert finished > 20
    assert engine.reset_prefix_cache() and engine.block_manager.num_free_blocks == 20


def test_blocks_freed_under_a_step_in_flight_are_known_until_its_work_has_ended():
    """A KV pull into a block freed after a step was launched must wait for that step (it may
    still store KV there); blocks freed before it, or once it has ended, need not."""
    bm = BlockManager(8, 4)
    early = bm.allocate(2)
    bm.free(early)  # (before any step)
    first = bm.step_launched()
    late = bm.allocate(2)
    bm.free(late)  # (step 1 may write these)
    assert not bm.written_in_flight(early) and bm.written_in_flight(late) and bm.written_in_flight(early + late)
    bm.steps_done = first
    assert not bm.written_in_flight(late)
    bm.step_launched()
    bm.free(bm.allocate(1))
    assert bm.written_in_flight(list(range(8))) and not bm.written_in_flight(late)


def test_a_cpu_kv_pool_is_zeros_committed_only_as_it_is_written():
    """allocate_kv_pool on the CPU: zeros of the pool's dtype and shape (FP8's as bytes), views
    that write into it, and memory that grows with what is written (calloc's zero pages), not by
    the whole pool at once as torch.zeros's would."""
    import psutil
    import torch

    from picovllm.model.layers.fp8 import FP8
    from picovllm.worker.model_runner import allocate_kv_pool

    process = psutil.Process()
    for dtype, storage in ((torch.bfloat16, torch.bfloat16), (FP8, torch.uint8)):
        before = process.memory_info().rss
        pool, views = allocate_kv_pool(2, 1 << 14, 16, 4, 128, dtype, "cpu")  # (1 GiB in bf16, 0.5 in FP8)
        assert pool.shape == (2, 2, 1 << 14, 4, 16, 128) and pool.dtype == storage
        assert process.memory_info().rss - before < 64 << 20
        k, v = views[1]
        assert k.shape == (1 << 14, 16, 4, 128) and k.dtype == dtype
        v[7, 3, 2] = 1.0
        assert (pool.view(dtype)[1, 1, 7, 2, 3].float() == 1).all() and pool.count_nonzero() == 128
        assert process.memory_info().rss - before < 64 << 20
        del pool, views, k, v
