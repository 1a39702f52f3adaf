"""`picovllm bench structured`: what structured outputs cost. A batch of requests decodes the
same number of tokens twice, unconstrained and then each under a JSON schema that no answer of
that length completes (a list of at least 1,000 records: objects, strings, integers), so that
both runs have the same shape: the difference is the masks (filled on the host, applied as the
sampler draws) and the steps no longer launched ahead. Both sample at temperature 0.6, or under
the model's generation config when it has one (--generation-config: a Qwen-Instruct model's
top-k, top-p and repetition penalty). The two runs take turns `repeat` times; the best
of each is kept (the host's noise only ever adds). Also: the time to build the grammar compiler
(once per engine) and to compile a typical schema (a tool's arguments)."""

from __future__ import annotations

import json
import time

import numpy as np
import torch

from picovllm.bench.common import print_json, print_table, progress, sync
from picovllm.sampling_params import SamplingParams, StructuredOutputsParams

LONG = {  # (never complete within the benchmark's output length)
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["id", "name", "tags"],
                "additionalProperties": False,
            },
            "minItems": 1000,
        }
    },
    "required": ["records"],
    "additionalProperties": False,
}
TYPICAL = {  # a tool's arguments
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "city and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include": {"type": "array", "items": {"enum": ["wind", "rain", "uv"]}},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}


def run_structured(
    llm_kwargs: dict, batch_size: int, input_len: int, output_len: int, seed: int = 0, repeat: int = 1
) -> dict:
    from picovllm import LLM

    llm = LLM(**llm_kwargs)
    engine = llm.llm_engine
    if engine.tokenizer is None:
        raise ValueError("structured outputs need a tokenizer: give --tokenizer DIR for a dummy model")
    rng = np.random.default_rng(seed)
    vocab = min(engine.model_config.vocab_size, 30000)
    prompts = [{"prompt_token_ids": rng.integers(100, vocab, size=input_len).tolist()} for _ in range(batch_size)]
    sampling = {"temperature": 0.6, **engine.sampling_defaults}  # (the model's generation config's, if any)
    sampling.pop("max_tokens", None)
    free = SamplingParams(**sampling, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    engine.structured.compile(StructuredOutputsParams(json={"type": "object"}))  # (the compiler, once)
    compiler_s = time.perf_counter() - start
    start = time.perf_counter()
    engine.structured.compile(StructuredOutputsParams(json=TYPICAL))
    compile_s = time.perf_counter() - start
    constrained = SamplingParams(
        **sampling, max_tokens=output_len, structured_outputs=StructuredOutputsParams(json=json.dumps(LONG))
    )
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    llm.generate(
        prompts[:2], SamplingParams(max_tokens=4, structured_outputs=constrained.structured_outputs), use_tqdm=False
    )
    runs = {"unconstrained": free, "json schema": constrained}
    times: dict[str, list[tuple[float, int, list]]] = {name: [] for name in runs}
    for i in range(repeat):  # (the two runs take turns; the best of each is kept)
        for name, params in runs.items():
            progress(f"{batch_size} requests decoding {output_len} tokens, {name} ({i + 1} of {repeat})")
            torch.manual_seed(seed)  # (the same samples, run after run: the grammars' states with them)
            sync(engine.device)
            steps, start = engine.num_steps, time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            sync(engine.device)
            times[name].append((time.perf_counter() - start, engine.num_steps - steps, outputs))
    rows = []
    for name, runs_of_name in times.items():
        seconds, steps, outputs = min(runs_of_name, key=lambda t: t[0] / t[1])
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rows.append(
            {
                "run": name,
                "tokens": tokens,
                "seconds": seconds,
                "ms_per_step": 1e3 * seconds / steps,
                "output_tok_s": tokens / seconds,
                "lengths": sum(o.outputs[0].finish_reason == "length" for o in outputs),
                "ms_per_step_each": [1e3 * t / n for t, n, _ in runs_of_name],
            }
        )
    rows[1]["vs_unconstrained"] = rows[1]["ms_per_step"] / rows[0]["ms_per_step"]
    print_table(
        rows,
        [
            ("run", "run", ""),
            ("tokens", "tokens", "d"),
            ("seconds", "time s", ".2f"),
            ("ms_per_step", "ms/step", ".3f"),
            ("output_tok_s", "output tok/s", ".1f"),
            ("lengths", "ended by length", "d"),
            ("vs_unconstrained", "step x", ".3f"),
        ],
    )
    each = "; ".join(f"{r['run']} " + ", ".join(f"{t:.3f}" for t in r["ms_per_step_each"]) for r in rows)
    print(f"best of {repeat} (ms/step of each run: {each})")
    print(f"grammar compiler built in {1e3 * compiler_s:.0f} ms; a typical schema compiled in {1e3 * compile_s:.1f} ms")
    result = {"model": llm_kwargs.get("model"), "device": str(engine.device), "batch_size": batch_size,
              "input_len": input_len, "output_len": output_len, "compiler_ms": 1e3 * compiler_s,
              "typical_schema_compile_ms": 1e3 * compile_s, "repeat": repeat, "sampling": sampling,
              "runs": rows}  # fmt: skip
    print_json("structured", result)
    return result
