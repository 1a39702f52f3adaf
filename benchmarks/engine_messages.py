"""What sending one step's outputs from the engine process costs, on the CPU: a client's
EngineCoreOutputs (one new token of each request) pickled as Connection.send does
(multiprocessing's pickler); the HTTP process unpickles it. python benchmarks/engine_messages.py
[OUTPUTS]"""

import pickle
import sys
import time
from multiprocessing.reduction import ForkingPickler

from picovllm.messages import CompletionDelta, EngineCoreOutput, EngineCoreOutputs


def best_us(f, n: int = 600, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - start) / n)
    return 1e6 * best


def main(num_outputs: int = 64) -> None:
    outs = [
        EngineCoreOutput(f"cmpl-{i:032x}", [CompletionDelta(0, [1234], None, None, None)], False, 0)
        for i in range(num_outputs)
    ]
    metrics = {f"metric_{i}": i for i in range(40)}  # (LLMEngine.get_metrics' size)

    def send() -> bytes:
        return ForkingPickler.dumps(EngineCoreOutputs(outs, metrics, num_outputs))

    message = send()
    print(
        f"{num_outputs} outputs, {len(message)} bytes: the engine pickles them in {best_us(send):.0f} us, "
        f"the HTTP process unpickles them in {best_us(lambda: pickle.loads(message)):.0f} us"
    )


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
