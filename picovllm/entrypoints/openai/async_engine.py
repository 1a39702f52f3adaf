"""The engine in the background, for asyncio servers: on a thread of this process (AsyncEngine),
or in a process of its own (EngineProcess, the server's default; vLLM's engine core runs apart
for the same reason): the engine's host work and the HTTP thread's streaming then do not take
turns on one GIL.

Both validate prompts off the event loop, take requests and aborts from HTTP handlers, deliver
each request's RequestOutputs on an asyncio queue (loop.call_soon_threadsafe, once per step for
all the streams of a loop), abort a request whose consumer stops early, and call
on_step(self, outputs) after each step (metrics; get_metrics() is the engine's).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from picovllm.engine.input_processor import PromptType, load_tokenizer, process_prompt
from picovllm.engine.llm_engine import LLMEngine
from picovllm.outputs import CompletionOutput, RequestOutput
from picovllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for q, out in items:
        q.put_nowait(out)


class EngineDeadError(RuntimeError):
    pass


@contextlib.contextmanager
def frozen_heap():
    """For a long-running server process (the HTTP one and the engine's), once the engine and app
    are built: collect, then move every object alive now (the model, the imported modules) out of
    the collector's view, as vLLM's server does, so that the full collections it triggers do not
    walk them while every stream waits (a full collection of the start-up heap took 90-125 ms on
    the H200 machine). Collectable again on the way out: Triton's bindings report objects that
    outlive them at exit as leaks."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class GCPauses:
    """The pauses of Python's garbage collector in this process while started: per generation,
    [collections, total seconds, longest seconds] (stats). The engine process sends its own with
    every step (EngineProcess.gc_pauses), so that a benchmark can tell the engine's stalls from
    the server's."""

    def __init__(self):
        self.stats = [[0, 0.0, 0.0] for _ in range(3)]
        self._began = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            took, s = time.perf_counter() - self._began, self.stats[info["generation"]]
            s[0], s[1], s[2] = s[0] + 1, s[1] + took, max(s[2], took)

    def start(self) -> GCPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def stop(self) -> None:
        gc.callbacks.remove(self._on_gc)


class _Background:
    """What both kinds share: the streams, and delivering a step's outputs to them. A subclass
    sets tokenizer, vocab_size and max_model_len, and sends commands (_send: ("add", request_id,
    text, ids, params) or ("abort", request_id)) to its engine."""

    tokenizer = None
    vocab_size: int
    max_model_len: int

    def __init__(self, on_step=None):
        self.on_step = on_step  # called after each step with (self, outputs): metrics
        self.error: BaseException | None = None
        self._streams: dict[str, _Stream] = {}

    def _send(self, cmd: tuple) -> None:
        raise NotImplementedError

    def get_metrics(self) -> dict[str, int]:
        raise NotImplementedError

    async def validate(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt off the event loop. Raises ValueError for bad input."""
        return await asyncio.to_thread(process_prompt, prompt, params, self.tokenizer, self.vocab_size,
                                       self.max_model_len)

    async def generate(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the outputs of a validated prompt (see validate) as they change; aborts the
        request if the consumer stops early."""
        if self.error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._send(("add", request_id, text, ids, params))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine has stopped: {item!r}")
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}  # one wake-up of each loop per step
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)
        if self.on_step is not None:
            self.on_step(self, outputs)

    def _fail(self, error: BaseException) -> None:
        """The engine is broken: fail every waiting stream, loudly."""
        self.error = error
        for stream in list(self._streams.values()):
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)


class AsyncEngine(_Background):
    """The engine on a thread of this process: it steps while anything is unfinished and sleeps
    on an event otherwise; commands reach it through a thread-safe queue."""

    def __init__(self, engine: LLMEngine, on_step=None):
        super().__init__(on_step)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.vocab_size, self.max_model_len = engine.model_config.vocab_size, engine.max_model_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="picovllm-engine", daemon=True)
        self._thread.start()

    def get_metrics(self) -> dict[str, int]:
        return self.engine.get_metrics()

    def _send(self, cmd: tuple) -> None:
        self._commands.put(cmd)
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop:
                applied = self._apply_commands()
                if not engine.has_unfinished_requests():
                    if applied:  # the metrics after aborts that left nothing to step
                        self._deliver_step([])
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._deliver_step(engine.step())
        except BaseException as e:
            self._fail(e)
            raise

    def _apply_commands(self) -> bool:
        applied = False
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return applied
            applied = True
            if cmd[0] == "add":
                _, rid, text, ids, params = cmd
                if rid in self._streams:  # not already abandoned by its client
                    self.engine.add_validated_request(rid, text, ids, params)
            else:
                self.engine.abort_request(cmd[1])


# ---- the engine in a process of its own -------------------------------------------------------

def _message(out: RequestOutput) -> tuple:
    """A RequestOutputKind.DELTA output as plain tuples for the pipe (a step's message does not
    grow with the length of the outputs; EngineProcess._rebuild makes it cumulative again)."""
    comps = [(c.token_ids, c.text, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason)
             for c in out.outputs]
    return out.request_id, comps, out.finished, out.num_cached_tokens


def _engine_main(engine_args: dict, commands, outputs) -> None:
    """The engine process: build the engine, report its limits, then apply commands and step
    while anything is unfinished, sending each step's output deltas and the engine's metrics.
    Ctrl-C is the server's to handle: it shuts this process down by closing the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = LLMEngine.from_engine_args(**engine_args)
    except BaseException as e:  # bad options: the server reports them and does not start
        outputs.send(("error", e))
        return
    outputs.send(("ready", {"vocab_size": engine.model_config.vocab_size, "max_model_len": engine.max_model_len,
                            "tokenizer": engine.tokenizer_source}))
    try:
        with frozen_heap():
            pauses = GCPauses().start()
            while True:
                idle = not engine.has_unfinished_requests()
                if idle:  # the metrics after aborts that left nothing to step
                    outputs.send(("step", [], engine.get_metrics(), pauses.stats, time.perf_counter()))
                while commands.poll(None if idle else 0):
                    cmd = commands.recv()
                    if cmd is None:
                        return
                    if cmd[0] == "add":
                        rid, text, ids, params = cmd[1:]
                        engine.add_validated_request(rid, text, ids, replace(params, output_kind=RequestOutputKind.DELTA))
                    else:
                        engine.abort_request(cmd[1])
                    idle = False
                if engine.has_unfinished_requests():
                    outputs.send(("step", [_message(o) for o in engine.step()], engine.get_metrics(),
                                  pauses.stats, time.perf_counter()))
    except EOFError:  # the server went away
        return
    except BaseException as e:
        outputs.send(("error", e))
        raise


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: dict[int, CompletionOutput] = field(default_factory=dict)


class EngineProcess(_Background):
    """The engine in a process of its own (spawned: CUDA does not survive a fork). Commands go
    down one pipe; each step's output deltas and metrics come up another, read on the server's
    event loop (attach), which rebuilds the cumulative RequestOutputs and delivers them. Start-up
    errors (bad engine options) are raised here."""

    def __init__(self, engine_args: dict, on_step=None):
        super().__init__(on_step)
        ctx = multiprocessing.get_context("spawn")
        commands, self._commands = ctx.Pipe(duplex=False)
        self._outputs, outputs = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_engine_main, args=(engine_args, commands, outputs),
                                    name="picovllm-engine", daemon=True)
        self._process.start()
        commands.close()
        outputs.close()
        try:
            kind, info = self._outputs.recv()
        except EOFError:  # it died before it could say why (its traceback, if any, is on stderr)
            self._process.join()
            raise RuntimeError(f"the engine process exited while starting (code {self._process.exitcode})") from None
        if kind == "error":
            self._process.join()
            raise info
        self.vocab_size, self.max_model_len = info["vocab_size"], info["max_model_len"]
        self.tokenizer = load_tokenizer(info["tokenizer"]) if info["tokenizer"] else None
        self._metrics: dict[str, int] = {}
        self.gc_pauses: list[list] | None = None  # the engine process's GCPauses.stats, as of its last step
        self.step_sent_at = 0.0  # when the engine process sent its last step (perf_counter: one clock for both)
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()  # sends come from the event loop and from shutdown
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop that reads the steps

    @property
    def pid(self) -> int:
        return self._process.pid

    def get_metrics(self) -> dict[str, int]:
        self.attach()
        return self._metrics  # as of the engine's last step

    def attach(self) -> None:
        """The steps are read on the event loop that first uses this engine (the server's start, a
        request, an abort, the metrics), when its pipe is readable: no reader thread that would
        have to take the GIL from the loop's thread while that streams the last step's tokens."""
        if self._loop is None and not self._closing:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:  # not on a loop (yet)
                return
            self._loop.add_reader(self._outputs.fileno(), self._read)

    def _detach(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(Exception):
                loop.remove_reader(self._outputs.fileno())

    def _send(self, cmd: tuple | None) -> None:
        if cmd is not None:
            self.attach()
        if cmd is not None and cmd[0] == "add":
            self._requests[cmd[1]] = _Request(cmd[2], cmd[3])
        elif cmd is not None:
            self._requests.pop(cmd[1], None)
        try:
            with self._lock:
                self._commands.send(cmd)
        except OSError as e:  # the process is gone: nothing to abort; an add fails as a dead engine
            if cmd is not None and cmd[0] == "add":
                raise EngineDeadError(f"the engine process has exited (code {self._process.exitcode})") from e

    def shutdown(self) -> None:
        self._closing = True
        self._send(None)
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
        self._detach()

    def _read(self) -> None:
        """Every step message waiting in the pipe (on the loop, when it is readable)."""
        try:
            while self._outputs.poll():
                msg = self._outputs.recv()
                if msg[0] == "error":
                    raise msg[1]
                _, deltas, self._metrics, self.gc_pauses, self.step_sent_at = msg
                self._deliver_step([out for d in deltas if (out := self._rebuild(*d)) is not None])
        except EOFError:
            self._detach()
            if not self._closing:
                self._fail(EngineDeadError(f"the engine process exited (code {self._process.exitcode})"))
        except BaseException as e:
            self._detach()
            self._fail(e)

    def _rebuild(self, request_id: str, comps: list[tuple], finished: bool, num_cached: int) -> RequestOutput | None:
        req = self._requests.get(request_id)
        if req is None:  # aborted meanwhile
            return None
        outputs = []
        for index, (tokens, text, logprobs, cumulative, reason, stop) in enumerate(comps):
            prev = req.outputs.get(index)
            if prev is not None:
                tokens, text = prev.token_ids + tokens, prev.text + text
                logprobs = None if logprobs is None else prev.logprobs + logprobs
            req.outputs[index] = CompletionOutput(index, text, tokens, cumulative, logprobs, reason, stop)
            outputs.append(req.outputs[index])
        if finished:
            del self._requests[request_id]
        return RequestOutput(request_id, req.prompt, req.prompt_token_ids, outputs, finished, num_cached)


def start_background_engine(engine_args: dict, in_process: bool = False) -> AsyncEngine | EngineProcess:
    """A server's engine: in a process of its own (the default), or on a thread of this one."""
    return AsyncEngine(LLMEngine.from_engine_args(**engine_args)) if in_process else EngineProcess(engine_args)
