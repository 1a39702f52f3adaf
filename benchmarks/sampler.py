"""The sampler at Qwen2.5's 151,936-token vocabulary, by kind of rows, on this machine's device (a
GPU if there is one): ms per call of worker/sampler.py's Sampler on random fp32 logits, each row
with a 100-token prompt and 100 tokens of output (the penalties' inputs).

Kinds: greedy; temperature 0.7; Qwen2.5-Instruct's generation config (temperature 0.7, top_p 0.8,
top_k 20, repetition_penalty 1.05: what its requests get by default); top_p 0.9 alone (the whole
vocabulary sorted); temperature 0.7 and the generation config under a grammar's bitmask (random
bits: the draw applies it, or an fp32 copy masked first).

Usage: PYTHONPATH=. python benchmarks/sampler.py [ROWS ...]  (default: 1 8 64)"""

import sys
import time

import torch

from picovllm.messages import SamplingBatch
from picovllm.sampling_params import SamplingParams
from picovllm.worker.sampler import Sampler, SamplingTensors

VOCAB = 151936
KINDS = {
    "greedy": SamplingParams(temperature=0),
    "temperature": SamplingParams(temperature=0.7),
    "Qwen2.5's generation config": SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    "top_p alone": SamplingParams(temperature=0.7, top_p=0.9),
    "temperature, a bitmask": SamplingParams(temperature=0.7),
    "the config, a bitmask": SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
}


def tensors(rows: int, params: SamplingParams, device: torch.device, masked: bool) -> SamplingTensors:
    ids = [list(range(100))] * rows
    penalties = params.has_penalties
    bits = torch.randint(-(2**31), 2**31, (rows, -(-VOCAB // 32)), dtype=torch.int64).to(torch.int32)
    batch = SamplingBatch(
        [str(i) for i in range(rows)],
        [params] * rows,
        [None] * rows,
        [100] * rows,
        ids if penalties else None,
        ids if penalties else None,
        [],
        bits if masked else None,
    )
    return SamplingTensors.from_batch(batch, [None] * rows, VOCAB, set(), device)


def main(rows_list: list[int]) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sampler = Sampler()
    print(f"{device}, ms per call: " + "; ".join(KINDS))
    for rows in rows_list:
        logits = torch.randn(rows, VOCAB, device=device) * 3
        cells = []
        for kind, params in KINDS.items():
            t = tensors(rows, params, device, masked="bitmask" in kind)
            sampler(logits, t)
            calls = 20 if device.type == "cuda" else 3
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                sampler(logits, t)
            if device.type == "cuda":
                torch.cuda.synchronize()
            cells.append(f"{(time.perf_counter() - start) / calls * 1e3:.2f}")
        print(f"{rows:4d} rows: " + " / ".join(cells), flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 8, 64])
