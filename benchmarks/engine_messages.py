"""What sending one step's outputs from the engine process costs, on the CPU: the engine builds a
client's EngineCoreOutputs and pickles it (multiprocessing's pickler, as Connection.send does);
the HTTP process unpickles it. python benchmarks/engine_messages.py [OUTPUTS]"""

import pickle
import sys
import time
from multiprocessing.reduction import ForkingPickler

from picovllm.messages import EngineCoreOutput, EngineCoreOutputs
from picovllm.outputs import CompletionOutput, RequestOutput


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
        RequestOutput(f"cmpl-{i:032x}", None, [1] * 512, [CompletionOutput(0, " tok", [1234])], False, 0)
        for i in range(num_outputs)
    ]
    metrics = {f"metric_{i}": i for i in range(40)}  # (LLMEngine.get_metrics' size)

    def send() -> bytes:
        return ForkingPickler.dumps(EngineCoreOutputs([EngineCoreOutput.of(o) for o in outs], metrics, num_outputs))

    message = send()
    print(
        f"{num_outputs} outputs, {len(message)} bytes: the engine builds and pickles them in {best_us(send):.0f} us, "
        f"the HTTP process unpickles them in {best_us(lambda: pickle.loads(message)):.0f} us"
    )


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
