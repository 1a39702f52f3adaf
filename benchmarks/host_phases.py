"""Where the engine's host time goes in a step: `bench structured`'s two runs (a batch decoding
unconstrained, then each request under a JSON schema) with a timer around each phase of a step,
printed as wall and CPU milliseconds per step of the thread that ran it (the main thread, or the
bitmask filler's). A phase's wall time above its CPU time is waiting: for the device (the
samples' event), for a lock or the GIL, or for another thread (the bitmask). Phases nest
(`next_step` holds the launch, which holds the forward's launch), so they do not add up.

python benchmarks/host_phases.py [--model M] [--tokenizer DIR] [--batch-size B] [--output-len N]
(a dummy model needs --tokenizer: the default model's directory serves.)

python benchmarks/host_phases.py --serve [--model M] [--device D] [--steps N] [--warmup W]
    the engine under bench serve's closed loop instead (gc_pauses.py's serving_engine: 64 streams,
    prompts of 512 tokens, 128 output tokens, a step budget of 128), N steps after W (300),
    Python's heap frozen as the server freezes it. On a CPU (a tiny model's directory as M: its
    forward is not what is timed) the forward and the sampler compute
    (ModelRunner.step_logits less its prepare, Sampler.__call__): the host's own work is the rest,
    printed as a line of its own."""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
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
    ap.add_argument("--serve", action="store_true", help="the engine under bench serve's closed loop")
    ap.add_argument("--device", default=None, help="(--serve) the engine's device (default: cuda if there is one)")
    ap.add_argument("--steps", type=int, default=1500, help="(--serve) steps timed")
    ap.add_argument("--warmup", type=int, default=300, help="(--serve) steps before them")
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
    if args.serve:
        serve(args, run, wall, cpu)
        return
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


def serve(args, run: list[str], wall: dict, cpu: dict) -> None:
    """host_phases.py --serve: the phases per step of the engine under bench serve's closed loop."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gc_pauses import serving_engine

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine, step = serving_engine(args.model, device)
    for _ in range(args.warmup):
        step()
    gc.collect()
    gc.freeze()
    run[0] = "serve"
    start, start_cpu, steps = time.perf_counter(), time.thread_time(), engine.num_steps
    for _ in range(args.steps):
        step()
    steps = engine.num_steps - steps
    seconds, seconds_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    each = f"{1e3 * seconds / steps:.3f} ms of wall and {1e3 * seconds_cpu / steps:.3f} of CPU time each"
    print(f"\n{steps} steps, {each}")
    if device == "cpu":
        computed = sum(
            cpu["serve", label] * sign
            for label, sign in (("ModelRunner.step_logits", 1), ("ModelRunner.prepare", -1), ("Sampler.__call__", 1))
        )
        own = 1e3 * (seconds_cpu - computed) / steps
        print(f"without the forward and the sampler (computed on the CPU): {own:.3f} ms of CPU")
    print("per step, ms of wall / CPU time:")
    for (name, phase), seconds in sorted(wall.items(), key=lambda kv: -kv[1]):
        if name == "serve":
            print(f"  {phase:48s} {1e3 * seconds / steps:7.3f} {1e3 * cpu[name, phase] / steps:7.3f}")


if __name__ == "__main__":
    main()
