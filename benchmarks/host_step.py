# Usage: PYTHONPATH=. python benchmarks/host_step.py [step|stream|ttft|detok|sse]  (CPU; needs the test dependencies)
"""Host time with the forward stubbed out (tiny vocab logits), on the CPU:
step: a step at batch 256: scheduler, input building, sampling tensors, sampler on 307-wide
      logits, output processing;
stream: a step at batch 64 as the server's engine process runs it: DELTA outputs, packed for the
      pipe (async_engine._message);
ttft: a prefix-cache hit as `picovllm bench prefix` scenario b times it: LLM.generate of a
      2,083 + 40-token prompt whose 2,083 are cached, max_tokens=1 (validation, scheduling with
      the prefix match, inputs, sampling, outputs);
detok: incremental detokenization per token, 64 streams;
sse: the server's CPU time per streamed token (SSE chunk) on its HTTP thread, the engine stubbed
      out (a step every 3 ms, a token for each of 64 streams), clients in processes of their own."""
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


def stream() -> None:
    from picovllm.entrypoints.openai.async_engine import _message

    llm = stubbed_llm(max_num_seqs=64)
    e = llm.llm_engine
    for i in range(64):
        e.add_request(str(i), [3 + (j * 7 + i) % 300 for j in range(512)],
                      SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
    for _ in range(40):
        [_message(o) for o in e.step()]

    def timed():
        t = time.perf_counter()
        for _ in range(50):
            [_message(o) for o in e.step()]
        return (time.perf_counter() - t) / 50
    print(f"host step + messages at batch 64 (DELTA outputs): {best_of(timed, 8) * 1e3:.2f} ms")


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


def sse() -> None:
    import queue
    import threading

    from picovllm.bench.serve import _thread_cpu_s, run_serve_bench
    from picovllm.entrypoints.openai.async_engine import _Background
    from picovllm.entrypoints.openai.server import build_app, serve_in_thread
    from picovllm.outputs import CompletionOutput, RequestOutput

    class StubEngine(_Background):
        """Every 3 ms, one more token ("ab") for each request, until its max_tokens."""
        vocab_size, max_model_len = 30000, 4096

        def __init__(self):
            super().__init__()
            self.commands, self.running = queue.SimpleQueue(), {}
            threading.Thread(target=self.run, name="picovllm-engine", daemon=True).start()

        def _send(self, cmd):
            self.commands.put(cmd)

        def get_metrics(self):
            return dict(num_running=len(self.running), num_waiting=0, kv_blocks_free=1, kv_blocks_total=1,
                        prefix_cache_hit_tokens=0, prefix_cache_queried_tokens=0)

        def run(self):
            while True:
                time.sleep(0.003)
                while not self.commands.empty():
                    cmd = self.commands.get()
                    if cmd[0] == "add":
                        self.running[cmd[1]] = (cmd[3], cmd[4].max_tokens, [])
                    else:
                        self.running.pop(cmd[1], None)
                outs = []
                for rid, (ids, max_tokens, tokens) in list(self.running.items()):
                    tokens.append(7)
                    done = len(tokens) == max_tokens
                    outs.append(RequestOutput(rid, None, ids, [CompletionOutput(
                        0, "ab" * len(tokens), list(tokens), finish_reason="length" if done else None)], done))
                    if done:
                        del self.running[rid]
                self._deliver_step(outs)

    url, stop = serve_in_thread(build_app(StubEngine(), "stub"))
    http = next(t for t in threading.enumerate() if t.name == "picovllm-http")
    for _ in range(3):
        cpu = _thread_cpu_s(http)
        summary = run_serve_bench(url, "stub", num_prompts=256, concurrency=64, input_len=16, output_len=128,
                                  client_processes=2)
        tokens = summary["output_tok_s"] * summary["seconds"]
        print(f"HTTP thread CPU per streamed token: {(_thread_cpu_s(http) - cpu) / tokens * 1e6:.1f} us")
    stop()


if __name__ == "__main__":
    {"step": step, "stream": stream, "ttft": ttft, "detok": detok, "sse": sse}[sys.argv[1] if len(sys.argv) > 1 else "step"]()
