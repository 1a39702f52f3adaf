"""`picovllm bench throughput`: offline throughput on the workload nano-vllm and mini-sglang
publish: 256 requests, prompt and output lengths uniform in [100, 1024], ignore_eos, T=0.6."""

from __future__ import annotations

import time

import numpy as np

from picovllm.bench.common import print_json, print_table, sync
from picovllm.sampling_params import SamplingParams


def workload(
    vocab_size: int, num_prompts: int, min_len: int, max_len: int, seed: int = 0
) -> tuple[list[list[int]], list[SamplingParams]]:
    """The requests' prompt token ids and sampling parameters: lengths uniform in [min_len,
    max_len], random tokens, temperature 0.6, ignore_eos (also benchmarks/kernels/profile_decode.py
    throughput's)."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(min_len, max_len + 1, size=num_prompts)
    out_lens = rng.integers(min_len, max_len + 1, size=num_prompts)
    vocab = min(vocab_size, 30000)
    prompts = [rng.integers(100, vocab, size=n).tolist() for n in in_lens]
    return prompts, [SamplingParams(temperature=0.6, max_tokens=int(n), ignore_eos=True) for n in out_lens]


def run_throughput(llm_kwargs: dict, num_prompts: int, min_len: int, max_len: int, seed: int = 0) -> dict:
    from picovllm import LLM

    llm = LLM(**llm_kwargs, skip_tokenizer_init=True)
    engine = llm.llm_engine
    ids, params = workload(engine.model_config.vocab_size, num_prompts, min_len, max_len, seed)
    prompts = [{"prompt_token_ids": p} for p in ids]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    sync(engine.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    sync(engine.device)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "system": "picovllm",
        "requests": num_prompts,
        "seconds": elapsed,
        "output_tok_s": generated / elapsed,
        "total_tok_s": (generated + sum(map(len, ids))) / elapsed,
        "preemptions": engine.scheduler.num_preemptions,
    }
    print_table(
        [result],
        [
            ("system", "system", ""),
            ("requests", "requests", "d"),
            ("seconds", "time s", ".2f"),
            ("output_tok_s", "output tok/s", ".1f"),
            ("total_tok_s", "total tok/s", ".1f"),
            ("preemptions", "preemptions", "d"),
        ],
    )
    print_json(
        "throughput",
        {
            "model": llm_kwargs.get("model"),
            "device": str(engine.device),
            "min_len": min_len,
            "max_len": max_len,
            **result,
        },
    )
    return result
