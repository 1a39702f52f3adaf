"""The benchmark harness runs end to end on a tiny model and reports consistent figures."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import assert_group_gone

from picovllm.bench.latency import run_latency
from picovllm.bench.prefix import run_prefix
from picovllm.bench.throughput import run_throughput


def test_latency_with_hf_baseline(tiny_qwen, capsys, tmp_path):
    kwargs = {"model": tiny_qwen[0], "device": "cpu", "dtype": "float32", "kv_cache_memory": 16 << 20}
    rows = run_latency(kwargs, [1, 3], input_len=9, output_len=5, hf_modes=["eager"], plot=str(tmp_path / "l.png"))
    assert (tmp_path / "l.png").stat().st_size > 1000
    assert [(r["system"], r["batch"]) for r in rows] == [
        ("picovllm", 1),
        ("hf-eager", 1),
        ("picovllm", 3),
        ("hf-eager", 3),
    ]
    for r in rows:
        assert r["decode_tok_s"] > 0 and 0 < r["bw_frac"]
        assert abs(r["decode_tok_s"] - r["batch"] * 1e3 / r["ms_per_step"]) < 1e-6 * r["decode_tok_s"]
        # (the TTFT against its floor: the same prompts' floor for both systems, larger at batch 3)
        assert abs(r["ttft_x_floor"] - r["ttft_ms"] / r["ttft_floor_ms"]) < 1e-9 * r["ttft_x_floor"]
    floors = [r["ttft_floor_ms"] for r in rows]
    assert 0 < floors[0] == floors[1] < floors[2] == floors[3]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["benchmark"] == "latency" and json.loads(last)["matmul_tflop_s"] > 0


def test_latency_decode_step_is_the_full_runs_own(tiny_qwen, monkeypatch):
    """Our decode step comes from the full run's own timestamps (its last first token to its last
    finish), not from its time less the prefill-only run's: a prefill-only run slower by 0.5 s
    (as a prompt's time varies between runs) changes no step figure, where it took the whole
    decode's time away (on an H100 a batch's two prefill times made two step figures, 12% apart)."""
    import picovllm.bench.latency as latency

    kwargs = {"model": tiny_qwen[0], "device": "cpu", "dtype": "float32", "kv_cache_memory": 16 << 20}
    generate = latency.PicoRunner.generate

    def slow_prefill_only(self, prompts, new_tokens):
        generate(self, prompts, new_tokens)
        if new_tokens == 1:
            time.sleep(0.5)

    monkeypatch.setattr(latency.PicoRunner, "generate", slow_prefill_only)
    (row,) = run_latency(kwargs, [2], input_len=9, output_len=6, hf_modes=[])
    assert row["ttft_ms"] > 500
    assert 0.05 < row["ms_per_step"] < 200  # (a tiny model's step on the CPU: milliseconds)
    assert abs(row["decode_tok_s"] - 2 * 1e3 / row["ms_per_step"]) < 1e-6 * row["decode_tok_s"]


def test_latency_decode_step_is_the_full_batchs(tiny_qwen):
    """A batch whose prompts take several steps to prefill (a small token budget) starts decoding
    request by request: the step figure counts only the steps where the whole batch decodes, from
    the step that gave the last prompt its first token to the one that finished the first request.
    Counted from the last first token to the last finish instead, the batch shrank as the early
    requests finished (an H100's batch 256 over 1,024-token prompts: 124% of copy bandwidth at
    64 new tokens)."""
    import pytest

    from picovllm.bench.latency import full_batch_decode

    # first tokens at steps 1, 1, 2 and 3; the first finish at step 6, the last at step 8
    stamps = [10.0 * (k + 1) for k in range(9)]  # each step's end
    firsts = [stamps[1] - 1, stamps[1] - 1, stamps[2] - 1, stamps[3] - 1]
    finishes = [stamps[6] - 1, stamps[6] - 1, stamps[7] - 1, stamps[8] - 1]
    assert full_batch_decode(stamps, firsts, finishes) == (30.0, 3)  # steps 4, 5 and 6
    with pytest.raises(ValueError, match="--output-len"):  # (no step where all of them decode)
        full_batch_decode(stamps, firsts, [stamps[2] - 1] * 4)

    kwargs = {
        "model": tiny_qwen[0],
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_memory": 16 << 20,
        "max_model_len": 20,
        "max_num_batched_tokens": 20,
    }
    # 6 prompts of 9 tokens, 20 tokens a step (the decoding requests' first): first tokens at
    # steps 0, 0, 1, 1, 2, 2; the first request's 6th token at step 5: steps 3, 4 and 5
    (row,) = run_latency(kwargs, [6], input_len=9, output_len=6, hf_modes=[])
    assert row["decode_steps"] == 3
    (row,) = run_latency({**kwargs, "max_num_batched_tokens": 64}, [6], input_len=9, output_len=6, hf_modes=[])
    assert row["decode_steps"] == 5  # (one prefill step: every request decodes from the next)
    with pytest.raises(ValueError, match="--output-len"):
        run_latency(kwargs, [6], input_len=9, output_len=2, hf_modes=[])
    # 16 prompts take more steps to prefill than the warm-up's 8 new tokens last: the warm-up's
    # batch never decodes whole, and is not timed (it raised on the H100 at batch 128, prompts of 128)
    (row,) = run_latency({**kwargs, "max_model_len": 40}, [16], input_len=9, output_len=24, hf_modes=[])
    assert 0 < row["decode_steps"] < 23
    with pytest.raises(ValueError, match="--output-len 1"):  # (no step between two tokens: nothing to time)
        run_latency({**kwargs, "max_num_batched_tokens": 64}, [6], input_len=9, output_len=1, hf_modes=[])


def test_latency_samples_as_the_models_generation_config_asks(tiny_qwen_generation_config, capsys):
    """The tiny model's generation config (temperature 0, top_k, top_p, a repetition penalty): the
    rows come, and the run says what it samples with; --hf (greedy) is refused beside it."""
    import pytest

    kwargs = {"model": tiny_qwen_generation_config, "device": "cpu", "dtype": "float32", "kv_cache_memory": 16 << 20}
    rows = run_latency(kwargs, [2], input_len=9, output_len=5, hf_modes=[])
    assert [(r["system"], r["batch"]) for r in rows] == [("picovllm", 2)] and rows[0]["decode_tok_s"] > 0
    assert "repetition_penalty=1.05" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--generation-config vllm"):
        run_latency(kwargs, [1], input_len=9, output_len=5, hf_modes=["eager"])


def test_throughput(tiny_qwen, capsys):
    kwargs = {
        "model": tiny_qwen[0],
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_memory": 16 << 20,
        "max_model_len": 256,
    }
    result = run_throughput(kwargs, num_prompts=6, min_len=5, max_len=20)
    assert result["requests"] == 6 and result["output_tok_s"] > 0
    assert result["total_tok_s"] > result["output_tok_s"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["benchmark"] == "throughput"


def test_structured_runs_both_ways_with_the_same_shape(tiny_qwen, capsys):
    """A dummy model with a tokenizer given: the constrained run decodes as many tokens as the
    unconstrained one, every request ended by its length (the schema is never complete); with
    repeat 2, each kind's best run is the one shown."""
    from picovllm.bench.structured import run_structured
    from picovllm.entrypoints.cli import main

    kwargs = {"model": tiny_qwen[0], "device": "cpu", "dtype": "float32", "kv_cache_memory": 16 << 20}
    result = run_structured(kwargs, batch_size=3, input_len=8, output_len=12, repeat=2)
    free, constrained = result["runs"]
    assert free["tokens"] == constrained["tokens"] == 36 and free["lengths"] == constrained["lengths"] == 3
    for run in (free, constrained):  # (the best of the two runs of each kind)
        assert len(run["ms_per_step_each"]) == 2 and run["ms_per_step"] == min(run["ms_per_step_each"])
    assert constrained["vs_unconstrained"] > 0 and result["typical_schema_compile_ms"] > 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["benchmark"] == "structured"
    argv = ["bench", "structured", "--model", "dummy:qwen2.5-0.5b", "--tokenizer", tiny_qwen[0], "--device", "cpu"]
    assert main([*argv, "--batch-size", "2", "--input-len", "4", "--output-len", "3", "--max-model-len", "64"]) == 0
    assert result["sampling"] == {"temperature": 0.6}
    config = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "qwen2.5-7b-instruct")
    result = run_structured({**kwargs, "generation_config": config}, batch_size=2, input_len=8, output_len=4)
    assert result["sampling"] == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert [r["tokens"] for r in result["runs"]] == [8, 8]


def test_prefix_scenarios(tiny_qwen, capsys):
    # as the CLI passes them: the engine options include the prefix-caching flag, which it overrides
    kwargs = {
        "model": tiny_qwen[0],
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_memory": 16 << 20,
        "enable_prefix_caching": True,
    }
    rows = run_prefix(kwargs, repeat=1, scale=0.1)
    by_name = {r["scenario"][0]: r for r in rows}
    assert by_name["b"]["hit_rate_on"] > 0.5 and by_name["b"]["hit_rate_off"] == 0
    assert by_name["c"]["hit_rate_on"] == 0
    # floors: nothing shared in c, so both settings run the same forwards; b's warm requests
    # compute a few tokens with the cache on and the whole prompt without it
    assert by_name["c"]["warm_ttft_bound"] == 1.0
    assert by_name["b"]["ttft_warm_floor_ms_off"] > by_name["b"]["ttft_warm_floor_ms_on"] > 0
    assert by_name["b"]["warm_ttft_bound"] > 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["match_insert_us"] > 0


def test_forward_flops_counts_weights_attention_and_one_lm_head_row(tiny_qwen):
    from picovllm import LLM
    from picovllm.bench.common import forward_flops

    llm = LLM(tiny_qwen[0], device="cpu", dtype="float32", kv_cache_memory=4 << 20, skip_tokenizer_init=True)
    model = llm.llm_engine.executor.driver.model_runner.model
    c = model.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    head = 2 * c.vocab_size * c.hidden_size
    # 5 new tokens after 7 cached: the queries see 8, 9, ..., 12 keys
    attention = 4 * q * c.num_hidden_layers * sum(range(8, 13))
    assert forward_flops(model, 5, 7) == 2 * c.num_hidden_layers * per_layer * 5 + attention + head
    assert forward_flops(model, 1, 0) == 2 * c.num_hidden_layers * per_layer + 4 * q * c.num_hidden_layers + head


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_cpus_gemm_ceiling_is_the_engines_own_linear(monkeypatch, dtype):
    """matmul_flops is the rate a prompt's TTFT floor divides its FLOPs by. On a CPU it times the
    engine's linear() on a weight pack_weights prepared: torch's bf16 matmul on an AVX2 CPU (no
    bf16 GEMM in oneDNN) runs at a hundredth of the fp32 the engine multiplies in there, and an fp32
    weight of that size is packed for oneDNN, whose GEMM outruns torch's: the floor came out 100x
    the TTFT, then 0.7x. Here oneDNN has no bf16 GEMM: a bf16 weight stays plain (linear() takes
    it to fp32), an fp32 one is packed."""
    import torch

    from picovllm.bench import common

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    monkeypatch.setattr(common, "measure_rate", lambda fn, amount, device, reps: fn() or 1.0)
    ran = []  # (the input's dtype, the weight's, whether packed), not multiplied
    monkeypatch.setattr(common, "linear", lambda x, w: ran.append((x.dtype, w.dtype, w.is_mkldnn)))
    common.matmul_flops(torch.device("cpu"), getattr(torch, dtype))
    want = getattr(torch, dtype)
    assert ran == [(want, want, want == torch.float32 and torch.backends.mkldnn.is_available())]


def test_serve_step_intervals_leave_idle_gaps_out():
    from picovllm.bench.common import ms_stats
    from picovllm.bench.serve import _busy_gaps

    gaps = _busy_gaps([0.0, 0.001, 0.003, 1.0, 1.002])  # the 0.997 s gap: the engine waited for requests
    assert np.allclose(gaps, [0.001, 0.002, 0.002])
    stats = ms_stats(gaps.tolist())
    assert abs(stats["p50"] - 2.0) < 1e-9 and abs(stats["mean"] - 5 / 3) < 1e-9 and ms_stats([]) == {}


def test_serve_report_says_why_every_request_failed(capsys):
    """A run whose requests all failed (token ids past a server's vocabulary) reports the first
    error instead of crashing on an empty latency table."""
    from picovllm.bench.serve import _report, _summary

    error = '{"error": {"message": "token id 29999 is outside the vocabulary (307)"}}'
    results = [{"ok": False, "status": 400, "error": error}] * 3
    _report(_summary(results, 1.0, 3, float("inf"), 8, 4, None), results, None)
    out = capsys.readouterr().out
    assert "0/3 requests" in out and "3 other failures" in out
    assert "first failure: 400 " + error in out


def test_offload_multi_turn_and_preemption(tiny_qwen, capsys):
    from picovllm.bench.offload import run_multi_turn, run_preemption

    kwargs = {"model": tiny_qwen[0], "device": "cpu", "dtype": "float32", "block_size": 4}
    chats = run_multi_turn(
        kwargs, conversations=6, turns=3, first_len=40, turn_len=8, output_len=4, pressure=3.0, max_num_seqs=2
    )
    assert chats["working_set_gb"] > 2.5 * chats["gpu_pool_gb"]  # (the pool holds 1/3 of the histories)
    assert chats["off"]["hit_rate"] == 0 and chats["on"]["hit_rate"] == chats["on"]["host_hit_rate"] > 0.3
    assert chats["on"]["promoted_gb"] > 0 and chats["on"]["promote_gb_s"] > 0 and chats["on"]["h2d_gb_s"] > 0
    assert 0 < chats["on"]["copy_s"] < chats["on"]["wall_s"]  # (the copies timed, and a part of the run)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["benchmark"] == "offload_multi_turn"
    preemption = run_preemption(kwargs, requests=6, prompt_len=30, output_len=20, pressure=3.0)
    recompute, swap = preemption["results"]
    assert recompute["preemptions"] > 0 and recompute["swapped"] == 0
    assert swap["swapped"] == swap["preemptions"] > 0 and preemption["identical_outputs"] == 6  # (fp32)
    assert preemption["preempted"] and "nothing was preempted" not in capsys.readouterr().out
    roomy = run_preemption(kwargs, requests=2, prompt_len=8, output_len=4, pressure=0.25)  # (4x room)
    assert not roomy["preempted"] and "nothing was preempted: " in capsys.readouterr().out


def test_benchmarks_take_cpu_sized_defaults_on_a_cpu_and_say_so(capsys):
    from picovllm.bench.cli import sizes
    from picovllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "latency", "--device", "cpu", "--input-len", "7"])
    sizes(args)
    assert (args.batch_sizes, args.input_len, args.output_len) == ([1, 8], 7, 64)
    said = "[bench] on the CPU, sized to take minutes: --batch-sizes 1,8 --output-len 64 (give any"
    assert capsys.readouterr().err.startswith(said)
    args = build_parser().parse_args(["bench", "prefix"])
    sizes(args, on_cpu=False)  # (as on a GPU)
    assert (args.repeat, args.scale, args.conversations, args.concurrency) == (3, 1.0, 64, 16)
    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--device", "cpu"])
    sizes(args, on_cpu=False)
    assert (args.num_prompts, args.concurrency) == (1000, 64) and capsys.readouterr().err == ""


def test_bench_preemptions_cpu_sizes_do_preempt(tiny_qwen, capsys):
    """bench preemption's CPU defaults preempt (its pool is a fraction of the requests' blocks,
    whatever the model: a tiny one here), so that its comparison on a CPU is not void."""
    from picovllm.bench.cli import sizes
    from picovllm.bench.offload import run_preemption
    from picovllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "preemption", "--device", "cpu"])
    sizes(args)
    kwargs = {"model": tiny_qwen[0], "device": "cpu", "dtype": "float32"}
    result = run_preemption(kwargs, args.requests, args.input_len, args.output_len, args.pressure)
    assert result["preempted"] and all(r["preemptions"] > 0 for r in result["results"])


def test_ctrl_c_stops_bench_serve_in_one_line_and_leaves_no_process(tiny_qwen):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while `bench serve`'s
    clients run: one line, exit 130, no traceback or leaked-resource warning, every process of
    the group (engine, clients) gone."""
    cli = [sys.executable, "-m", "picovllm.entrypoints.cli", "bench", "serve", "--model", tiny_qwen[0]]
    cli += ["--device", "cpu", "--num-prompts", "400", "--concurrency", "4", "--input-len", "8", "--output-len", "64"]
    proc = subprocess.Popen(cli, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        while not any("client process" in line for line in lines):
            lines.append(proc.stderr.readline())
            assert lines[-1], lines  # (ended before its clients started)
        time.sleep(5)  # (the clients start 3 s after the line, then stream)
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 130, rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rest.strip() == "interrupted", rest
    assert_group_gone(proc.pid, "bench serve")


def test_host_phases_times_the_engines_functions():
    """benchmarks/host_phases.py wraps engine functions by name: each one is there, and a renamed
    one fails here rather than leaving the script timing nothing."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "host_phases.py")
    spec = importlib.util.spec_from_file_location("host_phases", path)
    phases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(phases)
    missing = [(owner, name) for owner, name in phases.PHASES if not callable(getattr(owner, name, None))]
    assert len(phases.PHASES) >= 20 and missing == []


def test_host_phases_times_a_serving_loop(tiny_qwen):
    """host_phases.py --serve (gpu_check.sh's host stage): the engine under bench serve's closed loop,
    each phase's time per step, and on a CPU the host's own work beside the forward's."""
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "host_phases.py")
    args = ["--serve", "--model", tiny_qwen[0], "--device", "cpu", "--steps", "20", "--warmup", "5"]
    out = subprocess.run([sys.executable, path, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("20 steps, ") for line in lines), out.stdout
    own = next(line for line in lines if line.startswith("without the forward and the sampler"))
    phases = {line.split()[0]: float(line.split()[-1]) for line in lines if line.startswith("  ")}
    assert phases["LLMEngine._step"] > phases["ModelRunner.step_logits"] > phases["ModelRunner.prepare"] > 0
    assert 0 < float(own.split(": ")[1].split()[0]) < phases["LLMEngine._step"]
