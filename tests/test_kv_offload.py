"""The KV cache's host tier (kv_offload_memory) and swap preemption: the two-tier radix tree and
its eviction policies, the copies the block manager queues, multi-turn chats that hit on the host,
swap preemption against recompute, tensor parallelism, and the options' checks. (The randomised
engine stress with the tier on, invariants and host copies checked after every step, is in
test_prefix_cache.py.)"""

import random

import pytest
from conftest import make_llm
from tiny_models import build_model

from picovllm import SamplingParams
from picovllm.engine.block_manager import BlockManager
from picovllm.engine.prefix_cache import PrefixCache
from picovllm.engine.radix_tree import RadixTree
from picovllm.engine.request import Request

BS = 4
BLOCK_BYTES = 2 * 3 * BS * 2 * 16 * 4  # tiny_qwen: K and V of 3 layers, 4 tokens of 2 fp32 heads of 16


def _req(tokens, rid="r"):
    return Request(rid, rid, 0, None, tokens, SamplingParams(), 0, None)


def _admit(cache, req):
    cache.allocate(req, cache.acquire(req))
    cache.insert(req, req.num_tokens)


def test_an_evicted_node_is_demoted_and_a_hit_promotes_it_back():
    bm = BlockManager(4, BS, num_host_blocks=4)
    cache = PrefixCache(bm, enabled=True)
    a = _req(list(range(9)), "a")  # 2 full blocks cached, the last token's block its own
    _admit(cache, a)
    gpu_a = a.block_table[:2]
    cache.release(a)
    b = _req([50 + i for i in range(13)], "b")  # needs all 4 GPU blocks: a's 2 cached ones go to the host
    _admit(cache, b)
    node = cache.tree.match_prefix(list(range(8)))[0]
    assert node.blocks is None and len(node.host) == 2 and cache.demoted_blocks == 2
    assert bm.take_copies() == [(True, gpu_a, node.host)]  # queued in order: out before b's forward
    cache.check_invariants([b])
    cache.release(b)
    again = _req(list(range(8)) + [99], "c")
    _admit(cache, again)  # room for the promotion: b's blocks, dropped (the host holds only what is promoted)
    assert again.num_cached_tokens == 8 and again.num_host_cached_tokens == 8
    assert node.blocks == again.block_table[:2] and node.host == [0, 1]  # on both tiers now
    assert bm.take_copies() == [(False, [0, 1], node.blocks)]
    assert cache.tree.match_prefix(b.token_ids)[1] == 0
    cache.check_invariants([again])
    assert cache.promoted_blocks == 2 and cache.evicted_blocks == 2 + 3 and cache.host_evicted_blocks == 0
    assert node.copied  # (its GPU copy came from the host: the same bytes)


def test_a_host_only_node_computed_again_is_marked_as_not_copied():
    """A request that computes tokens the host holds (no GPU blocks to promote them into) gives
    the node its GPU copy: the same tokens' KV, but computed again, so the invariants check it
    within rounding, not byte for byte; a demotion or promotion is a copy again."""
    tree = RadixTree(BS)
    node, _ = tree.insert(list(range(8)), [5, 6])
    tree.set_host(node, [0, 1])
    assert node.copied
    tree.drop_gpu(node)
    _, taken = tree.insert(list(range(8)) + [9], [7, 8, 3])
    assert taken == [7, 8] and node.blocks == [7, 8] and node.host == [0, 1] and not node.copied
    head = tree._split(node, 4)  # (a split keeps it on both parts)
    assert not head.copied and not node.copied
    tree.drop_gpu(node)
    tree.set_gpu(node, [4])
    assert node.copied


def test_copies_are_queued_in_order_and_joined_only_when_safe():
    bm = BlockManager(8, BS, num_host_blocks=8)
    bm.copy_to_host([1, 2], [5, 6])
    bm.copy_to_host([3], [7])  # same way, other blocks written: one copy
    bm.copy_to_gpu([5], [1])
    bm.copy_to_host([4], [5])  # host block 5 written after the copy reading it
    bm.copy_to_host([6], [5])  # written again: a copy of its own, after
    assert bm.take_copies() == [(True, [1, 2, 3], [5, 6, 7]), (False, [5], [1]), (True, [4], [5]), (True, [6], [5])]
    assert bm.take_copies() == [] and bm.copied_blocks == [1, 5]


class _MostRecentFirst:
    """Another eviction order, to show the tree takes whichever policy it is given."""

    def __init__(self):
        self.nodes = []

    def offer(self, node):
        if node not in self.nodes:
            self.nodes.append(node)

    def pop(self):
        if not self.nodes:
            return None
        node = max(self.nodes, key=lambda n: n.last_access)
        self.nodes.remove(node)
        return node


def test_the_model_runner_copies_keep_the_decision_order(tiny_qwen):
    """The runner stages promotions before the step's demotions (their PCIe copies overlap
    compute on a GPU), except one that reads a host block a demotion before it writes: a block
    demoted and promoted back in one step, and one promoted from a host block that a later
    demotion reuses, both arrive with the right KV (on TEST_DEVICE)."""
    import torch

    runner = make_llm(
        tiny_qwen[0], block_size=BS, kv_offload_memory=8 * BLOCK_BYTES
    ).llm_engine.executor.driver.model_runner
    gen = torch.Generator().manual_seed(0)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=gen))
    runner.host_kv.copy_(torch.randn(runner.host_kv.shape, generator=gen))
    gpu, host = runner.kv_cache.cpu(), runner.host_kv.clone()
    runner.copy_blocks(
        [
            (True, [1], [3]),  # GPU 1 -> host 3,
            (False, [3, 5], [6, 7]),  # then host 3 (just written) and 5 -> GPU 6 and 7,
            (False, [4], [8]),  # host 4 -> GPU 8 (staged first),
            (True, [2], [4]),  # then host 4 overwritten by GPU 2
        ]
    )
    if runner.kv_cache.is_cuda:
        torch.cuda.synchronize()
    now = runner.kv_cache.cpu()
    for g, expected in [(6, gpu[:, :, 1]), (7, host[5]), (8, host[4])]:
        assert torch.equal(now[:, :, g], expected), g
    assert torch.equal(runner.host_kv[3], gpu[:, :, 1]) and torch.equal(runner.host_kv[4], gpu[:, :, 2])


def test_the_eviction_order_is_the_policys():
    for policy, first in [(None, [10, 11]), (_MostRecentFirst(), [30, 31])]:
        tree = RadixTree(BS, gpu_policy=policy)
        for i, blocks in enumerate([[10, 11], [20, 21], [30, 31]]):
            tree.insert([i + 1] * 8, blocks)
        assert tree.drop_gpu(tree.gpu_victim())[0] == first
        tree.check_invariants()


def test_host_only_nodes_hang_below_the_gpu_part_and_go_with_it():
    tree = RadixTree(BS)
    leaf, _ = tree.insert(list(range(12)), [1, 2, 3])
    tree.insert(list(range(8)), [1, 2])  # no-op; then split the edge at 8
    tree.insert(list(range(8)) + [70] * 4, [1, 2, 4])
    tail = tree.match_prefix(list(range(12)))[0]
    tree.set_host(tail, [9])
    assert tree.drop_gpu(tail) == ([3], [])  # demoted: host copy kept
    head = tail.parent
    other = head.children[70]
    assert tree.gpu_victim() is other  # (the head has a child on the GPU still)
    assert tree.drop_gpu(other) == ([4], [])
    assert tree.drop_gpu(tree.gpu_victim()) == ([1, 2], [9])  # the head had no host copy: its subtree goes too
    assert tree.num_blocks == tree.num_host_blocks == 0 and tree.host_victim() is None
    tree.check_invariants()


def _chats(seed, n, turns, first, step):
    """n conversations of `turns` turns: each turn's prompt is the history so far plus new tokens."""
    rng = random.Random(seed)
    history = [[rng.randrange(10, 250) for _ in range(first)] for _ in range(n)]
    for _ in range(turns):
        for h in history:
            h += [rng.randrange(10, 250) for _ in range(step)]
            yield list(h)


def test_multi_turn_chats_hit_on_the_host(tiny_qwen):
    """Histories that do not fit the GPU pool: with the tier off every turn starts over, with it
    on the turns hit on the host; num_cached_tokens counts both tiers, the metrics split them."""
    prompts = list(_chats(0, n=6, turns=3, first=40, step=16))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    results = {}
    for offload in (0, 200):
        llm = make_llm(
            tiny_qwen[0],
            skip_tokenizer_init=True,
            block_size=BS,
            num_gpu_blocks_override=40,
            max_model_len=160,
            kv_offload_memory=offload * BLOCK_BYTES,
        )
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
        results[offload] = ([o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs])
        metrics = llm.get_metrics()
        assert metrics["prefix_cache_hit_tokens"] == sum(results[offload][1])
    (tokens_off, hits_off), (tokens_on, hits_on) = results[0], results[200]
    assert tokens_on == tokens_off and sum(hits_off) == 0
    assert all(h == (len(p) - 16) // BS * BS for h, p in zip(hits_on[6:], prompts[6:]))  # every later turn: its history
    assert metrics["prefix_cache_host_hit_tokens"] > 0 and metrics["kv_offload_promoted_blocks"] > 0
    assert metrics["kv_offload_bytes_to_gpu"] == metrics["kv_offload_promoted_blocks"] * BLOCK_BYTES


def test_swap_preemption_resumes_with_the_tokens_recompute_gives(tiny_qwen):
    prompts = [{"prompt_token_ids": list(range(20 + i, 40 + 2 * i))} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, block_size=BS, num_gpu_blocks_override=20, max_num_seqs=6)
    recompute = make_llm(tiny_qwen[0], **kw)
    swap = make_llm(
        tiny_qwen[0],
        enable_prefix_caching=False,  # (nothing comes back from the prefix cache: all from the host)
        kv_offload_memory=64 * BLOCK_BYTES,
        preemption_mode="swap",
        **kw,
    )
    runs = [
        [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for llm in (recompute, swap)
    ]
    assert runs[0] == runs[1]
    assert recompute.get_metrics()["num_preemptions"] > 0
    metrics = swap.get_metrics()
    assert metrics["num_swapped_out"] == metrics["num_preemptions"] > 0 and metrics["kv_offload_bytes_to_gpu"] > 0
    assert metrics["kv_offload_blocks_free"] == 64  # nothing left on the host once all finished


def test_tensor_parallel_ranks_move_their_own_heads(tmp_path):
    """tp=2 with the tier on and swap preemption: each rank copies its heads of the blocks the
    driver chose; the outputs are tp=1's without the tier."""
    path = str(tmp_path)
    build_model(path, "qwen2", heads=4, kv_heads=2, tokenizer=False, seed=3)
    prompts = [{"prompt_token_ids": p} for p in _chats(1, n=4, turns=2, first=24, step=8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, block_size=BS, num_gpu_blocks_override=24, max_num_seqs=4, max_model_len=96)
    ref = [o.outputs[0].token_ids for o in make_llm(path, **kw).generate(prompts, params, use_tqdm=False)]
    llm = make_llm(
        path, tensor_parallel_size=2, kv_offload_memory=48 * BLOCK_BYTES // 2, preemption_mode="swap", **kw
    )  # (half a block's bytes on each rank: its heads)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    metrics = llm.get_metrics()
    llm.shutdown()
    assert got == ref
    assert metrics["kv_offload_blocks_total"] == 48 and metrics["kv_offload_demoted_blocks"] > 0


def test_the_options_are_checked(tiny_qwen):
    with pytest.raises(ValueError, match="'swap' needs host memory"):
        make_llm(tiny_qwen[0], preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode must be 'recompute' or 'swap'"):
        make_llm(tiny_qwen[0], preemption_mode="never")
    with pytest.raises(ValueError, match="kv_offload_memory is not supported on a prefill or decode"):
        make_llm(tiny_qwen[0], kv_offload_memory=1 << 20, kv_role="prefill")
    with pytest.raises(ValueError, match="holds no KV block"):
        make_llm(tiny_qwen[0], kv_offload_memory=100)


def test_the_server_shows_the_host_tier(tiny_qwen):
    """`picovllm serve --kv-offload-memory B --preemption-mode swap` become the engine's options,
    and the tier's counts are on /metrics."""
    import httpx

    from picovllm.entrypoints.args import engine_kwargs
    from picovllm.entrypoints.cli import build_parser
    from picovllm.entrypoints.openai.async_engine import AsyncEngine
    from picovllm.entrypoints.openai.server import build_app, serve_in_thread

    argv = ["serve", tiny_qwen[0], "--kv-offload-memory", str(64 * BLOCK_BYTES), "--preemption-mode", "swap"]
    options = {
        k: v
        for k, v in engine_kwargs(build_parser().parse_args(argv)).items()
        if k in ("kv_offload_memory", "preemption_mode")
    }
    assert options == {"kv_offload_memory": 64 * BLOCK_BYTES, "preemption_mode": "swap"}
    engine = AsyncEngine(make_llm(tiny_qwen[0], block_size=BS, num_gpu_blocks_override=20, **options).llm_engine)
    url, stop = serve_in_thread(build_app(engine, "tiny"))
    try:
        body = {"model": "tiny", "prompt": list(range(10, 50)), "max_tokens": 4}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        lines = httpx.get(url + "/metrics").text.splitlines()
        metrics = {line.split()[0]: float(line.split()[1]) for line in lines if line and line[0] != "#"}
        assert metrics["picovllm:kv_offload_blocks_total"] == metrics["picovllm:kv_offload_blocks_free"] == 64
        assert metrics["picovllm:num_swapped_out"] == 0 and "picovllm:kv_offload_bytes_to_gpu" in metrics
    finally:
        stop()
        engine.shutdown()


@pytest.mark.parametrize("preemption,async_scheduling", [("swap", False), ("recompute", True)])
def test_random_arrivals_and_aborts_keep_both_tiers_consistent(tiny_qwen, preemption, async_scheduling):
    """Requests arriving and aborted at random steps, prompts sharing prefixes, n > 1, penalties,
    grammars and prompt logprobs, in 40 GPU blocks over a host tier: invariants after every step
    (a node in both tiers holds the same KV in both: the same bytes, or within rounding where a
    request computed again what the host held), every request ended, and nothing held after."""
    from picovllm import StructuredOutputsParams

    llm = make_llm(
        tiny_qwen[0],
        block_size=4,
        max_num_seqs=5,
        num_gpu_blocks_override=40,
        max_num_batched_tokens=32,
        preemption_mode=preemption,
        kv_offload_memory=64 * BLOCK_BYTES,
        async_scheduling=async_scheduling,
    )
    engine = llm.llm_engine
    engine.debug_invariants = True
    rng = random.Random(1)
    base = [rng.randint(3, 250) for _ in range(20)]
    live, ended = set(), 0
    for step in range(120):
        for _ in range(rng.randint(0, 3) if step < 100 else 0):
            rid = f"{step}-{rng.random()}"
            kw = dict(max_tokens=rng.randint(1, 30), temperature=rng.choice([0, 1.0]), seed=rng.randint(0, 99))
            kw.update(rng.choice([{}, {}, {"n": 2}, {"repetition_penalty": 1.3}, {"prompt_logprobs": 1}]))
            if rng.random() < 0.15:
                kw["structured_outputs"] = StructuredOutputsParams(regex="[a-z]{2,12}")
            prompt = base[: rng.randint(0, 20)] + [rng.randint(3, 250) for _ in range(rng.randint(1, 40))]
            engine.add_request(rid, prompt, SamplingParams(**kw))
            live.add(rid)
        for out in engine.step() if engine.has_unfinished_requests() else []:
            if out.finished:
                live.discard(out.request_id)
                ended += 1
        assert not engine.take_failed()
        if live and rng.random() < 0.1:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
    while engine.has_unfinished_requests():
        ended += sum(out.finished for out in engine.step())
        assert not engine.take_failed()
    bm, m = engine.block_manager, engine.get_metrics()
    assert ended > 100 and m["num_preemptions"] > 0 and m["kv_offload_promoted_blocks"] > 0
    assert llm.reset_prefix_cache() and bm.num_free_blocks == bm.num_total_blocks
    assert bm.host.num_free == bm.host.num_blocks
