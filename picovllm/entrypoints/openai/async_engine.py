"""The engine on a background thread, for asyncio servers.

HTTP handlers never run the model: they submit requests and abort them through a thread-safe
queue, and receive each request's RequestOutputs on an asyncio queue fed from the engine thread
(loop.call_soon_threadsafe, once per step). The engine thread steps while anything is unfinished and sleeps on
an event otherwise.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from picovllm.engine.llm_engine import LLMEngine, PromptType
from picovllm.outputs import RequestOutput
from picovllm.sampling_params import SamplingParams


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step=None):
        self.engine = engine
        self.on_step = on_step  # called on the engine thread after each step (metrics)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="picovllm-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def validate(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt off the event loop (it reads only the engine's fixed
        settings and its thread-safe tokenizer). Raises ValueError for bad input."""
        return await asyncio.to_thread(self.engine.process_prompt, prompt, params)

    async def generate(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the outputs of a validated prompt (see validate) as they change; aborts the
        request if the consumer stops early."""
        if self.error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, text, ids, params))
        self._wake.set()
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
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop:
                self._apply_commands()
                if not engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                # one wake-up of each event loop per step, not one per output
                by_loop: dict[asyncio.AbstractEventLoop, list] = {}
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        by_loop.setdefault(stream.loop, []).append((stream.queue, out))
                for loop, items in by_loop.items():
                    loop.call_soon_threadsafe(_deliver, items)
                if self.on_step is not None:
                    self.on_step(engine, outputs)
        except BaseException as e:  # the engine is broken: fail every waiting stream, loudly
            self.error = e
            for stream in list(self._streams.values()):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, e)
            raise

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, text, ids, params = cmd
                if rid in self._streams:  # not already abandoned by its client
                    self.engine.add_validated_request(rid, text, ids, params)
            else:
                self.engine.abort_request(cmd[1])
