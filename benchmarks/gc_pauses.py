"""The garbage collector's pauses in the engine process, on the CPU. Python collects a generation
when enough containers have been allocated since its last collection, in whatever code runs
then: a step of the engine waits for it.

python benchmarks/gc_pauses.py steps MODEL [STEPS]
    bench serve's engine half at 64 streams (prompts of 512 tokens, 128 output tokens, a step
    budget of 128, a new request as one finishes) on the CPU, MODEL a model directory (a tiny
    one: its forward is not what is timed): each generation's collections, how often, how long.
python benchmarks/gc_pauses.py tree [SEQUENCES]
    a prefix cache holding SEQUENCES distinct 640-token sequences (6,000: 3.84M tokens, about an
    H200's pool for Qwen2.5-1.5B): a full collection's time, with the start-up heap frozen as
    the server freezes it."""

import gc
import random
import sys
import time

from picovllm.sampling_params import SamplingParams


def serving_engine(model: str, device: str = "cpu", clients: int = 64):
    """bench serve's engine half: an engine of CLIENTS sequences with a step budget of 128, CLIENTS
    requests of 512 prompt tokens and 128 output tokens added, and step(), which steps it once,
    adding a request as one finishes (a closed loop)."""
    from picovllm import LLM

    engine = LLM(
        model,
        device=device,
        skip_tokenizer_init=True,
        max_num_seqs=clients,
        max_num_batched_tokens=128,
        max_model_len=1024,
    ).llm_engine
    vocab, added = engine.model_config.vocab_size, [0]

    def add() -> None:
        i = added[0] = added[0] + 1
        ids = [(100 + i * 7 + j) % vocab for j in range(512)]
        engine.add_core_request(str(i), None, ids, SamplingParams(max_tokens=128, ignore_eos=True))

    def step() -> None:
        for out in engine.step_core():
            if out.finished:
                add()

    for _ in range(clients):
        add()
    return engine, step


def serving_steps(model: str, steps: int = 3000) -> None:
    _, step = serving_engine(model)
    gc.collect()
    gc.freeze()
    pauses, started = [], [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], 1e3 * (time.perf_counter() - started[0])))

    gc.callbacks.append(timed)
    for _ in range(steps):
        step()
    gc.callbacks.remove(timed)
    for generation in (0, 1, 2):
        ms = sorted(t for g, t in pauses if g == generation)
        if ms:
            print(
                f"generation {generation}: {len(ms)} collections in {steps} steps (one in {steps / len(ms):.0f}), "
                f"ms mean {sum(ms) / len(ms):.2f} median {ms[len(ms) // 2]:.2f} max {ms[-1]:.2f}"
            )


def cached_tree(sequences: int = 6000) -> None:
    from picovllm.engine.block_manager import BlockManager
    from picovllm.engine.prefix_cache import PrefixCache
    from picovllm.engine.request import Request

    cache = PrefixCache(BlockManager(sequences * 40 + 16, 16), enabled=True)
    gc.collect()
    gc.freeze()
    rng = random.Random(0)
    for i in range(sequences):
        req = Request(str(i), str(i), 0, None, [rng.randrange(150_000) for _ in range(640)], SamplingParams(), 0, None)
        cache.allocate(req, cache.acquire(req))
        cache.insert(req, req.num_tokens)
        cache.release(req)
    del req
    gc.collect()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - start)
    print(f"{sequences} sequences of 640 tokens cached: a full collection {1e3 * best:.1f} ms (best of 5)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["steps"]:
        serving_steps(sys.argv[2], *(int(a) for a in sys.argv[3:4]))
    else:
        cached_tree(*(int(a) for a in sys.argv[2:3]))
