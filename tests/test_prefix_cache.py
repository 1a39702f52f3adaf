"""Prefix caching: the radix tree at unaligned positions, the two reference counts, the three bugs
the original hit (as regression tests by name), a randomised stress of the whole engine with the
invariant checker after every step, and identical outputs with the cache on and off."""

import random

import pytest
from conftest import make_llm

from picovllm import SamplingParams
from picovllm.engine.block_manager import BlockManager
from picovllm.engine.prefix_cache import PrefixCache
from picovllm.engine.radix_tree import RadixTree
from picovllm.engine.request import Request

BS = 4


def _evict(tree, n):
    """Drop the GPU policy's victims until n GPU blocks are freed (no host tier)."""
    freed = []
    while len(freed) < n and (node := tree.gpu_victim()) is not None:
        freed += tree.drop_gpu(node)[0]
    return freed


def _tree_with(seq, blocks):
    tree = RadixTree(BS)
    tree.insert(seq, blocks)
    return tree


def test_match_at_unaligned_positions():
    seq = list(range(100, 114))  # 14 tokens: 3 full blocks
    tree = _tree_with(seq, [7, 8, 9])
    node, n = tree.match_prefix(seq[:6] + [999])
    assert n == 6 and tree.path_blocks(node, n // BS * BS) == [7]
    node, n = tree.match_prefix(seq + [1, 2])
    assert n == 14 and tree.path_blocks(node, 12) == [7, 8, 9]
    assert tree.match_prefix([5, 6])[1] == 0
    tree.check_invariants()


def test_split_keeps_blocks_with_the_part_they_end_in():
    """Seed bug 3: after a split at offset i + m of an edge starting at i, the head keeps
    (i + m) // bs - i // bs blocks and the tail the rest."""
    a = list(range(10))  # edge [0, 10): blocks 0, 1 (ending at 4 and 8)
    tree = _tree_with(a, [50, 51])
    b = a[:6] + [77, 78, 79, 80, 81, 82]  # diverges at token 6, mid block 1
    leaf, new = tree.insert(b, [50, 60, 61])
    head = leaf.parent
    assert (head.start, head.end, head.blocks) == (0, 6, [50])  # 6 // 4 - 0 // 4 = 1 block
    tail = head.children[6]
    assert (tail.start, tail.end, tail.blocks) == (6, 10, [51])
    assert (leaf.start, leaf.end, leaf.blocks) == (6, 12, [60, 61]) and new == [60, 61]
    assert tree.path_blocks(*tree.match_prefix(a)[:1], 8) == [50, 51]
    assert tree.path_blocks(leaf, 12) == [50, 60, 61]
    tree.check_invariants()


def test_edges_leave_the_garbage_collectors_view():
    """The tree holds every cached token for as long as a server runs: each edge's tokens are out
    of the collector's view after one collection (a list of them would be walked item by item
    in every collection of its generation, however old), through splits too."""
    import gc

    tree = _tree_with(list(range(100, 140)), list(range(10)))
    tree.insert(list(range(100, 122)) + [7] * 18, list(range(5)) + [20, 21, 22, 23, 24])  # splits at 22
    gc.collect()
    nodes = list(tree.nodes())
    assert len(nodes) == 3 and not any(gc.is_tracked(n.tokens) for n in nodes)
    tree.check_invariants()


def test_split_at_block_boundary_and_at_edge_start():
    tree = _tree_with(list(range(12)), [1, 2, 3])
    leaf, _ = tree.insert(list(range(8)) + [90, 91, 92, 93], [1, 2, 4])
    assert leaf.parent.end == 8 and leaf.parent.blocks == [1, 2] and leaf.blocks == [4]
    leaf2, new = tree.insert([55] * 5, [9])
    assert leaf2.parent is tree.root and new == [9]
    tree.check_invariants()


def test_insert_existing_prefix_adds_nothing():
    tree = _tree_with(list(range(8)), [1, 2])
    node, new = tree.insert(list(range(8)), [5, 6])  # same tokens, other blocks: the tree keeps its own
    assert new == [] and node.blocks == [1, 2] and tree.num_blocks == 2


def test_evict_lru_leaves_only_unlocked():
    tree = RadixTree(BS)
    a, _ = tree.insert([1] * 8, [10, 11])
    b, _ = tree.insert([2] * 8, [20, 21])
    c, _ = tree.insert([3] * 8, [30, 31])
    tree.match_prefix([1] * 8)  # a is now the most recently used
    tree.lock(b, +1)
    assert tree.num_evictable_blocks == 4
    assert sorted(_evict(tree, 1)) == [30, 31]  # c: least recently used unlocked leaf, whole node
    assert sorted(_evict(tree, 10)) == [10, 11]  # b is locked
    tree.lock(b, -1)
    assert sorted(_evict(tree, 10)) == [20, 21] and tree.num_blocks == 0
    tree.check_invariants()


def test_evicting_a_leaf_exposes_its_parent():
    tree = RadixTree(BS)
    tree.insert(list(range(8)), [1, 2])
    tree.insert(list(range(4)) + [9, 9, 9, 9], [1, 3])  # splits at 4: parent [0,4) holds block 1
    assert sorted(_evict(tree, 3)) == [1, 2, 3] and tree.num_blocks == 0


def _req(tokens, rid="r"):
    return Request(rid, rid, 0, None, tokens, SamplingParams(), 0, None)


def _cache(num_blocks=16):
    bm = BlockManager(num_blocks, BS)
    return bm, PrefixCache(bm, enabled=True)


def _admit(cache, req):
    cache.allocate(req, cache.acquire(req))
    cache.insert(req, req.num_tokens)


def test_release_frees_exactly_the_requests_blocks():
    """Seed bug 1: release never re-matches tokens; it drops the request's own block list."""
    bm, cache = _cache()
    a = _req(list(range(12)), "a")
    _admit(cache, a)
    b = _req(list(range(8)) + [50, 51, 52, 53, 54], "b")  # shares 2 blocks with a
    _admit(cache, b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    cache.check_invariants([a, b])
    cache.release(b)
    cache.check_invariants([a])
    assert all(bm.ref_count(x) == 2 for x in a.block_table)  # a + the tree
    cache.release(a)
    cache.check_invariants([])
    cache.reset()
    assert bm.num_free_blocks == 16


def test_unlock_through_saved_node_after_a_split():
    """Seed bug 2: a split between match and release must not misdirect the unlock: the new
    parent copies lock_ref and the saved node's parent chain passes through it."""
    bm, cache = _cache()
    a = _req(list(range(16)), "a")
    _admit(cache, a)
    cache.release(a)  # cached, unlocked
    b = _req(list(range(13)), "b")  # matches 12 tokens: locks a's node mid-edge
    _admit(cache, b)
    c = _req(list(range(6)) + [70] * 7, "c")  # splits a's edge at token 6, under b's lock
    _admit(cache, c)
    cache.check_invariants([b, c])
    cache.release(b)
    cache.check_invariants([c])
    cache.release(c)
    cache.check_invariants([])
    assert all(n.lock_ref == 0 for n in cache.tree.nodes())


def test_full_prompt_hit_still_computes_the_last_token():
    bm, cache = _cache()
    a = _req(list(range(8)), "a")
    _admit(cache, a)
    b = _req(list(range(8)), "b")
    cache.acquire(b)
    assert b.num_cached_tokens == 4  # 8 would leave nothing to compute: rounded down from 7


@pytest.fixture(scope="module")
def llms(tiny_qwen):
    kw = dict(skip_tokenizer_init=True, block_size=4, max_model_len=96, max_num_seqs=6)
    return make_llm(tiny_qwen[0], **kw), make_llm(tiny_qwen[0], enable_prefix_caching=False, **kw)


def _workload(seed, n=24):
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 300) for _ in range(rng.randint(5, 40))] for _ in range(3)]
    prompts = []
    for _ in range(n):
        base = rng.choice(systems)
        cut = rng.randint(1, len(base))  # diverge at an arbitrary token offset
        prompts.append(base[:cut] + [rng.randrange(3, 300) for _ in range(rng.randint(1, 12))])
    return prompts


def test_outputs_identical_with_cache_on_and_off(llms):
    on, off = llms
    prompts = [{"prompt_token_ids": p} for p in _workload(0)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = on.generate(prompts, params, use_tqdm=False)
    again = on.generate(prompts, params, use_tqdm=False)  # warm: prompts now cached
    ref = off.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]
    assert all(o.num_cached_tokens == 0 for o in ref)
    # warm: each prompt's full blocks are cached, except that the last token is always computed
    assert [o.num_cached_tokens for o in again] == [(len(p["prompt_token_ids"]) - 1) // 4 * 4 for p in prompts]
    metrics = on.get_metrics()
    assert metrics["prefix_cache_hit_tokens"] >= sum(o.num_cached_tokens for o in again) > 0


def test_same_step_requests_share_the_prefix(llms):
    on, off = llms
    on.reset_prefix_cache()
    shared = list(range(10, 30))  # 20 tokens = 5 blocks
    prompts = [{"prompt_token_ids": shared + [40 + i]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = on.generate(prompts, params, use_tqdm=False)  # all admitted in one step
    assert [o.num_cached_tokens for o in outs] == [0, 20, 20]
    ref = off.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


# With FP8 weights and KV cache a cached and a cache-free engine can differ a little: a value
# computed in fp32 with a rounding that depends on the step's batch (its chunks, its neighbours)
# can round to the next e4m3 value. Over the stress's seeds 20-35 (tp = 1), 7 of 16 runs showed
# such differences: a token's log-probability up to 0.149 from the reference's, and in 4 runs
# one request of 30 took another token where the top two were within 0.10 of each other. A
# deliberate error (each sequence's first value vector 5% too large in steps that continue a
# prompt) failed both FP8 cases.
FP8_LOGPROB_TOL = 0.3


def _agree_up_to_fp8_rounding(got, want) -> bool:
    """got, want: a request's CompletionOutputs with top-5 log-probabilities, from an engine and
    its cache-free reference. They agree token for token, each token's log-probability within
    FP8_LOGPROB_TOL of the reference's, up to where (if anywhere) they first differ; there the
    two tokens nearly tie in both engines: each within FP8_LOGPROB_TOL of the top. Returns
    whether they differ. (hf_reference.assert_greedy_match, the rule against transformers, stops
    at the reference's first near-tie whether or not the tokens part there: at this tolerance, in
    a tiny random model's flat distribution, it would compare at most one token of 24 of seed 9's
    30 requests.)"""
    for i, (mine, theirs) in enumerate(zip(got.token_ids, want.token_ids, strict=True)):
        ours, ref = got.logprobs[i], want.logprobs[i]
        if mine != theirs:  # each engine's token and the other's
            for top5, other in ((ours, theirs), (ref, mine)):
                best = max(v.logprob for v in top5.values())
                assert other in top5 and best - top5[other].logprob <= FP8_LOGPROB_TOL, (i, top5, other)
            return True
        assert abs(ours[mine].logprob - ref[mine].logprob) <= FP8_LOGPROB_TOL, (i, ours, ref)
    return False


@pytest.mark.parametrize(
    "seed,budget,async_scheduling,offload,preemption,kv_cache_dtype,tp",
    [
        (1, None, False, 0, "recompute", "auto", 1),
        (2, None, False, 0, "recompute", "auto", 1),
        (3, 7, False, 0, "recompute", "auto", 1),
        (4, None, True, 0, "recompute", "auto", 1),
        (5, 7, True, 0, "recompute", "auto", 1),
        (6, None, False, 40, "recompute", "auto", 1),  # a host tier of 40 blocks under the 24 GPU blocks
        (7, 7, True, 40, "swap", "auto", 1),
        (8, None, False, 12, "swap", "auto", 1),  # a host tier too small for everything: it evicts in turn
        (9, 7, True, 40, "swap", "fp8", 1),  # FP8 weights, and K and V in e4m3 on both tiers
        (10, 7, True, 40, "swap", "fp8", 2),  # the same over two tensor-parallel ranks
        (29, 7, True, 40, "swap", "fp8", 1),  # one request takes the other of two nearly tied tokens
    ],
)
def test_randomised_stress_with_invariants(
    tiny_qwen, seed, budget, async_scheduling, offload, preemption, kv_cache_dtype, tp
):
    """Shared prefixes diverging anywhere, arrivals in the same and in different steps, aborts,
    preemption and a pool small enough to force eviction; invariants after every step; outputs
    equal to a cache-free engine; every block free after reset_prefix_cache(). budget 7: prompts
    are prefilled in chunks of at most 7 tokens, mixed with decodes. async_scheduling: steps
    launched ahead (decodes, prompt chunks and admissions) whenever no preemption is due.
    offload: host blocks under the GPU pool (demotions and promotions, the host copies checked
    against their GPU blocks after every step); swap: preempted requests swap to them.
    kv_cache_dtype fp8: with FP8 weights too (quantization="fp8"), as the cache-free engine's;
    outputs equal up to FP8's rounding (_agree_up_to_fp8_rounding).
    tp: tensor-parallel ranks (each holds its KV heads' blocks), as the cache-free engine's (FP8's
    row-parallel layers quantize each rank's slice: tp = 2 is not tp = 1's model)."""
    fp8 = {"kv_cache_dtype": "fp8", "quantization": "fp8"} if kv_cache_dtype == "fp8" else {}
    itemsize = 1 if kv_cache_dtype == "fp8" else 4
    # (a rank's block, tiny_qwen: K and V of 3 layers, 4 tokens of its share of 2 heads of 16, fp32 or e4m3)
    block_bytes = 2 * 3 * 4 * (2 // tp) * 16 * itemsize
    llm = make_llm(
        tiny_qwen[0],
        skip_tokenizer_init=True,
        block_size=4,
        num_gpu_blocks_override=24,
        max_model_len=80,
        max_num_seqs=5,
        max_num_batched_tokens=budget,
        async_scheduling=async_scheduling,
        kv_offload_memory=offload * block_bytes,
        preemption_mode=preemption,
        tensor_parallel_size=tp,
        **fp8,
    )
    engine = llm.llm_engine
    rng = random.Random(seed)
    prompts = _workload(seed, n=30)
    logprobs = 5 if kv_cache_dtype == "fp8" else None  # (_agree_up_to_fp8_rounding's)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=logprobs)
    outputs, aborted, next_id = {}, set(), 0
    while next_id < len(prompts) or engine.has_unfinished_requests():
        for _ in range(rng.choice([0, 0, 1, 3])):  # bursts: several arrive in the same step
            if next_id < len(prompts):
                engine.add_request(str(next_id), prompts[next_id], params)
                next_id += 1
        if rng.random() < 0.05 and engine.groups:
            victim = rng.choice(sorted(engine.groups))
            engine.abort_request(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
        engine.check_invariants()
    metrics = engine.get_metrics()
    assert engine.scheduler.num_preemptions > 0 and metrics["prefix_cache_hit_tokens"] > 0
    assert metrics["prefix_cache_evicted_blocks"] > 0
    assert len(outputs) + len(aborted) >= len(prompts)
    assert engine.reset_prefix_cache()
    assert engine.block_manager.num_free_blocks == 24
    assert (engine.launcher.num_launched_ahead > 0) == async_scheduling
    if offload:
        assert engine.block_manager.host.num_blocks == offload == engine.block_manager.host.num_free
        assert metrics["kv_offload_demoted_blocks"] > 0 and metrics["kv_offload_promoted_blocks"] > 0
        assert 0 < metrics["prefix_cache_host_hit_tokens"] <= metrics["prefix_cache_hit_tokens"]
    assert (metrics.get("num_swapped_out", 0) > 0) == (preemption == "swap")
    llm.shutdown()  # (a process holds one tensor-parallel group: the reference's comes after)
    ref = make_llm(
        tiny_qwen[0],
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        block_size=4,
        tensor_parallel_size=tp,
        **fp8,
    )
    expected = ref.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if kv_cache_dtype == "fp8":
        diverged = [r for r, out in outputs.items() if _agree_up_to_fp8_rounding(out, expected[int(r)].outputs[0])]
        assert len(diverged) <= 3, diverged
    else:
        for rid, out in outputs.items():
            assert out.token_ids == expected[int(rid)].outputs[0].token_ids


def test_debug_flag_checks_invariants_every_step(tiny_qwen, monkeypatch):
    monkeypatch.setenv("PICOVLLM_CHECK_INVARIANTS", "1")
    llm = make_llm(tiny_qwen[0], skip_tokenizer_init=True, block_size=4)
    engine = llm.llm_engine
    assert engine.debug_invariants
    calls = []
    monkeypatch.setattr(engine.scheduler.cache, "check_invariants", lambda live, *_: calls.append(len(live)))
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(calls) == 3
