"""Every Triton kernel against its PyTorch reference on random inputs of awkward shapes:
non-power-of-2 sizes, contexts crossing block boundaries, padding slots, non-contiguous inputs.
On CPU they run in Triton's interpreter (fp32/fp16: its bf16 dot is unreliable); on CUDA in bf16 too."""
import pytest
import torch

triton = pytest.importorskip("triton")

from picovllm.kernels.decode_attention import PARTITION, decode_attention_triton  # noqa: E402
from picovllm.kernels.kv_store import store_kvcache_ref, store_kvcache_triton  # noqa: E402
from picovllm.kernels.paged_attention import paged_attention_ref, plan_paged_attention  # noqa: E402
from picovllm.kernels.prefill_attention import prefill_attention_triton  # noqa: E402
from picovllm.kernels.rms_norm import rms_norm_ref, rms_norm_triton  # noqa: E402
from picovllm.kernels.rotary import rotary_ref, rotary_triton  # noqa: E402
from picovllm.kernels.silu_mul import silu_mul_ref, silu_mul_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache(dtype):
    g = torch.Generator().manual_seed(0)
    tokens, heads, dim, blocks, bs = 13, 3, 24, 7, 4
    qkv = torch.randn(tokens, 5 * heads * dim, generator=g).to(dtype).to(DEV)
    key = qkv[:, heads * dim: 2 * heads * dim].view(tokens, heads, dim)  # strided views of a fused output
    value = qkv[:, 3 * heads * dim: 4 * heads * dim].view(tokens, heads, dim)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    slots[[2, 7]] = -1  # padding tokens
    slots = slots.to(DEV)
    caches = [torch.zeros(blocks, bs, heads, dim, dtype=dtype, device=DEV) for _ in range(4)]
    store_kvcache_ref(key, value, caches[0], caches[1], slots)
    store_kvcache_triton(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    x = torch.randn(7, 200, dtype=torch.float32).to(dtype).to(DEV)[:, 3:99]  # 96 columns, row stride 200
    w = torch.randn(96).to(dtype).to(DEV)
    _close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    x = torch.randn(5, 2 * 100).to(dtype).to(DEV)
    _close(silu_mul_triton(x, block=64), silu_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(dtype):
    tokens, heads, dim = 9, 3, 32
    qkv = torch.randn(tokens, 3 * heads * dim).to(dtype).to(DEV)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    angles = torch.rand(tokens, dim // 2) * 50
    cos, sin = angles.cos().to(dtype).to(DEV), angles.sin().to(dtype).to(DEV)
    _close(rotary_triton(q, cos, sin), rotary_ref(q, cos, sin), dtype)


def _paged_batch(dtype, q_lens, prefix_lens, block_size, heads=6, kv_heads=2, dim=24, seed=0):
    """A batch whose sequences have cached prefixes in randomly placed blocks; returns the
    query and everything the attention kernels take."""
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
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    query = torch.randn(sum(q_lens), heads, dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + q_lens).cumsum(0)
    to = lambda t: t.to(DEV)  # noqa: E731
    return to(query), to(k_cache), to(v_cache), to(tables), to(torch.tensor(ctx)), to(qsl), dim ** -0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_attention_with_cached_prefix(dtype, block_size):
    q_lens, prefix = [1, 5, 17, 33, 70], [0, 3, 16, 0, 9]
    query, kc, vc, tables, ctx, qsl, scale = _paged_batch(dtype, q_lens, prefix, block_size)
    plan = plan_paged_attention(tables, ctx, qsl, block_size, max(q_lens), int(ctx.max()))
    ref = paged_attention_ref(query, kc, vc, plan, scale)
    out = prefill_attention_triton(query, kc, vc, tables, ctx, qsl, scale, max(q_lens), block_m=32, block_n=32)
    _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_split_k(dtype):
    block_size = 16
    prefix = [0, 14, 15, 16, 40, PARTITION + 77]  # the longest spans two partitions
    query, kc, vc, tables, ctx, qsl, scale = _paged_batch(dtype, [1] * len(prefix), prefix, block_size, seed=1)
    plan = plan_paged_attention(tables, ctx, qsl, block_size, 1, int(ctx.max()))
    ref = paged_attention_ref(query, kc, vc, plan, scale)
    out = decode_attention_triton(query, kc, vc, tables, ctx, scale, int(ctx.max()))
    _close(out, ref, dtype)
    # a graph-sized bound (more partitions than any context needs) changes nothing
    _close(decode_attention_triton(query, kc, vc, tables, ctx, scale, 4 * PARTITION), ref, dtype)



@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_hopper(dtype):
    """Every kernel compiles ahead of time for sm_90 (no GPU needed), which catches what the
    interpreter does not: types, layouts, unsupported operations. Runs in a subprocess because
    the interpreter, once on, replaces every @triton.jit function."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "compile_kernels.py")
    done = subprocess.run([sys.executable, script, dtype], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok"] * 7
