"""The benchmark harness runs end to end on a tiny model and reports consistent figures."""
import json

import numpy as np

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
    model = llm.llm_engine.model_runner.model
    c = model.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    head = 2 * c.vocab_size * c.hidden_size
    # 5 new tokens after 7 cached: the queries see 8, 9, ..., 12 keys
    attention = 4 * q * c.num_hidden_layers * sum(range(8, 13))
    assert forward_flops(model, 5, 7) == 2 * c.num_hidden_layers * per_layer * 5 + attention + head
    assert forward_flops(model, 1, 0) == 2 * c.num_hidden_layers * per_layer + 4 * q * c.num_hidden_layers + head


def test_late_tokens_are_attributed_to_their_client_process():
    """An interval is late over late_ms; it is put down to its own client process when that
    process started or finished another request within the 4 ms before the token arrived."""
    from picovllm.bench.serve import _late_tokens

    # client 0: request a (start 10.0) gets tokens at 10.1, 10.103, 10.110 (late), 10.113;
    # request b of the same process ends at 10.108, 2 ms before a's late token
    a = {"client": 0, "start": 10.0, "ttft": 0.1, "itl": [0.003, 0.007, 0.003], "e2e": 0.2}
    b = {"client": 0, "start": 9.9, "ttft": 0.05, "itl": [], "e2e": 0.208}
    # client 1: request c's late token (10.2 -> 10.21) has no event of its own process near it,
    # though client 0's request b ended at 10.108... and a's start is 10.0: neither in 4 ms
    c = {"client": 1, "start": 10.15, "ttft": 0.05, "itl": [0.01, 0.003], "e2e": 0.1}
    assert _late_tokens([a, b, c], late_ms=5) == {"late_ms": 5, "late": 2, "late_near_client_request": 1,
                                                  "late_in_one_client_only": 2}
    # c's late token arrives at 10.21: another request of its process starting 3 ms before counts;
    # one starting after it, or more than 4 ms before, does not
    near = {"client": 1, "start": 10.207, "ttft": 0.01, "itl": [], "e2e": 0.02}
    after = {"client": 1, "start": 10.2105, "ttft": 0.01, "itl": [], "e2e": 0.02}
    early = {"client": 1, "start": 10.2055, "ttft": 0.001, "itl": [], "e2e": 0.002}  # (ends at 10.2075: counts)
    too_early = {"client": 1, "start": 10.2, "ttft": 0.001, "itl": [], "e2e": 0.003}  # ends at 10.203
    assert [_late_tokens([c, x], late_ms=5)["late_near_client_request"] for x in (near, after, early, too_early)] \
        == [1, 0, 1, 0]


def test_slow_engine_steps_and_their_longest_run():
    """Step intervals over 1.5x the median are slow; runs of them in a row tell a slowed machine
    from single stalls; gaps of 0.25 s or more (the engine idle) are not steps."""
    from picovllm.bench.serve import _slow_steps

    gaps = [0.002, 0.002, 0.004, 0.002, 0.0031, 0.0035, 0.0032, 0.002, 0.3, 0.002, 0.0029, 0.002, 0.002, 0.002]
    times = [0.0, *np.cumsum(gaps)]
    # median of the 13 steps: 0.002 (0.3 s left out); over 0.003: 0.004, then 0.0031, 0.0035, 0.0032 in a row
    assert _slow_steps(times) == {"slow": 4, "steps": 13, "longest_run": 3}
    assert _slow_steps([1.0]) == {"slow": 0, "steps": 0, "longest_run": 0}


def test_late_outputs_split_into_engine_late_and_late_on_the_way():
    """A step delivered over 1.5x the median interval after the one before is late; it is the
    engine process's when that process also sent it late; idle gaps are no steps."""
    from picovllm.bench.serve import _late_outputs

    sent = [0.0, 0.002, 0.004, 0.009, 0.011, 0.013, 0.015, 0.5, 0.502]
    delivered = [0.0003, 0.0023, 0.0043, 0.0093, 0.0113, 0.0163, 0.0173, 0.5003, 0.5023]
    outputs = [64, 64, 64, 60, 64, 62, 64, 8, 8]
    # delivery gaps 2, 2, 5 (late: the engine sent it 5 ms after the last), 2, 5 (late on the way),
    # 1, (idle), 2 ms: median 2
    assert _late_outputs(sent, delivered, outputs) == {"outputs": 64 + 64 + 60 + 64 + 62 + 64 + 8, "late": 60 + 62,
                                                       "engine_late": 60}
    assert _late_outputs([0.0], [0.001], [3]) == {"outputs": 0, "late": 0, "engine_late": 0}


def test_late_tokens_in_one_client_only_unless_another_process_is_late_with_them():
    """A late token is late in its client process alone when no other process has a late token
    within 2 ms of it (a late server step reaches every process's streams together)."""
    from picovllm.bench.serve import _late_tokens

    def req(client, itl):  # one request of a client process, first token at 1.0
        return {"client": client, "start": 0.9, "ttft": 0.1, "itl": itl, "e2e": 0.5}

    # late tokens at 1.010 (client 0), 1.0115 (client 1: 1.5 ms apart, together), 1.030 and
    # 1.0325 (client 0 and client 2: 2.5 ms apart, alone), 1.050 (two streams of client 0: alone)
    reqs = [req(0, [0.010, 0.002, 0.018]), req(1, [0.0115]), req(2, [0.0325]), req(0, [0.05]), req(0, [0.05])]
    late = _late_tokens(reqs, late_ms=5)
    assert (late["late"], late["late_in_one_client_only"]) == (6, 4)
    assert _late_tokens([req(0, [0.01])], late_ms=5)["late_in_one_client_only"] == 1


def test_gc_pauses_counts_each_generation_while_started():
    import gc

    from picovllm.entrypoints.openai.async_engine import GCPauses

    pauses = GCPauses().start()
    try:
        for generation in (0, 1, 1, 2):
            gc.collect(generation)
    finally:
        pauses.stop()
    # (automatic collections may add to these counts)
    assert all(n >= least for (n, _, _), least in zip(pauses.stats, (1, 2, 1))), pauses.stats
    assert all(0 < longest <= total for _, total, longest in pauses.stats)
    before = [list(s) for s in pauses.stats]
    gc.collect()
    assert pauses.stats == before  # stopped: nothing more recorded
