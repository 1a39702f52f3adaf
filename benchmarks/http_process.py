"""The HTTP process alone, on any machine: the real server (build_app), its EngineClient and pipes,
against a stand-in engine process that sends one token for every request it holds each STEP_MS
milliseconds, at its own pace whatever the HTTP process does (as an engine process steps), and
`picovllm bench serve --base-url` driving it from a third process. No model runs: what the HTTP
process spends per engine step (reading the step's message, detokenizing, delivering to the
streams, SSE events) is measured apart from the engine's work, which on a CPU machine would
share its cores.

Prints bench serve's summary lines and the HTTP process's CPU per engine step and per request
output (a step's output for one request), from the 20th step to the last.

Usage: PYTHONPATH=. python benchmarks/http_process.py TOKENIZER [--concurrency 64] [--step-ms 4]
       [--output-len 128] [--num-prompts N]  (a step period below the HTTP process's CPU per step
       leaves it behind: a stream's tokens then come several to an event)"""

import argparse
import multiprocessing
import subprocess
import sys
import time


def stand_in_engine(commands, outputs, tokenizer: str, step_s: float) -> None:
    """An engine process's messages without an engine: EngineReady, then an EngineCoreOutputs
    every step_s with one token for each request added and not finished: the ids of a text (the
    json module's docstring, tokenized by the tokenizer given), in turn, so that the detokenizer
    sees what a model writes (ids picked from the vocabulary's first bytes would each be a piece
    of a character: nothing to show until it completes, a window that grows)."""
    import json

    from picovllm.engine.input_processor import load_tokenizer
    from picovllm.messages import (
        AbortRequest,
        AddRequest,
        CompletionDelta,
        EngineCoreOutput,
        EngineCoreOutputs,
        EngineReady,
        StopEngine,
    )

    text_ids = load_tokenizer(tokenizer).encode(json.__doc__, add_special_tokens=False)
    metrics = {"num_running": 0, "num_waiting": 0, "kv_blocks_free": 1, "kv_blocks_cached": 0, "kv_blocks_total": 1}
    outputs.send(EngineReady(200_000, 4096, tokenizer, "both", 16, 5.0, {}, metrics, {}))
    left: dict[str, int] = {}  # request id -> tokens still to send
    step, due = 0, time.perf_counter()
    while True:
        while commands.poll():
            match commands.recv():
                case AddRequest(request_id, _, _, params, _):
                    left[request_id] = params.max_tokens
                case AbortRequest(request_id):
                    left.pop(request_id, None)
                case StopEngine():
                    return
        now = time.perf_counter()
        if now < due:
            time.sleep(min(due - now, 0.001))
            continue
        due = due + step_s if left else now + step_s
        outs = []
        for request_id in list(left):
            left[request_id] -= 1
            done = left[request_id] == 0
            if done:
                del left[request_id]
            delta = CompletionDelta(0, [text_ids[step % len(text_ids)]], None, "length" if done else None, None)
            outs.append(EngineCoreOutput(request_id, [delta], done, 0, None, None))
        if outs:
            step += 1
            outputs.send(EngineCoreOutputs(outs, {**metrics, "num_running": len(left)}, len(left)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tokenizer")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=4.0)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=None, help="(default: 10 x concurrency)")
    args = ap.parse_args()

    from picovllm.entrypoints.openai.async_engine import EngineClient
    from picovllm.entrypoints.openai.server import build_app, serve_in_thread

    ctx = multiprocessing.get_context("spawn")
    cmd_out, cmd_in = ctx.Pipe(duplex=False)
    out_out, out_in = ctx.Pipe(duplex=False)
    engine_process = ctx.Process(
        target=stand_in_engine, args=(cmd_out, out_in, args.tokenizer, args.step_ms / 1e3), daemon=True
    )
    engine_process.start()
    counts = [0, 0]  # steps read, request outputs read

    def on_step(_, outs) -> None:
        counts[0] += 1
        counts[1] += len(outs)

    engine = EngineClient(cmd_in, out_out, on_step=on_step)
    url, stop = serve_in_thread(build_app(engine, "stand-in", web_ui=False))
    client = subprocess.Popen(
        [sys.executable, "-P", "-m", "picovllm.entrypoints.cli", "bench", "serve", "--base-url", url]
        + ["--model", "stand-in", "--tokenizer", args.tokenizer, "--concurrency", str(args.concurrency)]
        + ["--num-prompts", str(args.num_prompts or 10 * args.concurrency), "--input-len", "64"]
        + ["--output-len", str(args.output_len)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while counts[0] < 20 and client.poll() is None:
        time.sleep(0.01)
    cpu, (steps, outs) = time.process_time(), tuple(counts)
    client.wait()
    cpu, steps, outs = time.process_time() - cpu, counts[0] - steps, counts[1] - outs
    out, err = client.communicate()
    lines = [line for line in out.splitlines() if "req/s" in line or line.lstrip().startswith(("TPOT", "ITL"))]
    print("\n".join(lines) or err[-3000:])
    print(
        f"HTTP process CPU: {1e3 * cpu / max(steps, 1):.3f} ms per engine step, {1e6 * cpu / max(outs, 1):.1f} us "
        f"per request output ({steps} steps, {outs} outputs, step period {args.step_ms} ms)"
    )
    engine.shutdown()
    stop()
    engine_process.join(timeout=10)


if __name__ == "__main__":
    main()
