"""The engine in the background, for asyncio servers: on a thread of this process (AsyncEngine),
or in a process of its own (EngineProcess, the server's default; vLLM's engine core runs apart
for the same reason): the engine's host work and the HTTP thread's streaming then do not take
turns on one GIL. Both run the same command loop (engine_loop). An engine process serves one
HTTP process or several (`--api-server-count`, as vLLM's): each talks to it through a pair of
pipes of its own (EngineClient), and gets the outputs of the requests it sent.

The engine sends what changed in its requests as token ids (EngineCoreOutputs); each side that
reads them has its own OutputProcessor (engine/output_processor.py), which decodes the text,
finds stop strings (the engine is told to stop such a request: FinishRequest) and builds the
RequestOutputs: in an HTTP process, off the engine's process, as vLLM's front end does.

Both validate prompts off the event loop, take requests and aborts from HTTP handlers, deliver
each request's RequestOutputs (in its params' output kind; the server asks for DELTA) on an asyncio
queue (loop.call_soon_threadsafe, once per step for all the streams of a loop), abort a request
whose consumer stops early, and call on_step(self, outputs) after each step when it is set
(bench serve's probe; the server's metrics read get_metrics(), the engine's, when scraped).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import multiprocessing.connection
import queue
import signal
import threading
import time
from collections.abc import Callable

from picovllm.engine.input_processor import PromptType, import_tokenizer_library, load_tokenizer, process_prompt
from picovllm.engine.llm_engine import LLMEngine
from picovllm.engine.output_processor import OutputProcessor
from picovllm.kv_transfer_params import KVTransferParams
from picovllm.logger import configure_logging
from picovllm.messages import (
    AbortRequest,
    AddRequest,
    EngineCommand,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineDead,
    EngineReady,
    FinishRequest,
    RequestsFailed,
    StopEngine,
)
from picovllm.outputs import RequestOutput
from picovllm.sampling_params import RequestOutputKind, SamplingParams


class RequestStream:
    """A started request's outputs, iterated as the engine delivers them (async for). Whoever
    starts a request closes its stream (close(): aborts the request unless it has finished);
    iterating to the end closes it too. Outputs that arrive before the reader takes the one
    waiting are merged into it (RequestOutput.add, as vLLM's RequestOutputCollector does): a reader
    that falls behind (a busy HTTP process) sends one event for several steps instead of a burst
    of them, and costs less the further behind it is."""

    def __init__(self, engine: _Background, request_id: str, aggregate: bool):
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self._output: RequestOutput | None = None  # (delivered, not yet read)
        self._error: BaseException | None = None  # (raised once the output before it is read)
        self._ready = asyncio.Event()
        self._engine, self._aggregate, self._finished, self._aborted = engine, aggregate, False, False

    def put(self, item: RequestOutput | BaseException) -> None:
        """On the stream's loop: the engine's next output for it, or the error that ends it."""
        if isinstance(item, BaseException):
            self._error = self._error or item
        elif self._output is None:
            self._output = item
        else:
            self._output.add(item, self._aggregate)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        while self._output is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        item, self._output = self._output, None
        if item is None:
            item = self._error
            self._finish()
            if isinstance(item, RequestFailedError):
                raise item  # (the engine has finished it)
            raise EngineDeadError(f"the engine has stopped: {item!r}")  # (nothing left to abort)
        if item.finished:
            self._finish()
        return item

    def _finish(self) -> None:
        self._finished = True
        self._engine._streams.pop(self.request_id, None)

    def close(self) -> None:
        if not self._finished:
            self.abandon()

    def abandon(self) -> None:
        """Its client has gone: the request is aborted, even if it has finished (the engine frees
        what it still holds for it; an abort of a request it has forgotten does nothing)."""
        self._finish()
        if not self._aborted:
            self._aborted = True
            self._engine.abort(self.request_id)


def _deliver(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.put(out)


class EngineError(RuntimeError):
    """A request that cannot finish: the engine is gone (EngineDeadError), or the step it was in
    failed (RequestFailedError)."""


class EngineDeadError(EngineError):
    pass


class RequestFailedError(EngineError):
    pass


@contextlib.contextmanager
def frozen_heap():
    """For a long-running server process (the HTTP one and the engine's), once the engine and app
    are built: collect, then move every object alive now (the model, the imported modules) out of
    the collector's view, as vLLM's server does, so that the full collections it triggers do not
    walk them while every stream waits (a full collection of the start-up heap takes tens of
    milliseconds). Collectable again on the way out: Triton's bindings report objects that
    outlive them at exit as leaks."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


KV_POLL_S = 0.01  # the longest an engine with nothing to step waits before it looks at its KV transfers again
KV_POLL_FIRST_S = 0.0002  # the first such waits (a pull may land any moment): 50 of them, then each twice the last


def engine_loop(
    engine: LLMEngine,
    next_command: Callable[[float | None], EngineCommand | None],
    publish: Callable[[list[EngineCoreOutput]], None],
    fail: Callable[[list[tuple[str, str]]], None],
) -> None:
    """Apply commands and step while anything is unfinished, publishing each step's outputs (the
    engine's, EngineCoreOutputs: the server reads them with an OutputProcessor of its own).
    next_command(timeout) returns the next command, or None when none came within timeout
    seconds (None: wait for one). The loop waits for commands only while no step can run: for
    ever when the engine is idle; when it has transfers to watch or requests that wait on them
    (a decode instance's pulls, a prefill instance's leases), KV_POLL_FIRST_S for the first 10 ms,
    then doubling up to KV_POLL_S, and a step then polls them. While nothing steps it publishes an empty list only
    when the engine's metrics have changed (the metrics after aborts, a lease that ended).
    Returns at StopEngine."""
    polls = 0  # waits in a row with nothing stepped
    published = None  # the metrics last published while nothing stepped
    while True:
        if engine.has_unfinished_requests() and not polls:
            wait = 0
        elif engine.has_unfinished_requests() or engine.kv_busy:
            wait = min(KV_POLL_S, KV_POLL_FIRST_S * 2 ** max(0, polls - 50))
        else:
            wait = None
        while (cmd := next_command(wait)) is not None:
            match cmd:
                case StopEngine():
                    return
                case AddRequest(rid, text, ids, params, kv):
                    engine.add_core_request(rid, text, ids, params, kv)
                case AbortRequest(rid):
                    engine.abort_request(rid)
                case FinishRequest(completions):
                    engine.finish_completions(completions)
            wait, polls = 0, 0
        if engine.has_unfinished_requests() or engine.kv_busy:
            steps = engine.num_steps
            outputs = engine.step_core()
            if failed := engine.take_failed():  # (a step that raised: its requests, and why)
                fail(failed)
            if outputs or engine.num_steps != steps:
                publish(outputs)
                published, polls = None, 0
                continue
            polls = min(polls + 1, 64)
        metrics = engine.get_metrics()
        if metrics != published:
            publish([])
            published = metrics


class _Background:
    """What both kinds share: the streams, and delivering a step's outputs to them. A subclass
    sets tokenizer, vocab_size, max_model_len and the rest below, and sends commands (_send: AddRequest,
    AbortRequest, StopEngine) to its engine."""

    tokenizer = None
    vocab_size: int
    max_model_len: int
    kv_role: str
    kv_compat: dict
    block_size: int
    kv_lease_s: float
    sampling_defaults: dict  # (LLMEngine.sampling_defaults)

    def __init__(self, on_step=None):
        self.on_step = on_step  # called after each step with (self, outputs) (bench serve)
        self.error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}
        self.reader: OutputProcessor  # (the engine's outputs into RequestOutputs: set with the tokenizer)

    def _send(self, cmd: EngineCommand) -> None:
        raise NotImplementedError

    @property
    def num_open_requests(self) -> int:
        """Requests started and not finished (their streams open)."""
        return len(self._streams)

    def get_metrics(self) -> dict[str, int]:
        raise NotImplementedError

    async def validate(
        self, prompt: PromptType, params: SamplingParams, kv_transfer_params: KVTransferParams | None = None
    ) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt (and its kv_transfer_params) off the event loop. Raises
        ValueError for bad input."""
        text, ids = await asyncio.to_thread(
            process_prompt, prompt, params, self.tokenizer, self.vocab_size, self.max_model_len
        )
        if kv_transfer_params is not None:
            kv_transfer_params.check(self.kv_role, self.block_size, len(ids), params)
        return text, ids

    def generate(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> RequestStream:
        """Start a validated prompt (see validate) now: its stream of outputs, as they change
        (close it: see RequestStream)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        aggregate = params.output_kind is RequestOutputKind.DELTA
        stream = self._streams[request_id] = RequestStream(self, request_id, aggregate)
        self.reader.add(request_id, text, ids, params)
        try:
            self._send(AddRequest(request_id, text, ids, params, kv_transfer_params))
        except BaseException:
            self.reader.abort(request_id)
            self._streams.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self.reader.abort(request_id)
        self._send(AbortRequest(request_id))

    def _read_step(self, outputs: list[EngineCoreOutput]) -> None:
        """A step's outputs read (OutputProcessor) and delivered; the completions a stop string
        ended are finished in the engine, a request whose output could not be read aborted there,
        its stream ended with the error."""
        results, stopped = self.reader.process(outputs)
        if failed := self.reader.take_failed():  # (its output could not be read: it alone fails)
            for request_id, _ in failed:
                self._send(AbortRequest(request_id))
            self._fail_requests(failed)
        if stopped:
            self._send(FinishRequest(stopped))
        self._deliver_step(results)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}  # one wake-up of each loop per step
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)
        if self.on_step is not None:
            self.on_step(self, outputs)

    def _fail_requests(self, failed: list[tuple[str, str]]) -> None:
        """Requests whose step failed (the engine goes on): their streams end with the error."""
        for request_id, why in failed:
            self.reader.abort(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.put, RequestFailedError(why))

    def _fail(self, error: BaseException) -> None:
        """The engine is broken: fail every waiting stream, loudly."""
        self.error = error
        for stream in list(self._streams.values()):
            stream.loop.call_soon_threadsafe(stream.put, error)


class AsyncEngine(_Background):
    """The engine on a thread of this process; commands reach it through a thread-safe queue."""

    def __init__(self, engine: LLMEngine, on_step=None):
        super().__init__(on_step)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.vocab_size, self.max_model_len = engine.model_config.vocab_size, engine.max_model_len
        self.kv_role, self.block_size = engine.config.kv_role, engine.config.block_size
        self.kv_lease_s, self.kv_compat = engine.config.kv_lease_s, engine.kv_compat
        self.sampling_defaults = engine.sampling_defaults
        self.reader = OutputProcessor(self.tokenizer)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="picovllm-engine", daemon=True)
        self._thread.start()

    def get_metrics(self) -> dict[str, int]:
        return self.engine.get_metrics()

    @property
    def num_running(self) -> int:
        """Requests in the running batch (all of them this server's)."""
        return self.get_metrics()["num_running"]

    def _send(self, cmd: EngineCommand) -> None:
        self._commands.put(cmd)

    def shutdown(self) -> None:
        self._commands.put(StopEngine())
        self._thread.join(timeout=10)

    def _next_command(self, timeout: float | None) -> EngineCommand | None:
        try:
            return self._commands.get(block=timeout != 0, timeout=timeout or None)
        except queue.Empty:
            return None

    def _run(self) -> None:
        try:
            engine_loop(self.engine, self._next_command, self._read_step, self._fail_requests)
        except BaseException as e:
            self._fail(e)
            raise


# ---- the engine in a process of its own -------------------------------------------------------


def _engine_main(engine_args: dict, commands: list, outputs: list) -> None:
    """The engine process: build the engine, report its limits, then run engine_loop on the
    pipes of its clients (one pair per HTTP process: commands down, outputs up), sending each
    client the outputs of the requests it added, with the engine's metrics, after every step.
    Ctrl-C is the server's to handle: it shuts this process down with StopEngine, or by closing
    the first client's pipe (the server's own process gone); another client gone (an HTTP process
    of the server's, stopped or dead) has its requests aborted, and the others go on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging()  # (at the level of the command that started it, if one did)
    try:
        engine = LLMEngine.from_engine_args(**engine_args)
    except BaseException as e:  # bad options: the server reports them and does not start
        for out in outputs:
            out.send(EngineDead(e))
        return
    config = engine.config
    ready = EngineReady(
        engine.model_config.vocab_size,
        engine.max_model_len,
        engine.tokenizer_source,
        config.kv_role,
        config.block_size,
        config.kv_lease_s,
        engine.kv_compat,
        engine.get_metrics(),
        engine.sampling_defaults,
    )
    for out in outputs:
        out.send(ready)
    client_of: dict[str, int] = {}  # a request's client (the pipe its outputs go up), until it finishes
    live = dict(enumerate(commands))  # the clients' command pipes still open
    pending: list[EngineCommand] = []  # (commands read and not yet returned)
    finishing: set[str] = set()  # (requests a FinishRequest named since the last publish: ended whole?)

    def next_command(timeout: float | None) -> EngineCommand | None:
        if not pending:
            if timeout is not None and 0 < timeout < 0.001:  # (a pipe's poll waits whole milliseconds)
                time.sleep(timeout)
                timeout = 0
            for conn in multiprocessing.connection.wait(list(live.values()), timeout):
                i = commands.index(conn)
                try:
                    cmd = conn.recv()
                except EOFError:
                    gone(i)
                    continue
                if isinstance(cmd, AddRequest):
                    client_of[cmd.request_id] = i
                elif isinstance(cmd, AbortRequest):
                    client_of.pop(cmd.request_id, None)
                elif isinstance(cmd, FinishRequest):
                    finishing.update(request_id for request_id, _ in cmd.completions)
                pending.append(cmd)
        return pending.pop(0) if pending else None

    def gone(i: int) -> None:
        """Client i's process has exited (the server stops it, or it died): its requests end. The
        first client's is the server's own: the engine ends (EOFError)."""
        if i == 0:
            raise EOFError
        del live[i]
        outputs[i].close()
        for request_id in [r for r, c in client_of.items() if c == i]:
            del client_of[request_id]
            pending.append(AbortRequest(request_id))

    def publish(outs: list[EngineCoreOutput]) -> None:
        by_client: list[list[EngineCoreOutput]] = [[] for _ in outputs]
        for o in outs:
            i = client_of.pop(o.request_id) if o.finished else client_of.get(o.request_id)
            if i is not None:  # (None: aborted)
                by_client[i].append(o)
        for request_id in finishing - engine.groups.keys():  # (its last completions ended: nothing more comes)
            client_of.pop(request_id, None)
        finishing.clear()
        metrics = engine.get_metrics()
        running = [0] * len(outputs)
        for req in engine.scheduler.running:
            if (i := client_of.get(req.parent_id)) is not None:
                running[i] += 1
        for i in list(live):
            send(i, EngineCoreOutputs(by_client[i], metrics, running[i]))

    def send(i: int, message) -> None:
        try:
            outputs[i].send(message)
        except OSError:  # (its reader has closed: the client is gone, its commands' end not read yet)
            gone(i)

    def fail(failed: list[tuple[str, str]]) -> None:
        by_client: list[list[tuple[str, str]]] = [[] for _ in outputs]
        for request_id, why in failed:
            if (i := client_of.pop(request_id, None)) is not None:
                by_client[i].append((request_id, why))
        for i in list(live):
            if by_client[i]:
                send(i, RequestsFailed(by_client[i]))

    try:
        with frozen_heap():
            engine_loop(engine, next_command, publish, fail)
    except EOFError:  # the server went away
        return
    except BaseException as e:
        for i in live:
            with contextlib.suppress(OSError):
                outputs[i].send(EngineDead(e))
        raise
    finally:
        engine.shutdown()  # (its tensor-parallel workers)


class EngineClient(_Background):
    """An HTTP process's end of an engine process (EngineProcess starts one; `--api-server-count`
    hands the others to HTTP processes of their own): commands go down one pipe; each step's
    outputs of this client's requests and the engine's metrics come up another, read on the
    server's event loop (attach), which delivers them. The first message up is EngineReady (or
    EngineDead: bad engine options, raised here)."""

    def __init__(self, commands, outputs, on_step=None):
        super().__init__(on_step)
        self._commands, self._outputs = commands, outputs
        import_tokenizer_library()  # (while the engine process starts)
        try:
            ready = self._outputs.recv()
        except EOFError:  # it died before it could say why (its traceback, if any, is on stderr)
            raise RuntimeError(f"the engine process exited while starting{self._exit_code()}") from None
        if isinstance(ready, EngineDead):
            raise ready.error
        self.vocab_size, self.max_model_len = ready.vocab_size, ready.max_model_len
        self.kv_role, self.block_size, self.kv_lease_s = ready.kv_role, ready.block_size, ready.kv_lease_s
        self.kv_compat, self.sampling_defaults = ready.kv_compat, ready.sampling_defaults
        self.tokenizer = load_tokenizer(ready.tokenizer) if ready.tokenizer else None
        self.reader = OutputProcessor(self.tokenizer)
        self._metrics: dict[str, int] = ready.metrics
        self.num_running = 0  # (this client's requests in the running batch, as of the last step)
        self._lock = threading.Lock()  # sends come from the event loop and from shutdown
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop that reads the steps

    def _exit_code(self) -> str:
        return ""  # (the process is the server's: EngineProcess knows its exit code)

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

    def _send(self, cmd: EngineCommand) -> None:
        if isinstance(cmd, (AddRequest, AbortRequest)):
            self.attach()
        try:
            with self._lock:
                self._commands.send(cmd)
        except OSError as e:  # the process is gone: nothing to abort; an add fails as a dead engine
            if isinstance(cmd, AddRequest):
                raise EngineDeadError(f"the engine process has exited{self._exit_code()}") from e

    def shutdown(self) -> None:
        """Stop the engine process (every client's: the server is going)."""
        self._closing = True
        self._send(StopEngine())
        self._detach()

    def close(self) -> None:
        """This client's end (an HTTP process of a server with several, on its way out): the engine
        aborts this client's requests and serves the others."""
        self._closing = True
        self._detach()
        self._commands.close()
        self._outputs.close()

    def _read(self) -> None:
        """Every step message waiting in the pipe (on the loop, when it is readable)."""
        try:
            while self._outputs.poll():
                match self._outputs.recv():
                    case EngineCoreOutputs(outs, metrics, num_running):
                        self._metrics, self.num_running = metrics, num_running
                        self._read_step(outs)
                    case RequestsFailed(failed):
                        self._fail_requests(failed)
                    case EngineDead(error):
                        raise error
        except EOFError:
            self._detach()
            if not self._closing:
                self._fail(EngineDeadError(f"the engine process exited{self._exit_code()}"))
        except BaseException as e:
            self._detach()
            self._fail(e)


class EngineProcess(EngineClient):
    """The engine in a process of its own (spawned: CUDA does not survive a fork), and this
    process's client of it; api_server_count > 1 makes as many clients: the others' pipes
    (clients(), for HTTP processes of their own) until release_clients()."""

    def __init__(self, engine_args: dict, on_step=None, api_server_count: int = 1):
        ctx = multiprocessing.get_context("spawn")
        ends = [(ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)) for _ in range(api_server_count)]
        self._process = ctx.Process(
            target=_engine_main,
            args=(engine_args, [cmd_in for (cmd_in, _), _ in ends], [out_in for _, (_, out_in) in ends]),
            name="picovllm-engine",
        )
        self._process.start()
        for (cmd_in, _), (_, out_in) in ends:
            cmd_in.close()
            out_in.close()
        self._clients = [(cmd_out, out_out) for (_, cmd_out), (out_out, _) in ends[1:]]
        try:
            super().__init__(ends[0][0][1], ends[0][1][0], on_step)
        except BaseException:
            self._process.join()
            self.release_clients()
            raise

    def _exit_code(self) -> str:
        self._process.join(timeout=1)  # (it has closed its pipes: it is exiting, if not gone)
        return f" (code {self._process.exitcode})"

    @property
    def pid(self) -> int:
        return self._process.pid

    def clients(self) -> list[tuple]:
        """(commands, outputs) pipe ends of the other clients: EngineClient(*pair) in their process."""
        return self._clients

    def release_clients(self) -> None:
        """This process's copies of the other clients' pipes closed (once their processes have them)."""
        for pair in self._clients:
            for conn in pair:
                conn.close()
        self._clients = []

    def shutdown(self) -> None:
        super().shutdown()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
        self.release_clients()


def start_background_engine(
    engine_args: dict, in_process: bool = False, api_server_count: int = 1
) -> AsyncEngine | EngineProcess:
    """A server's engine: in a process of its own (the default; with a client for each of
    api_server_count HTTP processes), or on a thread of this one."""
    check_api_server_count(api_server_count, in_process)
    if in_process:
        return AsyncEngine(LLMEngine.from_engine_args(**engine_args))
    return EngineProcess(engine_args, api_server_count=api_server_count)


def check_api_server_count(api_server_count: int, in_process: bool) -> None:
    """ValueError unless api_server_count HTTP processes can have clients of the engine."""
    if in_process and api_server_count != 1:
        raise ValueError(
            "--api-server-count needs the engine in a process of its own: drop --disable-frontend-multiprocessing"
        )
