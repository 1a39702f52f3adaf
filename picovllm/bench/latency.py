"""`picovllm bench latency`: decode speed at fixed batch sizes against the memory-bandwidth
ceiling, optionally beside Hugging Face transformers on the same model, dtype and device."""
from __future__ import annotations

import time

import numpy as np
import torch

from picovllm.bench.common import copy_bandwidth, decode_bytes_per_step, print_json, print_table, sync
from picovllm.bench.hf_baseline import HFRunner
from picovllm.sampling_params import SamplingParams


def _prompts(batch: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, min(vocab_size, 30000), size=(batch, input_len)).tolist()


def _timed(fn, device, repeat: int) -> float:
    """Best of `repeat` runs: the least disturbed by other load on the machine."""
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _row(system: str, batch: int, prefill_s: float, total_s: float, output_len: int, step_bytes: int,
         bandwidth: float) -> dict:
    steps = output_len - 1
    decode_s = max(total_s - prefill_s, 1e-9)
    step_s = decode_s / steps
    return {"system": system, "batch": batch, "ttft_ms": prefill_s * 1e3, "ms_per_step": step_s * 1e3,
            "decode_tok_s": batch * steps / decode_s, "total_tok_s": batch * output_len / total_s,
            "gb_s": step_bytes / step_s / 1e9, "bw_frac": step_bytes / step_s / bandwidth}


def _measure_picovllm(llm_kwargs: dict, batch_sizes: list[int], input_len: int, output_len: int, seed: int,
                      repeat: int) -> tuple[list[dict], torch.device, float, int]:
    from picovllm import LLM

    llm = LLM(**llm_kwargs, max_num_seqs=max(batch_sizes), skip_tokenizer_init=True)
    engine = llm.llm_engine
    device, model = engine.device, engine.model_runner.model
    bandwidth = copy_bandwidth(device)
    kv_token_bytes = engine.model_runner.kv_block_bytes() // engine.config.block_size
    context = input_len + output_len // 2
    rows = []
    for batch in batch_sizes:
        prompts = [{"prompt_token_ids": p} for p in _prompts(batch, input_len, engine.model_config.vocab_size, seed)]

        def run(n: int) -> None:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

        run(8)  # warm-up
        prefill, total = _timed(lambda: run(1), device, repeat), _timed(lambda: run(output_len), device, repeat)
        step_bytes = decode_bytes_per_step(model, batch, context, kv_token_bytes)
        rows.append(_row("picovllm", batch, prefill, total, output_len, step_bytes, bandwidth))
    return rows, device, bandwidth, kv_token_bytes


def _measure_hf(llm_kwargs: dict, mode: str, batch_sizes: list[int], input_len: int, output_len: int, seed: int,
                repeat: int, bandwidth: float, kv_token_bytes: int) -> list[dict]:
    hf = HFRunner(llm_kwargs, mode)
    rows = []
    for batch in batch_sizes:
        ids = torch.tensor(_prompts(batch, input_len, hf.vocab_size, seed), device=hf.device)
        hf.generate(ids, 8)  # warm-up (and compilation)
        prefill = _timed(lambda: hf.generate(ids, 1), hf.device, repeat)
        total = _timed(lambda: hf.generate(ids, output_len), hf.device, repeat)
        step_bytes = decode_bytes_per_step(hf.model, batch, input_len + output_len // 2, kv_token_bytes)
        rows.append(_row(f"hf-{mode}", batch, prefill, total, output_len, step_bytes, bandwidth))
    return rows


def run_latency(llm_kwargs: dict, batch_sizes: list[int], input_len: int, output_len: int,
                hf_modes: list[str], seed: int = 0, repeat: int = 1) -> list[dict]:
    rows, device, bandwidth, kv_token_bytes = _measure_picovllm(llm_kwargs, batch_sizes, input_len, output_len,
                                                                seed, repeat)
    for mode in hf_modes:
        rows += _measure_hf(llm_kwargs, mode, batch_sizes, input_len, output_len, seed, repeat, bandwidth,
                            kv_token_bytes)
    ours = {r["batch"]: r for r in rows if r["system"] == "picovllm"}
    for r in rows:
        r["speedup_vs_this"] = ours[r["batch"]]["decode_tok_s"] / r["decode_tok_s"]
    print_table(rows, [("system", "system", ""), ("batch", "batch", "d"), ("ttft_ms", "TTFT ms", ".1f"),
                       ("ms_per_step", "ms/step", ".3f"), ("decode_tok_s", "decode tok/s", ".1f"),
                       ("total_tok_s", "total tok/s", ".1f"), ("gb_s", "GB/s", ".1f"),
                       ("bw_frac", "of copy BW", ".1%"), ("speedup_vs_this", "picovllm x", ".2f")])
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s on {device}; prompt {input_len}, output {output_len}, "
          f"best of {repeat}")
    print_json("latency", {"model": llm_kwargs.get("model"), "device": str(device),
                           "copy_bandwidth_gb_s": bandwidth / 1e9, "input_len": input_len,
                           "output_len": output_len, "repeat": repeat, "results": rows})
    return rows
