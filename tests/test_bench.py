"""The benchmark harness runs end to end on a tiny model and reports consistent figures."""
import json

from picovllm.bench.latency import run_latency
from picovllm.bench.prefix import run_prefix
from picovllm.bench.throughput import run_throughput


def test_latency_with_hf_baseline(tiny_qwen, capsys, tmp_path):
    kwargs = {"model": tiny_qwen[0], "device": "cpu", "dtype": "float32", "kv_cache_memory": 16 << 20}
    rows = run_latency(kwargs, [1, 3], input_len=9, output_len=5, hf_modes=["eager"], plot=str(tmp_path / "l.png"))
    assert (tmp_path / "l.png").stat().st_size > 1000
    assert [(r["system"], r["batch"]) for r in rows] == [
        ("picovllm", 1), ("hf-eager", 1), ("picovllm", 3), ("hf-eager", 3)]
    for r in rows:
        assert r["decode_tok_s"] > 0 and 0 < r["bw_frac"]
        assert abs(r["decode_tok_s"] - r["batch"] * 1e3 / r["ms_per_step"]) < 1e-6 * r["decode_tok_s"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["benchmark"] == "latency"


def test_throughput(tiny_qwen, capsys):
    kwargs = {"model": tiny_qwen[0], "device": "cpu", "dtype": "float32", "kv_cache_memory": 16 << 20,
              "max_model_len": 256}
    result = run_throughput(kwargs, num_prompts=6, min_len=5, max_len=20)
    assert result["requests"] == 6 and result["output_tok_s"] > 0
    assert result["total_tok_s"] > result["output_tok_s"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["benchmark"] == "throughput"


def test_prefix_scenarios(tiny_qwen, capsys):
    # as the CLI passes them: the engine options include the prefix-caching flag, which it overrides
    kwargs = {"model": tiny_qwen[0], "device": "cpu", "dtype": "float32", "kv_cache_memory": 16 << 20,
              "enable_prefix_caching": True}
    rows = run_prefix(kwargs, repeat=1, scale=0.1)
    by_name = {r["scenario"][0]: r for r in rows}
    assert by_name["b"]["hit_rate_on"] > 0.5 and by_name["b"]["hit_rate_off"] == 0
    assert by_name["c"]["hit_rate_on"] == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["match_insert_us"] > 0
