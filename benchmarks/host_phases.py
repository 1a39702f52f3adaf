"""Where the engine's host time goes in a step: `bench structured`'s two runs (a batch decoding
unconstrained, then each request under a JSON schema) with a timer around each phase of a step,
printed as wall and CPU milliseconds per step of the thread that ran it (the main thread, or the
bitmask filler's). A phase's wall time above its CPU time is waiting: for the device (the
samples' event), for a lock or the GIL, or for another thread (the bitmask). Phases nest
(`next_step` holds the launch, which holds the forward's launch), so they do not add up.

python benchmarks/host_phases.py [--model M] [--tokenizer DIR] [--batch-size B] [--output-len N]
(a dummy model needs --tokenizer: the default model's directory serves.)"""

from __future__ import annotations

import argparse
import functools
import threading
import time
from collections import defaultdict

import picovllm.bench.structured as bench
import picovllm.engine.core_output_processor as core_output_processor
import picovllm.engine.llm_engine as llm_engine
import picovllm.engine.output_processor as output_processor
import picovllm.engine.scheduler as scheduler
import picovllm.engine.step_launcher as step_launcher
import picovllm.engine.structured_output as structured_output
import picovllm.executor.executor as executor
import picovllm.messages as messages
import picovllm.worker.cuda_graph as cuda_graph
import picovllm.worker.inputs as inputs
import picovllm.worker.model_runner as model_runner
import picovllm.worker.sampler as sampler

PHASES = [  # (owner, attribute): the attribute is replaced by a timed wrapper
    (llm_engine.LLMEngine, "_step"),
    (step_launcher.StepLauncher, "next_step"),
    (step_launcher.StepLauncher, "_schedule_ahead"),
    (scheduler.Scheduler, "schedule_ahead"),
    (step_launcher, "step_inputs"),
    (step_launcher.StepLauncher, "_sampling_batch"),
    (executor.Executor, "execute_step"),
    (model_runner.ModelRunner, "step_logits"),
    (model_runner.ModelRunner, "prepare"),
    (inputs, "_tokens"),
    (inputs.Uploader, "__call__"),
    (cuda_graph._GraphSet, "run"),
    (model_runner.ModelRunner, "_sampling_tensors"),
    (sampler.Sampler, "__call__"),
    (sampler, "masked_fp32"),
    (model_runner, "pinned_to"),
    (messages.ModelRunnerOutput, "wait"),
    (step_launcher.StepLauncher, "take_tokens"),
    (step_launcher, "accept_tokens"),
    (structured_output.BitmaskFiller, "start"),
    (structured_output.BitmaskFiller, "_fill"),
    (step_launcher.StepLauncher, "sample_deferred"),
    (executor.Executor, "sample_deferred"),
    (core_output_processor.CoreOutputProcessor, "process"),
    (output_processor.OutputProcessor, "process"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:qwen2.5-1.5b")
    ap.add_argument("--tokenizer")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    args = ap.parse_args()

    wall, cpu = defaultdict(float), defaultdict(float)  # (run, phase) -> seconds
    run = ["warm-up"]
    main_thread = threading.main_thread()

    def timed(owner, name: str) -> None:
        f = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner)}.{name}".removeprefix("picovllm.")

        @functools.wraps(f)
        def wrapper(*a, **k):
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return f(*a, **k)
            finally:
                key = (run[0], label + ("" if threading.current_thread() is main_thread else " [thread]"))
                wall[key] += time.perf_counter() - start
                cpu[key] += time.thread_time() - start_cpu

        setattr(owner, name, wrapper)

    for owner, name in PHASES:
        timed(owner, name)
    progress = bench.progress

    def next_run(message: str) -> None:  # (the bench announces each run)
        run[0] = "json schema" if "json schema" in message else "unconstrained"
        progress(message)

    bench.progress = next_run
    kw = {"model": args.model, "max_num_seqs": args.batch_size}
    if args.tokenizer:
        kw["tokenizer"] = args.tokenizer
    result = bench.run_structured(kw, args.batch_size, args.input_len, args.output_len)
    for r in result["runs"]:
        steps = r["seconds"] * 1e3 / r["ms_per_step"]
        print(f"\n{r['run']}: {r['ms_per_step']:.3f} ms per step; per step, ms of wall / CPU time:")
        for (name, phase), seconds in sorted(wall.items(), key=lambda kv: -kv[1]):
            if name == r["run"]:
                print(f"  {phase:48s} {1e3 * seconds / steps:7.3f} {1e3 * cpu[name, phase] / steps:7.3f}")


if __name__ == "__main__":
    main()
