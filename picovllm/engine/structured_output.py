"""Structured outputs (SamplingParams.structured_outputs) on xgrammar, the backend of vLLM and
SGLang: a request's JSON schema, regex, choice or grammar becomes a grammar compiled against the
tokenizer's vocabulary, and the request gets a matcher of its own (each completion of n). At each
step the engine fills, on the host, a bitmask row of the tokens each constrained request may take
next (BitmaskFiller); rank 0's sampler applies it to the logits before it samples
(worker/sampler.py); the matcher then takes the sampled token (accept_tokens), and the request
ends ("stop") once its grammar is complete, or with "length" if max_tokens comes first.

Grammars compile off the step's path, on a thread of their own (xgrammar keeps a cache of what
it compiled): a request waits for its grammar outside the scheduler
(RequestStatus.WAITING_FOR_GRAMMAR) while the others go on. A request's next bitmask needs its
last token on the host; with async scheduling, a step launched ahead of that token runs its
forward at once and samples later (StepLauncher.launch's defer, then sample_deferred), once the
token is read and the bitmask filled, as SGLang's overlap scheduler does: the forward still
overlaps the host's work, only the sampling waits for it. The bitmask fills on a thread of its
own while the engine processes the step's outputs and schedules the next one; the sampling
launches just before that one does (StepLauncher.take_tokens, next_step).

JSON is constrained to one fixed form (`{"a": 1, "b": [2, 3]}`, xgrammar's without free
whitespace): a model can then not pad an answer with whitespace until max_tokens.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from picovllm.config import ModelConfig
from picovllm.engine.request import Request, RequestStatus
from picovllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger("picovllm")
GRAMMAR_WAIT_S = 0.005  # a step with nothing to run but grammars compiling waits this long for one


@functools.cache
def _xgr():
    import xgrammar  # (imported on first use: it takes most of a second)

    return xgrammar


def _grammar(so: StructuredOutputsParams):
    """so as an xgrammar Grammar (RuntimeError from xgrammar when it does not parse)."""
    xgr = _xgr()
    match so.kind:
        case "json":
            schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
            return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        case "json_object":
            return xgr.Grammar.builtin_json_grammar()
        case "regex":
            return xgr.Grammar.from_regex(so.regex)
        case "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in so.choice))
        case "grammar":
            return xgr.Grammar.from_ebnf(so.grammar)


def _ebnf_literal(text: str) -> str:
    """text as EBNF string literals in a row: quotes and backslashes escaped (as vLLM does), each
    control character a literal of its own (xgrammar reads all the hex digits after a \\x)."""
    parts = [p for p in re.split(r"([\x00-\x1f])", text) if p]
    return " ".join(
        f'"\\x{ord(p):02x}"' if len(p) == 1 and ord(p) < 0x20 else '"' + re.sub(r'(["\\])', r"\\\1", p) + '"'
        for p in parts
    )


def check_structured_outputs(so: StructuredOutputsParams, tokenizer, name: str = "structured_outputs") -> None:
    """ValueError naming `name` when so's schema, regex or grammar does not parse, or when there
    is no tokenizer to compile it against."""
    if tokenizer is None:
        raise ValueError(f"{name} needs a tokenizer (the engine was started without one)")
    try:
        _grammar(so)
    except (RuntimeError, ValueError) as e:
        what = {"json": "JSON schema", "json_object": "JSON", "choice": "choice"}.get(so.kind, so.kind)
        raise ValueError(f"{name} has an invalid {what}: {str(e).splitlines()[0]}") from None


class StructuredOutputManager:
    """The engine's grammars: compiles them (one thread; the compiler built on first use, from the
    tokenizer and the model's vocabulary), holds the requests that wait for theirs, and gives
    each a matcher when it is ready; its filler fills their bitmasks (pinned on a GPU)."""

    def __init__(self, tokenizer, model_config: ModelConfig, eos_token_ids: set[int], device: torch.device):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, model_config.vocab_size, eos_token_ids
        self.filler = BitmaskFiller(self.vocab_size, pin_memory=device.type == "cuda")
        self._compiler = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.compiling: list[tuple[Future, list[Request]]] = []  # (the grammar, the requests waiting for it)

    def add(self, so: StructuredOutputsParams, children: list[Request]) -> None:
        """Start compiling so for a request's completions; they wait for it here (take_ready)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="picovllm-grammar")
        for req in children:
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.compiling.append((self._pool.submit(self.compile, so), children))

    def compile(self, so: StructuredOutputsParams):
        """so's grammar, compiled now (add runs this on the grammar thread)."""
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=sorted(self.eos_token_ids)
                )
                self._compiler = xgr.GrammarCompiler(info)
        return self._compiler.compile_grammar(_grammar(so))

    def take_ready(self) -> tuple[list[Request], list[tuple[str, str]]]:
        """The requests whose grammar has compiled since the last call, each with its matcher and
        WAITING (for the scheduler); (request id, why) of those whose grammar failed. Requests
        finished meanwhile (aborted) are dropped."""
        ready, failed, still = [], [], []
        for future, children in self.compiling:
            if not future.done():
                still.append((future, children))
            elif future.exception() is not None:
                failed.append((children[0].parent_id, f"structured_outputs could not compile: {future.exception()}"))
            else:
                for req in children:
                    if not req.is_finished:
                        req.grammar = _xgr().GrammarMatcher(future.result())
                        req.status = RequestStatus.WAITING
                        ready.append(req)
        self.compiling = still
        return ready, failed

    def wait(self, timeout: float = GRAMMAR_WAIT_S) -> None:
        """Block until a grammar being compiled is ready, or timeout seconds (nothing else to run)."""
        if self.compiling:
            wait([f for f, _ in self.compiling], timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.filler.shutdown()


def accept_tokens(reqs: list[Request], tokens: list[int]) -> list[str | None]:
    """Each sampling row's grammar takes the row's token; the finish reason its grammar gives each
    row: "stop" when the grammar is complete, "abort" (logged) when it refuses the token, else
    None (also rows without a grammar, or finished since they were launched)."""
    ends = [None] * len(reqs)
    for i, (req, token) in enumerate(zip(reqs, tokens)):
        if req.grammar is None or req.is_finished:
            continue
        if not req.grammar.accept_token(token):
            logger.error("request %s: its grammar refuses token %d: it ends", req.request_id, token)
            ends[i] = "abort"
        elif req.grammar.is_terminated():
            ends[i] = "stop"
    return ends


class BitmaskFiller:
    """Fills the bitmask of a step's sampling rows: [rows, ceil(vocab_size / 32)] int32 bits of the
    tokens each row's grammar allows next (rows without a grammar, finished since they were
    launched, or whose grammar is complete: all), on the host (pinned for a GPU). xgrammar's batch
    matcher fills all the rows in one call, in C++ without the GIL, on its own threads (half the
    cores this process may use: the other half are the engine's); start() makes that call from a
    thread of the filler's, so that the engine processes a step's outputs while the next step's
    bitmask fills."""

    def __init__(self, vocab_size: int, pin_memory: bool):
        self.vocab_size, self.pin_memory = vocab_size, pin_memory  # (pinned: its copy to the GPU waits for nothing)
        self._batch = None  # (xgrammar's BatchGrammarMatcher, built on first use)
        self._pool: ThreadPoolExecutor | None = None
        # One buffer serves every step: a step's bitmask is filled once the step before has been
        # read, by which time that step's copy of the last bitmask to the device (queued before its
        # sampling) is done. It grows to the largest batch.
        self._mask = torch.empty(0, dtype=torch.int32)

    def fill(self, reqs: list[Request]) -> torch.Tensor | None:
        """The rows' bitmask, filled now; None when no row has a grammar to follow."""
        rows = self._rows(reqs)
        return self._fill(rows, len(reqs)) if rows else None

    def start(self, reqs: list[Request]) -> Future:
        """fill(reqs) on the filler's thread, returned once xgrammar has it (the thread needs the
        GIL to start, and would otherwise wait for this one to block). The rows' matchers are the
        thread's until the future is done: nothing else may use them meanwhile."""
        rows = self._rows(reqs)
        if not rows:
            done = Future()
            done.set_result(None)
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="picovllm-bitmask")
        started = threading.Event()

        def run():
            started.set()
            return self._fill(rows, len(reqs))

        future = self._pool.submit(run)
        started.wait()
        return future

    @staticmethod
    def _rows(reqs: list[Request]) -> list[tuple[int, object]]:
        """(row, matcher) of the rows whose grammar goes on."""
        return [
            (i, r.grammar)
            for i, r in enumerate(reqs)
            if r.grammar is not None and not r.is_finished and not r.grammar.is_terminated()
        ]

    def _fill(self, rows: list[tuple[int, object]], num_rows: int) -> torch.Tensor:
        xgr = _xgr()
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max(1, len(os.sched_getaffinity(0)) // 2))
        shape = xgr.get_bitmask_shape(num_rows, self.vocab_size)
        if self._mask.shape[0] < num_rows:
            self._mask = torch.empty(shape, dtype=torch.int32, pin_memory=self.pin_memory)
        mask = self._mask[:num_rows]
        filled = [i for i, _ in rows]
        if len(filled) < num_rows:  # (xgrammar writes its rows whole; the others allow every token)
            free = torch.ones(num_rows, dtype=torch.bool)
            free[filled] = False
            mask[free] = -1
        self._batch.batch_fill_next_token_bitmask([m for _, m in rows], mask, filled)
        return mask

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
