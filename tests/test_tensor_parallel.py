"""Tensor parallelism on the CPU: ranks in processes of their own over gloo, each loading its
shard of a tiny model; the logits rank 0 gathers equal transformers' (fp32)."""

import multiprocessing
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import build_model

from picovllm.config import check_tp_heads

PROMPTS = [[5, 17, 200, 33, 4, 90, 61], [300, 2, 8], list(range(40, 60))]
BLOCK_SIZE = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, path: str, out: str) -> None:
    """One rank: its shard of the model and of the KV cache; a prefill of PROMPTS in one step, then
    one decode step of each prompt's greedy token. Rank 0 saves the logits of every position."""
    from picovllm.distributed.parallel_state import destroy_distributed, get_tp_size, init_distributed
    from picovllm.engine.block_manager import BlockManager
    from picovllm.messages import StepInputs
    from picovllm.model.loader.model_loader import load_model
    from picovllm.model_source import resolve_model
    from picovllm.worker.inputs import Uploader, build_eager
    from picovllm.worker.model_runner import allocate_kv_pool

    torch.set_num_threads(1)
    init_distributed(world, rank, "gloo", f"tcp://127.0.0.1:{port}")
    assert get_tp_size() == world
    cfg, _ = resolve_model(path)
    cpu = torch.device("cpu")
    model = load_model(cfg, path, torch.float32, cpu, 1024)
    layers = model.attention_layers()
    _, views = allocate_kv_pool(
        len(layers), 64, BLOCK_SIZE, layers[0].num_kv_heads, layers[0].head_dim, torch.float32, cpu
    )
    for attn, (k, v) in zip(layers, views):
        attn.k_cache, attn.v_cache = k, v
    pool = BlockManager(64, BLOCK_SIZE)
    tables = [pool.allocate(-(-(len(p) + 1) // BLOCK_SIZE)) for p in PROMPTS]
    upload = Uploader(cpu)

    def forward(tokens, context, query):
        step = StepInputs(tokens, np.array(context), np.array(query), tables, np.ones(len(tokens), dtype=bool))
        inputs = build_eager(step, BLOCK_SIZE, upload)
        with torch.inference_mode():
            return model.compute_logits(model(inputs.input_ids, inputs.positions, inputs.meta))

    prefill = forward(PROMPTS, [len(p) for p in PROMPTS], [len(p) for p in PROMPTS])
    # every rank takes the same next tokens: rank 0 has the logits, the others follow its choice
    ends = np.cumsum([len(p) for p in PROMPTS]) - 1
    nxt = torch.zeros(len(PROMPTS), dtype=torch.long)
    if rank == 0:
        nxt = prefill[torch.from_numpy(ends)].argmax(-1)
    torch.distributed.broadcast(nxt, src=0)
    decode = forward([[t] for t in nxt.tolist()], [len(p) + 1 for p in PROMPTS], [1] * len(PROMPTS))
    if rank == 0:
        torch.save({"prefill": prefill, "decode": decode, "next": nxt}, out)
    else:
        assert prefill is None and decode is None  # logits are gathered to rank 0 only
    destroy_distributed()


def _run_ranks(world: int, path: str, out: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, path, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive and [p.exitcode for p in procs] == [0] * world


@pytest.mark.parametrize(
    "arch,kv_heads,tie,world",
    [("qwen2", 2, False, 2), ("llama", 1, True, 2), ("qwen2", 2, True, 4)],
    ids=["qwen2-kv-split", "llama-kv-replicated", "qwen2-tp4-kv-replicated"],
)
def test_sharded_model_logits_equal_transformers(tmp_path, arch, kv_heads, tie, world):
    """KV heads split across ranks (2 heads on 2 ranks) or replicated (1 head on 2 ranks, 2 on 4),
    a vocabulary of 307 split into padded slices, tied and untied heads, QKV bias or none."""
    path = str(tmp_path / "model")
    hf = build_model(path, arch, heads=4, kv_heads=kv_heads, tie=tie, bias=arch == "qwen2", tokenizer=False, seed=5)
    out = str(tmp_path / "logits.pt")
    _run_ranks(world, path, out)
    got = torch.load(out)
    with torch.no_grad():
        start = 0
        for i, p in enumerate(PROMPTS):
            ids = p + [int(got["next"][i])]
            ref = hf(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(got["prefill"][start : start + len(p)], ref[: len(p)], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got["decode"][i], ref[len(p)], atol=1e-4, rtol=1e-4)
            start += len(p)
    assert not multiprocessing.active_children()


def test_tensor_parallel_size_must_fit_the_heads():
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 4 attention heads"):
        check_tp_heads(4, 2, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 and the model's 6 KV heads"):
        check_tp_heads(8, 6, 4)
    check_tp_heads(4, 2, 4)  # each KV head on two ranks
    check_tp_heads(8, 8, 2)  # four KV heads a rank


def test_dummy_weights_do_not_depend_on_the_shard(tmp_path):
    """load_format='dummy' draws each full checkpoint tensor from its own seed, so a rank's shard
    of it is the same slice whatever the tensor-parallel size (and the same model each time)."""
    from picovllm.config import ModelConfig
    from picovllm.model.loader.model_loader import load_model

    cfg = ModelConfig.from_dict(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": 50,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
        }
    )
    a = load_model(cfg, None, torch.float32, torch.device("cpu"), 64, seed=1).state_dict()
    b = load_model(cfg, None, torch.float32, torch.device("cpu"), 64, seed=1).state_dict()
    c = load_model(cfg, None, torch.float32, torch.device("cpu"), 64, seed=2).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    weight = "model.layers.0.self_attn.qkv_proj.weight"
    assert not torch.equal(a[weight], c[weight]) and a[weight].std() > 0.01
    assert torch.equal(a["model.norm.weight"], torch.ones(32))


def _llm(path, **kwargs):
    from conftest import engine_args

    from picovllm import LLM

    return LLM(**engine_args(path, skip_tokenizer_init=True, **kwargs))


def _outputs(llm, prompts, params):
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_same(ours, ref, tol=1e-4):
    """Tokens equal; each token's logprob within tol."""
    assert [[t for t, _ in o] for o in ours] == [[t for t, _ in o] for o in ref]
    for o, r in zip(ours, ref):
        for (tokens, lps), (_, ref_lps) in zip(o, r):
            for t, lp, ref_lp in zip(tokens, lps, ref_lps):
                assert abs(lp[t].logprob - ref_lp[t].logprob) < tol


@pytest.mark.parametrize(
    "arch,kv_heads,tie,tp",
    [("qwen2", 2, False, 2), ("llama", 1, True, 2), ("qwen2", 2, True, 4)],
    ids=["qwen2-tp2", "llama-tp2-kv-replicated", "qwen2-tp4-kv-replicated"],
)
def test_tp_generates_what_tp1_generates(tmp_path, arch, kv_heads, tie, tp):
    """Greedy (with a repetition penalty, counting the token in flight on rank 0) and seeded n=2
    requests with logprobs, prompts sharing a prefix (prefix caching),
    chunked under a 24-token budget, in a pool of 24 blocks that makes requests preempt; steps
    launched ahead (async scheduling), whose sampled tokens reach the other ranks from rank 0."""
    import multiprocessing

    from picovllm import SamplingParams

    path = str(tmp_path)
    build_model(path, arch, heads=4, kv_heads=kv_heads, tie=tie, bias=arch == "qwen2", tokenizer=False, seed=7)
    shared = list(range(50, 70))
    prompts = [{"prompt_token_ids": shared + list(range(100 + i, 100 + i + 3 * i + 2))} for i in range(6)]
    params = [
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=1, repetition_penalty=1.3)
        if i % 2
        else SamplingParams(temperature=0.8, n=2, seed=i, max_tokens=14, ignore_eos=True, logprobs=1)
        for i in range(6)
    ]
    kw = dict(block_size=4, num_gpu_blocks_override=24, max_num_batched_tokens=24, max_num_seqs=6)
    ref_llm = _llm(path, **kw)
    ref = _outputs(ref_llm, prompts, params)
    assert ref_llm.get_metrics()["num_preemptions"] > 0
    llm = _llm(path, tensor_parallel_size=tp, **kw)
    _assert_same(_outputs(llm, prompts, params), ref)
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0 and metrics["prefix_cache_hit_tokens"] > 0
    assert llm.llm_engine.launcher.num_launched_ahead > 0
    assert len(multiprocessing.active_children()) == tp - 1
    llm.shutdown()
    assert not multiprocessing.active_children()


def test_fp8_at_tp2_computes_what_its_shards_stand_for(tmp_path):
    """quantization="fp8" under tensor parallelism: a row-parallel layer's ranks agree on each
    weight row's scale (its whole row's), so tp = 2 holds the slices of tp = 1's weights; each rank
    quantizes its slice of a row-parallel layer's input with its own scales (as vLLM's ranks do).
    Its greedy tokens and log-probabilities (fp32, through both ranks' LM-head gathers) are those of
    transformers' model computing that (tests/test_fp8.py)."""
    from test_fp8 import _dequantized_copy, _w8a8_reference, assert_like_reference

    path = str(tmp_path / "model")
    build_model(path, "qwen2", heads=4, kv_heads=2, tie=False, bias=True, tokenizer=False, seed=3)
    _dequantized_copy(path, str(tmp_path / "dequantized"))
    prompts = [list(range(10 + i, 22 + 3 * i)) for i in range(10)]
    llm = _llm(path, quantization="fp8", tensor_parallel_size=2)
    assert_like_reference(llm, prompts, _w8a8_reference(str(tmp_path / "dequantized"), tp=2))
    llm.shutdown()


def test_tp_that_does_not_fit_the_heads_fails_before_any_process_starts(tiny_qwen):
    import multiprocessing

    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's 6 attention heads"):
        _llm(tiny_qwen[0], tensor_parallel_size=4)
    assert not multiprocessing.active_children()


def test_a_second_engine_beside_a_tensor_parallel_one_is_refused(tiny_qwen):
    """A process holds one tensor-parallel group: an engine started beside a live tp = 2 one would
    run its collectives on that group and wait for the other engine's rank for ever (a tp = 1
    reference in a test did). It is refused, naming the way out; once the first is shut down
    another starts."""
    from picovllm import SamplingParams

    first = _llm(tiny_qwen[0], tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"holds a tensor-parallel engine already \(tensor_parallel_size 2\)"):
        _llm(tiny_qwen[0])
    first.shutdown()
    out = _llm(tiny_qwen[0]).generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_a_killed_worker_is_an_error_naming_its_rank_and_nothing_is_left_behind(tmp_path):
    import gc
    import multiprocessing
    import time

    from picovllm import SamplingParams
    from picovllm.executor.executor import WorkerError

    path = str(tmp_path)
    build_model(path, "qwen2", heads=4, kv_heads=2, tokenizer=False)
    llm = _llm(path, tensor_parallel_size=2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0].token_ids) == 40
    (worker,) = multiprocessing.active_children()
    worker.kill()
    start = time.monotonic()
    with pytest.raises(WorkerError, match="tensor-parallel rank 1 failed: exited with code -9"):
        llm.generate([{"prompt_token_ids": [5, 6, 7 + i]} for i in range(4)], params, use_tqdm=False)
    assert time.monotonic() - start < 10
    with pytest.raises(WorkerError, match="rank 1"):  # the engine stays failed, and says why
        llm.generate({"prompt_token_ids": [1, 2]}, params, use_tqdm=False)
    del llm
    gc.collect()
    assert not multiprocessing.active_children()


def test_del_stops_the_workers(tiny_qwen):
    import gc
    import multiprocessing

    llm = _llm(tiny_qwen[0], tensor_parallel_size=2)
    assert len(multiprocessing.active_children()) == 1
    del llm
    gc.collect()
    assert not multiprocessing.active_children()


def _torchrun(*cli_args: str):
    """`torchrun --nproc-per-node 2 -m picovllm.entrypoints.cli ARGS` on 127.0.0.1."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    command += ["--master-port", str(_free_port()), "-m", "picovllm.entrypoints.cli", *cli_args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_torchrun_starts_the_ranks_and_generates_what_tp1_does(tiny_qwen, capsys):
    """`torchrun --nproc-per-node 2 -m picovllm.entrypoints.cli generate -tp 2 ...` on 127.0.0.1:
    rank 0 is the engine, rank 1 the worker, the step over a gloo group; the completions are tp=1's."""

    from picovllm.entrypoints.cli import main

    opts = [
        "-m",
        tiny_qwen[0],
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        str(16 << 20),
        "--temperature",
        "0",
        "--max-tokens",
        "10",
        "--ignore-eos",
        "-q",
        "Hello world",
        "The capital of",
    ]
    assert main(["generate", *opts]) == 0
    expected = capsys.readouterr().out
    run = _torchrun("generate", "-tp", "2", *opts)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == expected and expected.strip()


def test_a_torchrun_bench_runs_rank_0s_engine_on_both_ranks(tiny_qwen):
    """bench throughput under torchrun: rank 1 follows the engine rank 0 builds (its config sent over)."""
    import json

    opts = ["-m", tiny_qwen[0], "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", str(16 << 20)]
    run = _torchrun("bench", "throughput", *opts, "-tp", "2", "--num-prompts", "4", "--min-len", "5", "--max-len", "9")
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "throughput" and result["requests"] == 4 and result["output_tok_s"] > 0, result
    run = _torchrun("bench", "prefix", *opts, "-tp", "2")
    assert run.returncode != 0 and "bench prefix builds two engines in turn" in run.stderr


def test_torchrun_with_another_number_of_processes_than_tp_is_a_clear_error(tiny_qwen):
    """Two torchrun processes for -tp 1 would leave rank 1 waiting for a group rank 0 never forms."""

    run = _torchrun("generate", "-m", tiny_qwen[0], "--device", "cpu", "--max-tokens", "2", "Hello")
    assert run.returncode != 0
    assert "picovllm generate: error: torchrun started 2 processes for tensor_parallel_size 1" in run.stderr


def _gone(pid: int) -> bool:
    """No such process, or a zombie waiting to be reaped (its parent has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_ctrl_c_during_generate_stops_every_rank(tiny_qwen):
    """SIGINT to a process generating with tp=2: it exits with KeyboardInterrupt within seconds,
    and its worker with it."""
    import signal
    import subprocess
    import sys
    import time

    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from conftest import engine_args
from picovllm import LLM, SamplingParams
llm = LLM(**engine_args({tiny_qwen[0]!r}, skip_tokenizer_init=True, tensor_parallel_size=2))
print(llm.llm_engine.executor.workers[0].process.pid, flush=True)
params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
while True:
    llm.generate([{{"prompt_token_ids": [5, 6, 7 + i]}} for i in range(8)], params, use_tqdm=False)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        worker = int(proc.stdout.readline())
        time.sleep(1.0)  # generating
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - start < 8  # (a worker stuck in a collective is killed after 5 s)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    deadline = time.monotonic() + 5
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(worker)
