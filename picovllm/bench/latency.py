"""`picovllm bench latency`: decode speed at fixed batch sizes against the memory-bandwidth
ceiling, and the time to first token against its floor (bench/common.py's Floors: the prompts'
FLOPs at the measured GEMM rate, or their bytes at the copy bandwidth), optionally beside Hugging
Face transformers on the same model, dtype and device."""

from __future__ import annotations

import bisect
import functools
import time

import numpy as np

from picovllm.bench.common import (
    Floors,
    copy_bandwidth,
    decode_bytes_per_step,
    plot_latency,
    print_json,
    print_table,
    progress,
    sync,
)
from picovllm.bench.hf_baseline import HFRunner
from picovllm.sampling_params import RequestOutputKind, SamplingParams


def _prompts(batch: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, min(vocab_size, 30000), size=(batch, input_len)).tolist()


def _timed(fn, device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def full_batch_decode(stamps: list[float], firsts: list[float], finishes: list[float]) -> tuple[float, int]:
    """(seconds, steps) of a run's steps in which its whole batch decodes: from the step that gave
    the last request its first token to the step that finished the first request. stamps: each
    step's end (time.time(), taken after the step returned its outputs, whose first-token and
    finish times it stamped); firsts, finishes: the requests' first-token and finish times.

    A batch whose prompts take several steps to prefill starts decoding request by request, and
    the early requests finish early: counted to the last finish instead, the steps' batch shrank
    and the step looked shorter than the whole batch's (benchmarks/README.md, the latency
    section)."""
    start, end = bisect.bisect_left(stamps, max(firsts)), bisect.bisect_left(stamps, min(finishes))
    if end <= start:
        raise ValueError(
            f"no step decoded the whole batch of {len(firsts)}: its first request finished before the last one's "
            "first token (its prompts took that many steps to prefill); raise --output-len or --max-num-batched-tokens"
        )
    return stamps[end] - stamps[start], end - start


def _row(
    system: str,
    batch: int,
    prefill_s: float,
    total_s: float,
    output_len: int,
    step_bytes: int,
    bandwidth: float,
    decode: tuple[float, int] | None = None,
) -> dict:
    """decode: (seconds, steps) of the full run's steps at the whole batch (ours, full_batch_decode);
    else the full run's time less the prefill-only run's, output_len - 1 steps."""
    decode_s, steps = decode if decode is not None else (max(total_s - prefill_s, 1e-9), output_len - 1)
    step_s = decode_s / steps
    return {
        "system": system,
        "batch": batch,
        "ttft_ms": prefill_s * 1e3,
        "ms_per_step": step_s * 1e3,
        "decode_steps": steps,
        "decode_tok_s": batch * steps / decode_s,
        "total_tok_s": batch * output_len / total_s,
        "gb_s": step_bytes / step_s / 1e9,
        "bw_frac": step_bytes / step_s / bandwidth,
    }


class PicoRunner:
    """Our engine behind the same small interface as HFRunner."""

    def __init__(self, llm_kwargs: dict, max_batch: int):
        from picovllm import LLM

        self.llm = LLM(**llm_kwargs, max_num_seqs=max_batch, skip_tokenizer_init=True)
        engine = self.llm.llm_engine
        self.device, self.model = engine.device, engine.executor.driver.model_runner.model
        self.vocab_size = engine.model_config.vocab_size
        self.kv_token_bytes = engine.kv_block_bytes // engine.config.block_size
        # greedy, or what the model's generation config asks for (--generation-config DIR)
        self.sampling = {"temperature": 0, **engine.sampling_defaults}
        self.sampling.pop("max_tokens", None)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        """The prompts, each decoding new_tokens; then `times` holds this run's steps' ends and
        the requests' first-token and finish times, for full_batch_decode (the prompts' time, which
        varies between runs, left out: measured as the run's time less a prefill-only run's, a slow
        prefill-only run made the steps look shorter). The engine is stepped here, not through
        LLM.generate, to stamp each step's end."""
        engine = self.llm.llm_engine
        host, steps = engine.host_time_s, engine.num_steps
        self.llm.reset_prefix_cache()  # every run prefills its prompts (the warm-up ran the same ones)
        params = SamplingParams(
            **self.sampling, max_tokens=new_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )
        for p in prompts:
            engine.add_request(None, {"prompt_token_ids": p}, params)
        stamps, outputs = [], []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
            stamps.append(time.time())
            if failed := engine.take_failed():
                raise RuntimeError(f"request {failed[0][0]} failed: {failed[0][1]}")
        self.host_ms_per_step = 1e3 * (engine.host_time_s - host) / max(engine.num_steps - steps, 1)
        metrics = [o.metrics for o in outputs]
        self.times = (stamps, [m["first_token_time"] for m in metrics], [m["finished_time"] for m in metrics])


def run_latency(
    llm_kwargs: dict,
    batch_sizes: list[int],
    input_len: int,
    output_len: int,
    hf_modes: list[str],
    seed: int = 0,
    repeat: int = 1,
    plot: str | None = None,
) -> list[dict]:
    """Each system's prefill-only and full runs are timed `repeat` times, the systems taking turns
    (so that load from elsewhere on the machine falls on all of them), and the best time is kept.
    The TTFT is the prefill-only run's; our decode step, the full run's decode (PicoRunner), and
    HF's, the full run's time less the prefill-only run's.
    CPU ms/step is the host time of our engine's steps outside waiting for the device (on a GPU; on
    a CPU the whole step is, the prompts' steps included: not shown)."""
    if output_len < 2:
        raise ValueError(f"--output-len {output_len}: the decode step is timed between tokens; give at least 2")
    ours = PicoRunner(llm_kwargs, max(batch_sizes))
    if ours.sampling != {"temperature": 0}:
        if hf_modes:
            raise ValueError(
                "--hf decodes greedily and the model's generation config asks for "
                f"{ours.sampling}: add --generation-config vllm to compare"
            )
        progress(
            "sampling as the model's generation config asks: " + ", ".join(f"{k}={v}" for k, v in ours.sampling.items())
        )
    systems = [("picovllm", ours)] + [(f"hf-{mode}", HFRunner(llm_kwargs, mode)) for mode in hf_modes]
    device = ours.device
    bandwidth = copy_bandwidth(device)
    floors = Floors(ours.llm)
    rows = []
    for batch in batch_sizes:
        progress(f"batch {batch}: {input_len} prompt tokens, {output_len} decoded, {repeat} time(s) each")
        prompts = _prompts(batch, input_len, ours.vocab_size, seed)
        for _, runner in systems:
            # warm-up; compiled HF compiles here, for its longest static cache first (generate keeps
            # the largest cache size it has seen, so the timed calls do not recompile)
            runner.generate(prompts, output_len if getattr(runner, "mode", None) == "compiled" else 8)
        best = {name: [float("inf"), float("inf")] for name, _ in systems}
        host_ms, decode = float("inf"), None
        for _ in range(repeat):
            for name, runner in systems:
                best[name][0] = min(best[name][0], _timed(functools.partial(runner.generate, prompts, 1), device))
                best[name][1] = min(
                    best[name][1], _timed(functools.partial(runner.generate, prompts, output_len), device)
                )
                if runner is ours:  # (the warm-up's few new tokens may not decode the whole batch: not timed)
                    host_ms = min(host_ms, ours.host_ms_per_step)
                    run = full_batch_decode(*ours.times)
                    if decode is None or run[0] / run[1] < decode[0] / decode[1]:
                        decode = run
        for name, runner in systems:
            step_bytes = decode_bytes_per_step(runner.model, batch, input_len + output_len // 2, ours.kv_token_bytes)
            rows.append(
                _row(name, batch, *best[name], output_len, step_bytes, bandwidth, decode if runner is ours else None)
            )
            rows[-1]["host_ms_per_step"] = host_ms if runner is ours and device.type == "cuda" else None
            rows[-1]["ttft_floor_ms"] = 1e3 * floors.seconds(input_len, batch=batch)
            rows[-1]["ttft_x_floor"] = rows[-1]["ttft_ms"] / rows[-1]["ttft_floor_ms"]
    by_batch = {r["batch"]: r for r in rows if r["system"] == "picovllm"}
    for r in rows:
        r["speedup_vs_this"] = by_batch[r["batch"]]["decode_tok_s"] / r["decode_tok_s"]
    print_table(
        rows,
        [
            ("system", "system", ""),
            ("batch", "batch", "d"),
            ("ttft_ms", "TTFT ms", ".1f"),
            ("ttft_x_floor", "x floor", ".1f"),
            ("ms_per_step", "ms/step", ".3f"),
            ("decode_tok_s", "decode tok/s", ".1f"),
            ("total_tok_s", "total tok/s", ".1f"),
            ("gb_s", "GB/s", ".1f"),
            ("bw_frac", "of copy BW", ".1%"),
            ("host_ms_per_step", "CPU ms/step", ".3f"),
            ("speedup_vs_this", "picovllm x", ".2f"),
        ],
    )
    print(
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, GEMMs {floors.flop_s / 1e12:.3g} TFLOP/s on {device}; prompt "
        f"{input_len}, output {output_len}, best of {repeat}; TTFT x floor: against the larger of the prompts' "
        "FLOPs at that rate and their bytes at that bandwidth"
    )
    print_json(
        "latency",
        {
            "model": llm_kwargs.get("model"),
            "device": str(device),
            "copy_bandwidth_gb_s": bandwidth / 1e9,
            "matmul_tflop_s": floors.flop_s / 1e12,
            "input_len": input_len,
            "output_len": output_len,
            "repeat": repeat,
            "results": rows,
        },
    )
    if plot:
        plot_latency(rows, plot)
    return rows
