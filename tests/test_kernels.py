"""Every Triton kernel against its PyTorch reference on random inputs of awkward shapes:
non-power-of-2 sizes, contexts crossing block boundaries, padding slots, non-contiguous inputs.
On CPU they run in Triton's interpreter (fp32/fp16: its bf16 dot is unreliable); on CUDA in bf16 too."""

import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from picovllm.kernels.decode_attention import decode_attention_triton, num_splits  # noqa: E402
from picovllm.kernels.gemv import (  # noqa: E402
    fused_linear_ref,
    gemv_triton,
    qkv_rope_store_ref,
    qkv_rope_store_triton,
)
from picovllm.kernels.kv_store import rope_and_store_ref, rope_and_store_triton  # noqa: E402
from picovllm.kernels.paged_attention import paged_attention_ref, plan_paged_attention  # noqa: E402
from picovllm.kernels.prefill_attention import num_splits as prefill_splits  # noqa: E402
from picovllm.kernels.prefill_attention import prefill_attention_triton  # noqa: E402
from picovllm.kernels.rms_norm import rms_norm_ref, rms_norm_triton  # noqa: E402
from picovllm.kernels.silu_mul import silu_mul_ref, silu_mul_triton  # noqa: E402
from picovllm.kernels.triton_utils import next_pow2  # noqa: E402
from picovllm.worker.model_runner import allocate_kv_pool  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
# Triton's interpreter computes masked-out lanes too, with numpy: a query row that sees no key of a
# tile gives -inf - -inf there (NaN, never stored), and numpy warns of it
MASKED_LANES = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_store(dtype):
    """Queries rotated, keys rotated and stored with the values; padding slots store nothing."""
    g = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim, blocks, bs = 13, 5, 3, 24, 7, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads + 1) * dim, generator=g).to(dtype).to(DEV)
    q, k, v = qkv[:, :-dim].split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)  # strided views
    q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    angles = torch.rand(tokens, dim // 2, generator=g) * 50
    cos, sin = angles.cos().to(dtype).to(DEV), angles.sin().to(dtype).to(DEV)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    slots[[2, 7]] = -1  # padding tokens
    slots = slots.to(DEV)
    _, layers = allocate_kv_pool(2, blocks, bs, kv_heads, dim, dtype, DEV)  # (the model runner's strided views)
    caches = [*layers[0], *layers[1]]
    q_ref = rope_and_store_ref(q, k, v, cos, sin, caches[0], caches[1], slots)
    q_out = rope_and_store_triton(q, k, v, cos, sin, caches[2], caches[3], slots)
    _close(q_out, q_ref, dtype)
    _close(caches[2], caches[0], dtype)
    assert torch.equal(caches[1], caches[3])  # values are copied exactly
    stored = (caches[0].abs().sum((2, 3)) > 0).sum().item()
    assert stored == tokens - 2
    _assert_new_kv_as_stored(q, k, v, cos, sin, caches[2], caches[3], slots)


def _assert_new_kv_as_stored(q, k, v, cos, sin, k_cache, v_cache, slots, *scales):
    """rope_and_store_triton's new_kv: each stored token's K and V, as the cache holds them."""
    new_kv = tuple(torch.zeros(k.shape, dtype=k_cache.dtype, device=DEV) for _ in range(2))
    rope_and_store_triton(q, k, v, cos, sin, k_cache, v_cache, slots, *scales, new_kv=new_kv)
    kept = slots >= 0
    blocks, offsets = slots[kept] // k_cache.shape[1], slots[kept] % k_cache.shape[1]
    for new, cache in zip(new_kv, (k_cache, v_cache)):
        assert torch.equal(new[kept].float(), cache[blocks, offsets].float()) and new[kept].float().abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_store_into_an_fp8_cache(dtype):
    """kv_cache_dtype="fp8": the rope-and-store kernel and the batch-1 QKV GEMV store K / k_scale and
    V / v_scale in e4m3, values past e4m3's range clamped to it (448), as the reference stores
    them."""
    from picovllm.kernels.kv_store import to_cache
    from picovllm.model.layers.fp8 import FP8

    g = torch.Generator().manual_seed(4)
    tokens, heads, kv_heads, dim, blocks, bs = 5, 3, 1, 16, 4, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    qkv[:, heads * dim :] *= 100  # (keys and values over e4m3's range)
    qkv[0, -1] = -1000.0  # (a value past e4m3's range, of a stored token)
    qkv = qkv.to(dtype).to(DEV)
    q, k, v = qkv.view(tokens, heads + 2 * kv_heads, dim).split([heads, kv_heads, kv_heads], 1)
    angles = torch.rand(tokens, dim // 2, generator=g) * 50
    cos, sin = angles.cos().to(dtype).to(DEV), angles.sin().to(dtype).to(DEV)
    slots = torch.tensor([3, -1, 9, 0, 14]).to(DEV)
    pool, layers = allocate_kv_pool(2, blocks, bs, kv_heads, dim, FP8, DEV)
    (k_ref, v_ref), (k_out, v_out) = layers
    scales = (2.0, 0.25)  # (k_scale, v_scale)
    _close(
        rope_and_store_triton(q, k, v, cos, sin, k_out, v_out, slots, *scales),
        rope_and_store_ref(q, k, v, cos, sin, k_ref, v_ref, slots, *scales),
        dtype,
    )
    # keys rotated in fp32 on the GPU, in the dtype by the reference: within one step of e4m3 (1/8)
    torch.testing.assert_close(k_out.float(), k_ref.float(), rtol=0.13, atol=2**-9)
    _assert_new_kv_as_stored(q, k, v, cos, sin, k_out, v_out, slots, *scales)
    assert torch.equal(v_out.float(), v_ref.float())  # (values are stored as they come)
    assert v_ref.float().min() == -448.0  # (clamped)
    stored = to_cache(torch.tensor([1000.0, -1e9, 1.0]), k_ref, 0.5).float()
    assert torch.equal(stored, torch.tensor([448.0, -448.0, 2.0]))
    # the batch-1 QKV GEMV's epilogue
    x = torch.randn(1, 40, generator=g).to(dtype).to(DEV)
    w = (torch.randn((heads + 2 * kv_heads) * dim, 40, generator=g) * 30).to(dtype).to(DEV)
    norm_w = torch.ones(40).to(dtype).to(DEV)
    rope = (cos[:1], sin[:1])
    pool.zero_()
    q_ref = qkv_rope_store_ref(x, w, None, norm_w, 1e-6, *rope, k_ref, v_ref, slots[:1], heads, kv_heads, None, *scales)
    q_out = qkv_rope_store_triton(
        x, w, None, norm_w, 1e-6, *rope, k_out, v_out, slots[:1], heads, kv_heads, None, *scales
    )
    _close(q_out, q_ref, dtype)
    # (one step of e4m3, 1/8, where the GEMV's sums round to a neighbour of the reference's)
    torch.testing.assert_close(k_out.float(), k_ref.float(), rtol=0.13, atol=0)
    torch.testing.assert_close(v_out.float(), v_ref.float(), rtol=0.13, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    x = torch.randn(7, 200, dtype=torch.float32).to(dtype).to(DEV)[:, 3:99]  # 96 columns, row stride 200
    w = torch.randn(96).to(dtype).to(DEV)
    _close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    x = torch.randn(5, 2 * 100).to(dtype).to(DEV)
    _close(silu_mul_triton(x, block=64), silu_mul_ref(x), dtype)


def _paged_batch(dtype, q_lens, prefix_lens, block_size, heads=6, kv_heads=2, dim=24, seed=0, kv_dtype=None):
    """A batch whose sequences have cached prefixes in randomly placed blocks; returns the
    query and everything the attention kernels take. kv_dtype: the cache's, if not dtype."""
    g = torch.Generator().manual_seed(seed)
    ctx = [q + p for q, p in zip(q_lens, prefix_lens)]
    per_seq = [-(-c // block_size) for c in ctx]
    num_blocks = sum(per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(per_seq)
    tables = torch.zeros(len(ctx), width, dtype=torch.int32)
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    _, [(k_cache, v_cache)] = allocate_kv_pool(1, num_blocks, block_size, kv_heads, dim, kv_dtype or dtype, DEV)
    for cache in (k_cache, v_cache):  # (the model runner's layout: strided views)
        cache.copy_(torch.randn(cache.shape, generator=g))
    query = torch.randn(sum(q_lens), heads, dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + q_lens).cumsum(0)
    to = lambda t: t.to(DEV)  # noqa: E731
    return to(query), k_cache, v_cache, to(tables), to(torch.tensor(ctx)), to(qsl), dim**-0.5


def _take_new_kv(k_cache, v_cache, tables, ctx, qsl):
    """The batch's new keys and values laid end to end as the queries are (rope_and_store_triton's
    new_kv); the slots of the multi-query sequences' ones in the cache then hold NaN, so that the
    prefill kernel reading them there instead fails (single queries: also the decode kernel's)."""
    new_kv = [torch.zeros(int(qsl[-1]), *k_cache.shape[2:], dtype=k_cache.dtype, device=DEV) for _ in range(2)]
    block_size = k_cache.shape[1]
    for b in range(len(ctx)):
        q0, q1, c = int(qsl[b]), int(qsl[b + 1]), int(ctx[b])
        pos = torch.arange(c - (q1 - q0), c, device=DEV)
        blocks, offsets = tables[b, pos // block_size].long(), pos % block_size
        for cache, new in zip((k_cache, v_cache), new_kv):
            new[q0:q1] = cache[blocks, offsets]
            if q1 - q0 > 1:
                cache[blocks, offsets] = float("nan")
    return tuple(new_kv)


@MASKED_LANES
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_attention_with_cached_prefix(dtype, block_size):
    """Against the reference; and with this step's keys and values laid end to end (new_kv, read
    there: their slots in the cache are NaN then), the cached prefixes' through the table."""
    q_lens, prefix = [1, 5, 17, 33, 70], [0, 3, 16, 0, 9]
    query, kc, vc, tables, ctx, qsl, scale = _paged_batch(dtype, q_lens, prefix, block_size)
    plan = plan_paged_attention(tables, ctx, qsl, block_size, kc.shape[2], max(q_lens), int(ctx.max()))
    ref = paged_attention_ref(query, kc, vc, plan, scale)
    out = prefill_attention_triton(query, kc, vc, tables, ctx, qsl, scale, max(q_lens), block_m=32, block_n=32)
    _close(out, ref, dtype)
    new_kv = _take_new_kv(kc, vc, tables, ctx, qsl)  # (the step's keys start mid-tile and mid-block)
    out = prefill_attention_triton(
        query, kc, vc, tables, ctx, qsl, scale, max(q_lens), block_m=32, block_n=32, new_kv=new_kv
    )
    _close(out, ref, dtype)


@MASKED_LANES
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_split_k_over_long_prefixes(dtype):
    """Few queries over long cached prefixes, the keys split over programs (slices of at least
    2 key tiles, so short ranges stay in one split and are written directly) and merged; query
    blocks of one sequence see different numbers of splits, and some rows none of the last."""
    block_size = 16
    q_lens, prefix = [3, 40, 2, 17, 1], [300, 129, 0, 31, 250]
    query, kc, vc, tables, ctx, qsl, scale = _paged_batch(dtype, q_lens, prefix, block_size, seed=3)
    plan = plan_paged_attention(tables, ctx, qsl, block_size, kc.shape[2], max(q_lens), int(ctx.max()))
    ref = paged_attention_ref(query, kc, vc, plan, scale)
    assert prefill_splits(6, max(q_lens), 32) == 16  # what splits=None picks here: the most
    for splits in (1, 2, None):  # query blocks of 32 rows, merged 16 at a time
        out = prefill_attention_triton(
            query, kc, vc, tables, ctx, qsl, scale, max(q_lens), block_m=32, block_n=16, splits=splits
        )
        _close(out, ref, dtype)
    new_kv = _take_new_kv(kc, vc, tables, ctx, qsl)  # (a split across the prefix and the step's keys)
    out = prefill_attention_triton(
        query, kc, vc, tables, ctx, qsl, scale, max(q_lens), block_m=32, block_n=16, splits=2, new_kv=new_kv
    )
    _close(out, ref, dtype)


@MASKED_LANES
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_kernels_read_an_fp8_cache(dtype):
    """kv_cache_dtype="fp8": K and V in e4m3, read back in the queries' dtype by both attention
    kernels (prefill with cached prefixes, decode split over keys), against the reference on the
    same cache."""
    from picovllm.model.layers.fp8 import FP8

    q_lens, prefix = [1, 5, 17, 33], [0, 3, 40, 9]
    query, kc, vc, tables, ctx, qsl, scale = _paged_batch(dtype, q_lens, prefix, 16, seed=5, kv_dtype=FP8)
    assert kc.dtype == FP8 and kc.float().abs().max() > 0
    plan = plan_paged_attention(tables, ctx, qsl, 16, kc.shape[2], max(q_lens), int(ctx.max()))
    ref = paged_attention_ref(query, kc, vc, plan, scale)
    _close(
        prefill_attention_triton(query, kc, vc, tables, ctx, qsl, scale, max(q_lens), block_m=32, block_n=32),
        ref,
        dtype,
    )
    new_kv = _take_new_kv(kc, vc, tables, ctx, qsl)  # (e4m3, as the cache holds them)
    out = prefill_attention_triton(
        query, kc, vc, tables, ctx, qsl, scale, max(q_lens), block_m=32, block_n=32, new_kv=new_kv
    )
    _close(out, ref, dtype)
    prefix = [0, 14, 40, 300]
    query, kc, vc, tables, ctx, qsl, scale = _paged_batch(dtype, [1] * 4, prefix, 16, seed=6, kv_dtype=FP8)
    plan = plan_paged_attention(tables, ctx, qsl, 16, kc.shape[2], 1, int(ctx.max()))
    ref = paged_attention_ref(query, kc, vc, plan, scale)
    for splits in (1, None):
        _close(decode_attention_triton(query, kc, vc, tables, ctx, scale, splits), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_split_k(dtype):
    block_size = 16
    prefix = [0, 14, 15, 16, 40, 589]  # contexts of 1 to 590 keys
    query, kc, vc, tables, ctx, qsl, scale = _paged_batch(dtype, [1] * len(prefix), prefix, block_size, seed=1)
    plan = plan_paged_attention(tables, ctx, qsl, block_size, kc.shape[2], 1, int(ctx.max()))
    ref = paged_attention_ref(query, kc, vc, plan, scale)
    # one split, the default for this batch, and more splits than the short contexts have tiles
    for splits in (1, None, 32):
        _close(decode_attention_triton(query, kc, vc, tables, ctx, scale, splits), ref, dtype)
    # other key tiles than the engine's (a sweep's): a tile of a block, of four (the splits cut at its size)
    for block_n, splits in ((16, 1), (64, 4)):
        out = decode_attention_triton(query, kc, vc, tables, ctx, scale, splits, block_n=block_n, num_stages=2)
        _close(out, ref, dtype)


@MASKED_LANES
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_step_attention_decode_and_prefill_kernels_share_the_output(dtype):
    """A mixed step: single-query sequences (decodes, short and long contexts) through the
    decode kernel, the others through the prefill kernel (which skips them), into one output."""
    block_size = 4
    q_lens, prefix = [1, 5, 1, 17, 1, 3], [0, 3, 40, 16, 201, 9]
    query, kc, vc, tables, ctx, qsl, scale = _paged_batch(dtype, q_lens, prefix, block_size, seed=2)
    plan = plan_paged_attention(tables, ctx, qsl, block_size, kc.shape[2], max(q_lens), int(ctx.max()))
    ref = paged_attention_ref(query, kc, vc, plan, scale)
    # one split; the default (8 splits of at least 128 keys: 2 used for 202 keys); 8 of at least 64 (4 used)
    for splits, min_keys in ((1, None), (None, None), (None, 64)):
        out = torch.full_like(query, float("nan"))
        decode_attention_triton(
            query, kc, vc, tables, ctx, scale, splits, query_start_loc=qsl, out=out, min_keys=min_keys
        )
        single_rows = qsl[:-1][torch.tensor(q_lens, device=DEV) == 1]
        assert not out[single_rows].isnan().any() and out.isnan().sum() > 0  # its rows, and only those
        prefill_attention_triton(
            query, kc, vc, tables, ctx, qsl, scale, max(q_lens), block_m=16, block_n=16, out=out, skip_single=True
        )
        _close(out, ref, dtype)
    new_kv = _take_new_kv(kc, vc, tables, ctx, qsl)  # (as the engine runs a mixed step on the GPU)
    out = torch.full_like(query, float("nan"))
    decode_attention_triton(query, kc, vc, tables, ctx, scale, query_start_loc=qsl, out=out)
    prefill_attention_triton(
        query,
        kc,
        vc,
        tables,
        ctx,
        qsl,
        scale,
        max(q_lens),
        block_m=16,
        block_n=16,
        out=out,
        skip_single=True,
        new_kv=new_kv,
    )
    _close(out, ref, dtype)


def _attend_each(query, kc, vc, tables, ctx, qsl, block_size, scale):
    """Each sequence's causal attention over its own keys, one at a time: [(rows, output)]."""
    outs = []
    for b, c in enumerate(ctx.tolist()):
        q_len = int(qsl[b + 1] - qsl[b])
        slots = (
            tables[b].long().repeat_interleave(block_size)[:c] * block_size + torch.arange(c, device=DEV) % block_size
        )
        group = query.shape[1] // kc.shape[2]
        keys, values = (cache.flatten(0, 1)[slots].repeat_interleave(group, 1).transpose(0, 1) for cache in (kc, vc))
        q = query[qsl[b] : qsl[b] + q_len].transpose(0, 1)
        causal = torch.arange(c, device=DEV) <= torch.arange(c - q_len, c, device=DEV)[:, None]
        weights = (q @ keys.transpose(1, 2) * scale).masked_fill(~causal, float("-inf")).softmax(-1)
        outs.append((slice(int(qsl[b]), int(qsl[b]) + q_len), (weights @ values).transpose(0, 1)))
    return outs


def test_reference_attention_pads_decodes_apart_from_prompts():
    """The reference (the CPU's attention) of a mixed step: the single-query sequences are one
    group and the prompts another, so a decode computes one query, not as many as the longest
    prompt chunk; each sequence's output equals its own causal attention over its own keys, and
    padding tokens after the batch come out as zeros. A lone prompt without a cached prefix takes
    SDPA's causal attention, no mask; one with a prefix keeps its mask."""
    q_lens, prefix = [1, 5, 1, 17, 1, 3], [0, 3, 40, 16, 201, 9]
    query, kc, vc, tables, ctx, qsl, scale = _paged_batch(torch.float32, q_lens, prefix, 4, seed=7)
    query = torch.cat([query, torch.ones_like(query[:2])])  # (two padding tokens)
    plan = plan_paged_attention(tables, ctx, qsl, 4, kc.shape[2], max(q_lens), int(ctx.max()))
    shapes = [(tuple(g.rows.shape), g.max_context) for g in plan.groups]
    assert shapes == [((3, 1), 202), ((3, 17), 33)]  # (one group: 6 x 17 queries over 202 keys each)
    out = paged_attention_ref(query, kc, vc, plan, scale)
    assert out[-2:].eq(0).all()
    for rows, want in _attend_each(query, kc, vc, tables, ctx, qsl, 4, scale):
        torch.testing.assert_close(out[rows], want)
    assert len(plan_paged_attention(tables[:1], ctx[:1], qsl[:2], 4, kc.shape[2], 1, 1).groups) == 1  # (decode only)
    for prefix, masked in ((0, False), (6, True)):
        query, kc, vc, tables, ctx, qsl, scale = _paged_batch(torch.float32, [37], [prefix], 4, seed=8)
        plan = plan_paged_attention(tables, ctx, qsl, 4, kc.shape[2], 37, 37 + prefix)
        assert len(plan.groups) == 1 and (plan.groups[0].mask is not None) == masked
        [(rows, want)] = _attend_each(query, kc, vc, tables, ctx, qsl, 4, scale)
        torch.testing.assert_close(paged_attention_ref(query, kc, vc, plan, scale), want)


def test_prefill_splits_fill_the_gpu_within_the_program_cap():
    """Qwen2.5-1.5B's 12 heads, query blocks of 64: the mixed-step graphs (T tokens, T/64 + 8
    work items) split more the fewer their tokens; eager steps by their real work items."""
    graphs = {t: prefill_splits(12, t, 64, -(-t // 64) + 8) for t in (16, 32, 64, 128, 256, 512)}
    assert graphs == {16: 16, 32: 16, 64: 16, 128: 16, 256: 8, 512: 4}
    assert prefill_splits(12, 40, 64, 1) == 16 and prefill_splits(12, 2123, 64, 34) == 1
    assert prefill_splits(12, 512, 64, 512) == 2 and prefill_splits(12, 512, 64, 1600) == 1


def test_prefill_work_lists_query_blocks_of_multi_query_sequences():
    from picovllm.kernels.prefill_attention import num_work_items, prefill_work

    lens = np.array([1, 5, 130, 0, 64, 65])
    items = [(1, 0), (2, 0), (2, 1), (2, 2), (4, 0), (5, 0), (5, 1)]  # (sequence, query block)
    assert prefill_work(lens, 64).tolist() == [b << 16 | m for b, m in items] and num_work_items(lens, 64) == 7
    assert prefill_work(lens, 64, capacity=9).tolist()[7:] == [-1, -1]
    assert prefill_work(lens, 64, include_single=True).tolist()[0] == 0
    assert prefill_work(np.array([1, 1]), 64).tolist() == [] and num_work_items(np.array([1, 1])) == 0


@MASKED_LANES
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_padded_work_list(dtype):
    """A work list padded with -1 (as CUDA graphs hold it) and given out of order computes the
    same rows; rows of sequences it leaves out are not written."""
    from picovllm.kernels.prefill_attention import prefill_work

    q_lens, prefix = [3, 40, 1, 17], [30, 9, 20, 0]
    query, kc, vc, tables, ctx, qsl, scale = _paged_batch(dtype, q_lens, prefix, 16, seed=4)
    plan = plan_paged_attention(tables, ctx, qsl, 16, kc.shape[2], max(q_lens), int(ctx.max()))
    ref = paged_attention_ref(query, kc, vc, plan, scale)
    work = prefill_work(q_lens, 32, capacity=8)[[4, 0, 5, 1, 6, 2, 7, 3]]
    out = torch.full_like(query, float("nan"))
    prefill_attention_triton(
        query,
        kc,
        vc,
        tables,
        ctx,
        qsl,
        scale,
        max(q_lens),
        block_m=32,
        block_n=16,
        out=out,
        work=torch.from_numpy(work).to(DEV),
    )
    single = int(qsl[2])
    assert out[single].isnan().all()
    rows = [r for r in range(query.shape[0]) if r != single]
    _close(out[rows], ref[rows], dtype)


def test_decode_splits_fill_the_gpu_and_depend_on_the_batch_only():
    assert [num_splits(b, 2) for b in (1, 2, 8, 64, 128, 256)] == [32, 32, 32, 4, 2, 1]
    assert num_splits(1, 8) == 32 and num_splits(4, 8) == 16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("before", [None, "norm", "silu_mul"])
def test_per_token_fp8(dtype, before):
    """Activations to e4m3 with a scale per row (kernels/fp8_gemm.py): each row's scale is its
    largest magnitude over e4m3's largest (an all-zero row's the floor), its values x / scale
    rounded to nearest even, as the reference's. norm: the row's RMSNorm first, silu_mul: SiLU of
    a gate_up row's first half times its second; in the same kernel, bit for bit the norm's (or
    SiLU*mul's) kernel's output quantized. (In the interpreter with tests/conftest.py's repair of
    its fp8 rounding.)"""
    from picovllm.kernels.fp8_gemm import MIN_SCALE, per_token_fp8_ref, per_token_fp8_triton
    from picovllm.model.layers.fp8 import FP8

    g = torch.Generator().manual_seed(3)
    rows, k = 6, 1000
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 2, rows)[:, None]
    x[2] = 0.0
    x = x.to(dtype).to(DEV)
    if before == "norm":
        norm_weight = (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEV)
        q, scale = per_token_fp8_triton(x, norm_weight, 1e-6)
        q_ref, scale_ref = per_token_fp8_ref(rms_norm_triton(x, norm_weight, 1e-6))
    elif before == "silu_mul":
        gate_up = torch.cat([torch.randn(rows, k, generator=g).to(dtype).to(DEV), x], dim=1)
        q, scale = per_token_fp8_triton(gate_up, silu_mul=True)
        q_ref, scale_ref = per_token_fp8_ref(silu_mul_triton(gate_up))
    else:
        q, scale = per_token_fp8_triton(x)
        q_ref, scale_ref = per_token_fp8_ref(x)
    assert q.dtype == FP8 and scale.shape == (rows, 1)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    assert scale[2].item() == torch.tensor(MIN_SCALE).item() and not q[2].float().any()
    assert torch.equal(q.float(), q_ref.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion", ["plain", "bias", "residual"])
@pytest.mark.parametrize("m", [37, 265] if DEV == "cuda" else [37])
@pytest.mark.parametrize("loads", ["pointers", "split", "tma", "tma-unaligned"])
def test_fp8_gemm(dtype, fusion, m, loads):
    """An FP8 weight at more rows (kernels/fp8_gemm.py): e4m3 activations with a scale per token,
    tokens of a tile's awkward share (M = 37 in 16-row tiles, and 265 on the GPU, where an engine
    step of 265 tokens once went wrong; N and K not multiples of the tiles), against the reference;
    tokens and rows of very different magnitudes, so that a scale applied to the wrong one shows.
    split: K shared by three programs a tile (the last with less than the others), the last to arrive
    adding them up; run twice, so that the tiles' counters are shown back at zero for the next call.
    tma: the tiles read through TMA descriptors, which read zeros past the matrices' ends;
    tma-unaligned: rows TMA cannot read (300 bytes, not a multiple of 16), read by the threads instead."""
    from picovllm.kernels.fp8_gemm import fp8_gemm_ref, fp8_gemm_triton, per_token_fp8_ref
    from picovllm.model.layers.fp8 import quantize_fp8

    g = torch.Generator().manual_seed(11)
    n, k = 70, 336 if loads == "tma" else 300  # (TMA: rows of a multiple of 16 bytes)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]).to(dtype).to(DEV)
    w = torch.randn(n, k, generator=g) / k**0.5 * torch.logspace(-2, 1, n)[torch.randperm(n, generator=g), None]
    wq, w_scale = quantize_fp8(w.to(dtype).to(DEV))
    a, a_scale = per_token_fp8_ref(x)
    bias = torch.randn(n, generator=g).to(dtype).to(DEV) if fusion == "bias" else None
    residual = torch.randn(m, n, generator=g).to(dtype).to(DEV) if fusion == "residual" else None
    expect = fp8_gemm_ref(a, a_scale, wq, w_scale, bias, residual, dtype)
    config = dict(
        BLOCK_M=16,
        BLOCK_N=32,
        BLOCK_K=64,
        num_warps=4,
        SPLIT_K=3 if loads == "split" else 1,
        TMA=loads.startswith("tma"),
    )
    for _ in range(2):
        got = fp8_gemm_triton(a, a_scale, wq, w_scale, bias, residual, dtype, config=config)
        assert got.shape == (m, n) and got.dtype == dtype
        torch.testing.assert_close(
            got.float(), expect.float(), atol=TOL[dtype] * expect.abs().max().item(), rtol=TOL[dtype]
        )


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
@pytest.mark.parametrize("fusion", ["plain", "bias", "residual"])
@pytest.mark.parametrize("m", [2, 37, 64])
@pytest.mark.parametrize("deep", [False, True])
def test_gemm_of_a_bf16_or_fp16_weight(dtype, fusion, m, deep):
    """A bf16 or fp16 layer's GEMM at 2-64 tokens (kernels/gemm.py) at gemm_config's tiles: N and K
    not multiples of them; deep, a weight at least four times deeper than it has rows, its K split
    over three programs a tile (run twice: the tiles' counters back at zero for the next call);
    against F.linear in fp32 rounded as the unfused ops round (the output, then the residual sum)."""
    from picovllm.kernels.gemm import gemm_config, gemm_triton

    g = torch.Generator().manual_seed(12)
    n, k = (40, 300) if deep else (80, 300)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEV)
    bias = torch.randn(n, generator=g).to(dtype).to(DEV) if fusion == "bias" else None
    residual = torch.randn(m, n, generator=g).to(dtype).to(DEV) if fusion == "residual" else None
    expect = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float()).to(dtype)
    if residual is not None:
        expect = (residual.float() + expect.float()).to(dtype)
    assert gemm_config(m, n, k).get("SPLIT_K", 1) == (4 if deep else 1)
    for _ in range(2):
        got = gemm_triton(x, w, bias, residual, dtype)
        assert got.shape == (m, n) and got.dtype == dtype
        _close(got, expect, dtype)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [2, 37])
def test_gemm_with_silu_mul_in_its_epilogue(dtype, m, bias):
    """A fused gate_up weight's GEMM with SiLU*mul of its two halves in the epilogue (the gate's
    rows, then the up's; N not a multiple of the tiles, a bias of 2N): the unfused GEMM's output,
    then silu_mul_ref, as they round."""
    from picovllm.kernels.gemm import gemm_triton
    from picovllm.kernels.silu_mul import silu_mul_ref

    g = torch.Generator().manual_seed(13)
    n, k = 72, 300
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(2 * n, k, generator=g) / k**0.5).to(dtype).to(DEV)
    b = torch.randn(2 * n, generator=g).to(dtype).to(DEV) if bias else None
    gate_up = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    got = gemm_triton(x, w, b, None, dtype, silu_mul=True)
    assert got.shape == (m, n) and got.dtype == dtype
    _close(got, silu_mul_ref(gate_up), dtype)


def test_linear_streams_a_bf16_or_fp16_layer_at_2_to_64_rows(monkeypatch):
    """linear() takes kernels/gemm.py's GEMM for 2-64 rows of a half-precision layer (fp16 in the
    interpreter, bf16 too on Hopper), not for one row (the GEMV's), 65 or more, fp32, or a weight
    as wide as a vocabulary (the LM head's, on cuBLAS); the bias and residual in its epilogue, the
    same values as the unfused ops'."""
    from picovllm.kernels import gemm, triton_utils
    from picovllm.model.layers import linear as linear_module

    if DEV == "cpu":
        monkeypatch.setattr(triton_utils, "ON_CPU", True)
    dtype = torch.float16
    w = torch.randn(48, 64, dtype=dtype, device=DEV) / 8
    x = torch.randn(65, 64, dtype=dtype, device=DEV)
    assert [gemm.streams(x[:r], w) for r in (1, 2, 64, 65)] == [False, True, True, False]
    assert not gemm.streams(x[:8].float(), w.float())
    assert not gemm.streams(x[:8], torch.empty(gemm.MAX_WEIGHT_ROWS + 1, 64, dtype=dtype, device=DEV))
    calls = []
    monkeypatch.setattr(linear_module, "gemm_triton", lambda *a: calls.append(1) or gemm.gemm_triton(*a))
    bias, residual = torch.randn(48, dtype=dtype, device=DEV), torch.randn(8, 48, dtype=dtype, device=DEV)
    y = torch.nn.functional.linear(x[:8].float(), w.float(), bias.float()).to(dtype)
    _close(
        linear_module.linear(x[:8], w, bias, residual=residual.clone()), (residual.float() + y.float()).to(dtype), dtype
    )
    assert calls == [1]


def test_one_row_of_a_deep_or_wide_fp8_weight_takes_the_gemm(monkeypatch):
    """At one row linear() runs the GEMV, but for an FP8 weight at least four times deeper than it
    has rows (the down projection), whose K the GEMM splits over programs, or with at least four
    times as many rows as it is deep (a fused gate_up): those take fp8_linear (the row quantized,
    then the GEMM), the same values."""
    from picovllm.kernels import fp8_gemm, gemv, triton_utils
    from picovllm.model.layers import linear as linear_module
    from picovllm.model.layers.fp8 import quantize_fp8

    if DEV == "cpu":
        monkeypatch.setattr(triton_utils, "ON_CPU", True)
    g = torch.Generator().manual_seed(14)
    dtype = torch.float16 if DEV == "cpu" else torch.bfloat16
    calls = []
    monkeypatch.setattr(
        linear_module, "gemv_triton", lambda *a, **kw: calls.append("gemv") or gemv.gemv_triton(*a, **kw)
    )
    monkeypatch.setattr(linear_module, "fp8_linear", lambda *a: calls.append("gemm") or fp8_gemm.fp8_linear(*a))
    for n, k in ((48, 64), (16, 64), (256, 64)):  # (neither, deep, wide)
        x = torch.randn(1, k, generator=g).to(dtype).to(DEV)
        wq, w_scale = quantize_fp8((torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEV))
        residual = torch.randn(1, n, generator=g).to(dtype).to(DEV)
        expect = fp8_gemm.fp8_gemm_ref(*fp8_gemm.per_token_fp8_ref(x), wq, w_scale, None, residual, dtype)
        got = linear_module.linear(x, wq, weight_scale=w_scale, residual=residual.clone())
        torch.testing.assert_close(got.float(), expect.float(), atol=2e-2 * expect.abs().max().item(), rtol=2e-2)
    assert calls == ["gemv", "gemm", "gemm"]


@pytest.mark.skipif(DEV != "cuda", reason="cuBLAS's FP8 GEMM: the GPU's")
@pytest.mark.parametrize("rows", [9, 300])
def test_fp8_linear_on_both_gemms(rows):
    """fp8_linear in bf16 at decode's rows (our GEMM) and a prompt's (cuBLAS's torch._scaled_mm):
    the same as the reference on the activations quantized per token, bias and residual added."""
    from picovllm.kernels.fp8_gemm import fp8_gemm_ref, fp8_linear, per_token_fp8_ref
    from picovllm.model.layers.fp8 import quantize_fp8

    g = torch.Generator().manual_seed(12)
    dtype, n, k = torch.bfloat16, 256, 512
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEV)
    wq, w_scale = quantize_fp8((torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEV))
    bias, residual = torch.randn(n, generator=g).to(dtype).to(DEV), torch.randn(rows, n, generator=g).to(dtype).to(DEV)
    expect = fp8_gemm_ref(*per_token_fp8_ref(x), wq, w_scale, bias, residual, dtype)
    got = fp8_linear(x, wq, w_scale, bias, residual.clone())
    torch.testing.assert_close(got.float(), expect.float(), atol=2e-2 * expect.abs().max().item(), rtol=2e-2)


@pytest.mark.skipif(DEV == "cuda", reason="on a GPU every kernel runs for real (and this takes 100 s there)")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_hopper(dtype):
    """Every kernel compiles ahead of time for sm_90 (no GPU needed), which catches what the
    interpreter does not: types, layouts, unsupported operations, and 64-bit divisions. Runs in a subprocess because
    the interpreter, once on, replaces every @triton.jit function."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))  # this checkout's package
    script = os.path.join(os.path.dirname(__file__), "compile_kernels.py")
    # (a hang's bound: from a cold Triton cache on a busy 2-core machine fp32's took 230 s, and 300 failed once)
    done = subprocess.run([sys.executable, script, dtype], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert {line[1] for line in lines} == _all_kernels()
    # no 64-bit integer division in any kernel (a call per use on the GPU: the attention kernels'
    # key loops had eleven while the cache's block size was a runtime argument)
    assert [line for line in lines if len(line) > 2] == []


def _all_kernels() -> set[str]:
    """Names of every @triton.jit kernel (a launched `_..._kernel`) in picovllm.kernels."""
    import pkgutil
    import re

    import picovllm.kernels as pkg

    names = set()
    for mod in pkgutil.iter_modules(pkg.__path__):
        with open(os.path.join(pkg.__path__[0], mod.name + ".py")) as f:
            names |= set(re.findall(r"@triton\.jit(?:\(.*\))?(?:  #.*)?\ndef (_\w+_kernel)\(", f.read()))
    return names


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("fusion", ["plain", "norm+bias", "residual", "norm+silu_mul"])
def test_gemv_with_fused_norm_bias_activation_residual(dtype, rows, fusion):
    """Odd N and K (tiles cross both edges), a strided input, each fusion the model uses; the
    tiles given here, then the default tiles."""
    g = torch.Generator().manual_seed(rows)
    n, k = 75, 200
    x = (torch.randn(rows, 2 * k, generator=g) * 3).to(dtype).to(DEV)[:, ::2]  # column stride 2
    w = (torch.randn(2 * n if fusion == "norm+silu_mul" else n, k, generator=g) / k**0.5).to(dtype).to(DEV)
    kwargs = {}
    if "norm" in fusion:
        kwargs.update(norm_weight=(1 + torch.rand(k, generator=g)).to(dtype).to(DEV), eps=1e-6)
    if "bias" in fusion:
        kwargs["bias"] = torch.randn(n, generator=g).to(dtype).to(DEV)
    if fusion == "residual":
        kwargs["residual"] = torch.randn(rows, n, generator=g).to(dtype).to(DEV)
    if fusion == "norm+silu_mul":
        kwargs["silu_mul"] = True
    ref = fused_linear_ref(x, w, **kwargs)
    out = gemv_triton(x, w, **kwargs, config=dict(BLOCK_M=next_pow2(rows), BLOCK_N=16, BLOCK_K=64))
    assert out.shape == (rows, n)
    _close(out, ref, dtype)
    _close(gemv_triton(x, w, **kwargs), ref, dtype)  # the default tiles
    _close(
        gemv_triton(x, w, **kwargs, config=dict(BLOCK_M=next_pow2(rows), BLOCK_N=16, BLOCK_K=256)), ref, dtype
    )  # K in one tile


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_qkv_gemv_with_rope_and_kv_store(dtype, rows, bias):
    """The QKV projection with the norm, RoPE and the KV store fused: queries rotated, keys rotated
    and stored, values stored as projected, a padding slot (-1) storing nothing; odd head counts and
    a head dim whose pairs cross the programs' tiles; the tiles given here (K in four tiles), then
    the defaults (K in one)."""
    g = torch.Generator().manual_seed(rows)
    heads, kv_heads, dim, k, blocks, bs = 5, 3, 24, 200, 4, 4
    x = (torch.randn(rows, k, generator=g) * 3).to(dtype).to(DEV)
    w = (torch.randn((heads + 2 * kv_heads) * dim, k, generator=g) / k**0.5).to(dtype).to(DEV)
    b = torch.randn(w.shape[0], generator=g).to(dtype).to(DEV) if bias else None
    norm_w = (1 + torch.rand(k, generator=g)).to(dtype).to(DEV)
    angles = torch.rand(rows, dim // 2, generator=g) * 50
    cos, sin = angles.cos().to(dtype).to(DEV), angles.sin().to(dtype).to(DEV)
    slots = torch.randperm(blocks * bs, generator=g)[:rows]
    slots[rows // 2] = -1  # a padding token
    slots = slots.to(DEV)
    for config in (dict(BLOCK_M=next_pow2(rows), BLOCK_N=16, BLOCK_K=64), None):
        _, layers = allocate_kv_pool(2, blocks, bs, kv_heads, dim, dtype, DEV)
        (k_ref, v_ref), (k_out, v_out) = layers
        args = (b, norm_w, 1e-6, cos, sin)
        q_ref = qkv_rope_store_ref(x, w, *args, k_ref, v_ref, slots, heads, kv_heads)
        q_out = qkv_rope_store_triton(x, w, *args, k_out, v_out, slots, heads, kv_heads, config=config)
        assert q_out.shape == (rows, heads, dim)
        _close(q_out, q_ref, dtype)
        _close(k_out, k_ref, dtype)
        _close(v_out, v_ref, dtype)
        assert (k_ref.abs().sum((2, 3)) > 0).sum().item() == rows - 1  # (the padding row stored nothing)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion", ["plain", "norm+bias", "residual", "norm+silu_mul", "qkv+rope"])
def test_gemv_reads_fp8_weights_and_scales_its_rows(dtype, fusion):
    """An FP8 weight (model/layers/fp8.py) at one row: the GEMV reads the e4m3 bytes and scales
    each row's sum, against the reference that dequantizes first; rows of very different
    magnitudes, so that a scale applied to the wrong row shows."""
    from picovllm.model.layers.fp8 import FP8, quantize_fp8

    g = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, k = 3, 1, 16, 200
    n = (heads + 2 * kv_heads) * dim if fusion == "qkv+rope" else 2 * 75 if fusion == "norm+silu_mul" else 75
    x = torch.randn(1, k, generator=g).to(dtype).to(DEV)
    w = torch.randn(n, k, generator=g) / k**0.5 * torch.logspace(-2, 1, n)[torch.randperm(n, generator=g), None]
    wq, scale = quantize_fp8(w.to(dtype).to(DEV))
    assert wq.dtype == FP8
    kwargs = dict(weight_scale=scale)
    if "norm" in fusion or fusion == "qkv+rope":
        kwargs.update(norm_weight=(1 + torch.rand(k, generator=g)).to(dtype).to(DEV), eps=1e-6)
    if "bias" in fusion or fusion == "qkv+rope":
        kwargs["bias"] = torch.randn(n, generator=g).to(dtype).to(DEV)
    if fusion == "residual":
        kwargs["residual"] = torch.randn(1, n, generator=g).to(dtype).to(DEV)
    if fusion == "norm+silu_mul":
        kwargs["silu_mul"] = True

    def close(a, b):  # (the reference rounds the dequantized weight to dtype, the GEMV does not: a
        # tolerance relative to the outputs' size)
        torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype] * b.abs().max().item(), rtol=TOL[dtype])

    if fusion != "qkv+rope":
        close(gemv_triton(x, wq, **kwargs), fused_linear_ref(x, wq, **kwargs))
        return
    angles = torch.rand(1, dim // 2, generator=g) * 50
    rope = (
        angles.cos().to(dtype).to(DEV),
        angles.sin().to(dtype).to(DEV),
        *allocate_kv_pool(2, 2, 4, 1, dim, dtype, DEV)[1],
    )
    slots = torch.tensor([5]).to(DEV)
    (k_ref, v_ref), (k_out, v_out) = rope[2:]
    args = (kwargs["bias"], kwargs["norm_weight"], 1e-6, *rope[:2])
    q_ref = qkv_rope_store_ref(x, wq, *args, k_ref, v_ref, slots, heads, kv_heads, weight_scale=scale)
    q_out = qkv_rope_store_triton(x, wq, *args, k_out, v_out, slots, heads, kv_heads, weight_scale=scale)
    close(q_out, q_ref)
    close(k_out, k_ref)
    close(v_out, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_reads_every_e4m3_value(dtype):
    """The FP8 GEMV converts the weight's bytes in registers: every finite e4m3 value, subnormals and
    both zeros included, at every position of a row, against the values as torch converts them.
    The input is e4m3 values already (its largest 448), so that its quantization leaves it as it
    is and the sums are of exact products; the weight's scale a power of two."""
    from picovllm.model.layers.fp8 import FP8

    g = torch.Generator().manual_seed(3)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F] + [0, 0x80], dtype=torch.uint8)
    rows = torch.stack([finite[torch.randperm(256, generator=g)] for _ in range(24)])
    w = rows.view(FP8).to(DEV)
    x = finite[torch.randperm(256, generator=g)].view(FP8).float()
    x[0] = 448.0
    x = x[None].to(dtype).to(DEV)
    scale = torch.full((24,), 2.0**-12, device=DEV)  # (fp16's outputs in range)
    expect = x.double() @ w.double().t() * 2.0**-12
    got = gemv_triton(x, w, weight_scale=scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expect, atol=TOL[dtype] * expect.abs().max().item(), rtol=TOL[dtype])


@pytest.fixture(scope="module")
def two_layer_qwen(tmp_path_factory) -> str:
    """tiny_qwen's shapes in two layers, not three (the interpreter takes seconds a layer a step)."""
    from tiny_models import build_model

    path = str(tmp_path_factory.mktemp("two_layer_qwen"))
    build_model(path, "qwen2", layers=2, tokenizer=False)
    return path


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_engine_triton_path_equals_reference_path_in_the_interpreter(two_layer_qwen, monkeypatch, quantization):
    """The whole engine on the Triton path, on CPU tensors in Triton's interpreter: chunked
    prompts mixed with decodes (a 32-token budget), so mixed steps send single-query sequences
    to the decode kernel and the prefill kernel takes work lists; the fused GEMV at one row.
    Greedy tokens equal the PyTorch reference path's (fp32). fp8: FP8 weights, the GEMV on e4m3 at one row and
    the FP8 GEMM past it, its input normed and quantized in one kernel, the down projection's
    input also SiLU*mul'd there from 17 rows (the engine's threshold lowered) and at one row, where
    the gate_up weight counts as wide from twice as many rows as it is deep (four times in the
    engine) and so takes the GEMM. On a GPU,
    tests/test_cuda.py compares the two at Qwen2.5-1.5B's shapes."""
    from conftest import TEST_DEVICE, make_llm

    from picovllm import SamplingParams
    from picovllm.kernels import fp8_gemm, triton_utils
    from picovllm.model.layers import linear as linear_module

    if TEST_DEVICE != "cpu":
        pytest.skip("the interpreter runs on CPU tensors")
    prompts = [{"prompt_token_ids": list(range(10 + i, 10 + i + n))} for i, n in enumerate([5, 37, 2, 20])]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 4, 2, 6)]

    def greedy():
        llm = make_llm(
            two_layer_qwen,
            skip_tokenizer_init=True,
            max_num_batched_tokens=32,
            max_num_seqs=4,
            quantization=quantization,
        )
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    reference = greedy()
    assert [len(t) for t in reference] == [3, 4, 2, 6]
    monkeypatch.setattr(triton_utils, "ON_CPU", True)
    monkeypatch.setattr(fp8_gemm, "SILU_MUL_FUSED_MIN_ROWS", 17)
    monkeypatch.setattr(linear_module, "wide", lambda n, k: n >= 2 * k)  # (tiny_qwen's gate_up: 160 x 64)
    assert greedy() == reference


SAMPLING_CASES = {  # (top_k, top_p, min_p) a row; None: not asked of the batch
    "top_k": ([1, 5, 20, 20, 3, 7], None, None),
    "top_p": (None, [0.1, 0.5, 0.8, 0.95, 1.0, 0.3], None),
    "top_k and top_p": ([1, 5, 20, 20, 3, 7], [0.1, 0.5, 0.8, 0.95, 1.0, 0.3], None),
    "top_k off on a row": ([300, 5, 20, 300, 3, 7], [0.1, 0.5, 0.8, 0.95, 1.0, 0.3], None),
    "min_p": (None, None, [0.0, 0.1, 0.5, 0.9, 0.01, 0.3]),
    "all three": ([1, 5, 20, 20, 3, 7], [0.1, 0.5, 0.8, 0.95, 1.0, 0.3], [0.0, 0.1, 0.5, 0.9, 0.01, 0.3]),
}


def _sampling_case(name: str):
    """Six rows of 300 logits on a coarse grid (many ties, the k-th's included, as bf16 logits
    have), one row with only 3 tokens left by a mask; temperatures that divide exactly."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(6, 300, generator=g) * 12).round() / 4
    logits[4, 3:] = float("-inf")
    top_k, top_p, min_p = (None if v is None else torch.tensor(v) for v in SAMPLING_CASES[name])
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.5, 2.0])
    max_top_k = None if top_k is None else int(top_k.max())
    return logits, temperature, top_k, top_p, min_p, max_top_k


@pytest.mark.parametrize("name", list(SAMPLING_CASES))
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # (log 0 = -inf: min_p 0)
def test_sampling_thresholds_keep_the_references_tokens(name):
    """Each row's threshold keeps exactly the tokens the reference's masks keep: ties with the
    k-th (beyond the largest values too), top_p over top_k's survivors, min_p before both."""
    from picovllm.kernels.sampling import apply_min_p, apply_top_k_top_p, thresholds_triton

    logits, temperature, top_k, top_p, min_p, max_top_k = _sampling_case(name)
    x = logits / temperature[:, None]
    if min_p is not None:
        x = apply_min_p(x, min_p)
    expect = apply_top_k_top_p(x, top_k, top_p, max_top_k) > float("-inf")
    thresholds = thresholds_triton(
        logits.to(DEV),
        temperature.to(DEV),
        *(None if v is None else v.to(DEV) for v in (top_k, top_p, min_p)),
        max_top_k,
        chunk=64,
    )
    kept = (logits.to(DEV) >= thresholds[:, None]).cpu()
    assert torch.equal(kept, expect), (kept.sum(1), expect.sum(1))
    if top_k is not None:
        assert expect.sum(1).tolist() != [min(k, 300) for k in top_k.tolist()]  # (ties beyond the k-th kept)


def test_sampling_draws_follow_the_kept_distribution():
    """800 rows of one row's logits (top_k 3 at temperature 0.7): each token's share is its
    probability renormalised over the tokens kept; a seeded row draws the same token whatever row
    it is in. (Few rows: the interpreter runs each program apart.)"""
    from picovllm.kernels.sampling import apply_top_k_top_p, sample_triton

    rows, vocab = 800, 20
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(1, vocab, generator=g) * 2).repeat(rows, 1)
    temperature, top_k = torch.full((rows,), 0.7), torch.full((rows,), 3)
    torch.manual_seed(0)
    out = sample_triton(logits.to(DEV), temperature.to(DEV), top_k.to(DEV), None, None, 3, [None] * rows).cpu()
    expect = apply_top_k_top_p(logits[:1] / 0.7, top_k[:1], None, 3).softmax(-1)[0]
    assert sorted(expect.tolist())[-3] > 0.1 and int((expect > 0).sum()) == 3
    torch.testing.assert_close(torch.bincount(out, minlength=vocab) / rows, expect, atol=0.05, rtol=0)

    def seeded(row: int) -> int:
        gens = [None] * 8
        gens[row] = torch.Generator(device=DEV).manual_seed(7)
        return int(sample_triton(logits[:8].to(DEV), temperature[:8].to(DEV), None, None, None, None, gens)[row])

    assert seeded(0) == seeded(5)


def test_sampling_draws_under_a_bitmask_follow_the_allowed_distribution():
    """800 rows of one row's logits under one bitmask (5 of 40 tokens allowed, across two int32
    words), the bf16 logits read as they are: each allowed token's share is its probability
    renormalised over the allowed; every greedy row (one in four) takes the allowed argmax."""
    from picovllm.kernels.sampling import sample_triton

    rows, vocab, allowed = 800, 40, [1, 4, 6, 31, 33]
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16).repeat(rows, 1)
    bitmask = torch.tensor([[sum(1 << j for j in allowed if j < 32) - 2**32, 1 << 1]], dtype=torch.int32)
    greedy = torch.arange(rows) % 4 == 0
    torch.manual_seed(0)
    out = sample_triton(
        logits.to(DEV),
        torch.full((rows,), 0.7, device=DEV),
        None,
        None,
        None,
        None,
        [None] * rows,
        greedy.to(DEV),
        bitmask.repeat(rows, 1).to(DEV),
    ).cpu()
    expect = torch.full((vocab,), float("-inf"))
    expect[allowed] = logits[0, allowed].float() / 0.7
    expect = expect.softmax(-1)
    assert (out[greedy] == int(expect.argmax())).all() and int(out[greedy][0]) in allowed
    shares = torch.bincount(out[~greedy], minlength=vocab) / int((~greedy).sum())
    assert sorted(expect.tolist())[-4] > 0.09 and int(logits[0].argmax()) not in allowed
    torch.testing.assert_close(shares, expect, atol=0.07, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_fp32_copy_equals_the_reference(dtype):
    """A grammar's bitmask applied to an fp32 copy of the logits in one pass (kernels/sampling.py's
    masked_fp32): exactly apply_bitmask's on the fp32 values, rows of a strided view, a vocabulary
    that ends inside a bitmask word and a chunk; the logits left as they were."""
    from picovllm.kernels.sampling import _masked_fp32_kernel, apply_bitmask, masked_fp32
    from picovllm.kernels.triton_utils import pdl

    g = torch.Generator().manual_seed(6)
    rows, vocab = 5, 300
    logits = (torch.randn(rows, vocab + 20, generator=g) * 3).to(dtype).to(DEV)[:, :vocab]
    bitmask = torch.randint(-(2**31), 2**31, (rows, (vocab + 31) // 32), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32).to(DEV)
    before = logits.clone()
    expect = apply_bitmask(logits.float(), bitmask)
    out = torch.empty(rows, vocab, dtype=torch.float32, device=DEV)
    _masked_fp32_kernel[(rows, 3)](
        logits, bitmask, out, logits.stride(0), bitmask.stride(0), vocab, BLOCK=128, **pdl(logits)
    )
    assert torch.equal(out, expect) and torch.equal(logits, before)
    assert 0.3 < (expect == float("-inf")).float().mean() < 0.7
    if DEV == "cuda":
        assert torch.equal(masked_fp32(logits, bitmask), expect)


def test_penalties_kernel_equals_reference():
    """Repetition, frequency and presence penalties at the seen tokens, exactly the reference's:
    prompts and outputs of different lengths (padding), repeated tokens, tokens in both, a row
    with no output yet, outputs longer than a tile; written into the logits given."""
    from picovllm.kernels.penalties import apply_penalties_ref, apply_penalties_triton

    g = torch.Generator().manual_seed(3)
    vocab = 90

    def padded(lengths):
        rows = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
        out = torch.full((len(rows), max(lengths)), vocab, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return out.to(DEV)

    prompt_ids, output_ids = padded([1, 40, 7, 130, 3]), padded([0, 5, 200, 64, 1])
    logits = (torch.randn(5, vocab, generator=g) * 3).to(DEV)
    before = logits.clone()
    penalties = [
        torch.tensor(v, device=DEV)[:, None]
        for v in ([1.3, 0.8, 1.0, 2.0, 1.05], [0.2, 0.0, -0.5, 1.0, 0.1], [0.4, 0.3, 0.0, -1.0, 0.2])
    ]
    expect = apply_penalties_ref(logits, prompt_ids, output_ids, *penalties)
    got = apply_penalties_triton(logits, prompt_ids, output_ids, *penalties, tile=32)
    assert got is logits
    assert torch.equal(got, expect)
    assert (got != before).sum() > 100
