# Usage: PYTHONPATH=. python benchmarks/host_step.py [step|ttft|detok]  (CPU; needs the test dependencies)
"""Host time with the forward stubbed out (tiny vocab logits), on the CPU:
step: a step at batch 256: scheduler, input building, sampling tensors, sampler on 307-wide
      logits, output processing;
ttft: a prefix-cache hit as `picovllm bench prefix` scenario b times it: LLM.generate of a
      2,083 + 40-token prompt whose 2,083 are cached, max_tokens=1 (validation, scheduling with
      the prefix match, inputs, sampling, outputs)."""
import sys
import tempfile
import time

import torch

sys.path.insert(0, "tests")
from tiny_models import build_model  # noqa: E402

from picovllm import LLM, RequestOutputKind, SamplingParams  # noqa: E402


def stubbed_llm(**kwargs) -> LLM:
    d = tempfile.mkdtemp()
    build_model(d, tokenizer=False, seed=0, max_position=4096)
    llm = LLM(d, device="cpu", dtype="float32", skip_tokenizer_init=True, kv_cache_memory=256 << 20, **kwargs)
    runner, vocab = llm.llm_engine.model_runner, llm.llm_engine.model_config.vocab_size

    def fake_logits(batch, pending=None):
        runner.prepare(batch, pending)
        rows = len(runner.sampling_requests(batch, 0 if pending is None else len(pending)))
        return torch.randn(rows, vocab)

    runner.logits = fake_logits
    return llm


def best_of(fn, rounds: int = 5) -> float:
    return min(fn() for _ in range(rounds))


def step() -> None:
    llm = stubbed_llm(max_num_seqs=256)
    e = llm.llm_engine
    for i in range(256):
        e.add_request(str(i), [3 + (j * 7 + i) % 300 for j in range(100 + i)],
                      SamplingParams(temperature=0.6, max_tokens=300, ignore_eos=True,
                                     output_kind=RequestOutputKind.FINAL_ONLY))
    for _ in range(5):
        e.step()

    def timed():
        t = time.perf_counter()
        for _ in range(20):
            e.step()
        return (time.perf_counter() - t) / 20
    print(f"host step at batch 256: {best_of(timed) * 1e3:.2f} ms")


def ttft() -> None:
    llm = stubbed_llm()
    prefix = [3 + (j * 7) % 300 for j in range(2083)]
    one = SamplingParams(max_tokens=1)
    llm.generate({"prompt_token_ids": prefix}, one, use_tqdm=False)
    queries = iter([{"prompt_token_ids": prefix + [5 + (q * 11 + i) % 290 for i in range(40)]} for q in range(300)])

    def timed():
        t = time.perf_counter()
        for _ in range(50):
            llm.generate(next(queries), one, use_tqdm=False)
        return (time.perf_counter() - t) / 50
    timed()  # warm-up
    print(f"host time of a warm 2,083 + 40-token request (max_tokens=1): {best_of(timed) * 1e6:.0f} us")


def detok() -> None:
    from picovllm.engine.detokenizer import Detokenizer
    from picovllm.engine.llm_engine import load_tokenizer
    from picovllm.engine.request import Request
    from picovllm.model.loader.model_loader import resolve_model

    tokenizer = load_tokenizer(resolve_model(None)[1])
    ids = tokenizer.encode(open("README.md").read())[:700]
    for name in ("DecodeStream", "windowed"):
        d = Detokenizer(tokenizer)
        if name == "windowed":
            d.backend = None

        def timed():
            reqs = [Request(str(i), str(i), 0, None, ids[i:i + 512], SamplingParams(stop=["\n\n\n"]), 0, None)
                    for i in range(64)]
            for r in reqs:
                d.start(r)
            t = time.perf_counter()
            for step in range(100):
                for r in reqs:
                    r.token_ids.append(ids[(step + 100) % 700])
                    d.step(r)
            return (time.perf_counter() - t) / 6400
        print(f"detokenizer, {name}: {best_of(timed) * 1e6:.1f} us per token")


if __name__ == "__main__":
    {"step": step, "ttft": ttft, "detok": detok}[sys.argv[1] if len(sys.argv) > 1 else "step"]()
