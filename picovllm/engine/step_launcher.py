"""Launching steps: a scheduled batch as the messages every rank runs (step_inputs, sampling_batch)
and, with async scheduling, the step launched ahead of the one being read, whose state this
owns: the step in flight, and the sampling batch kept while the same requests sample again.

With async scheduling a step launches the next one before its own tokens are read: the next
step's inputs take those tokens on the device (rank 0's worker keeps them, ExecuteStep), so the
GPU has its next step queued while the host processes this one. A request that stops meanwhile
has its extra token dropped (OutputProcessor).
"""

from __future__ import annotations

import operator
from concurrent.futures import Future
from typing import NamedTuple

import numpy as np

from picovllm.engine.core_output_processor import at_length_limit
from picovllm.engine.kv_handoff import KVHandoff
from picovllm.engine.request import Request
from picovllm.engine.scheduler import ScheduledBatch, Scheduler
from picovllm.engine.structured_output import BitmaskFiller, accept_tokens
from picovllm.executor.executor import Executor
from picovllm.messages import ExecuteStep, ModelRunnerOutput, SamplingBatch, StepInputs


class LaunchedStep(NamedTuple):
    """A launched forward: its batch, the requests that sample, their samples on the way to the
    host (None: no row samples and no prompt log-probabilities, or not yet: deferred), its number
    (BlockManager.step_launched), whether its samples wait for its grammars' bitmask
    (StepLauncher.sample_deferred), and the requests whose prompt log-probabilities it computes:
    (request, the position of its first token in the step, how many; StepInputs.prompt_logprobs)."""

    batch: ScheduledBatch
    reqs: list[Request]
    out: ModelRunnerOutput | None
    number: int
    deferred: bool = False
    prompt_rows: list[tuple[Request, int, int]] = []


def step_inputs(
    batch: ScheduledBatch, num_pending: int = 0, kv_copies: list | None = None, tables_before: list | None = None
) -> StepInputs:
    """A scheduled batch as plain data (what every rank's forward needs), with the copies between
    the KV pools to run first. The first num_pending requests decode a token sampled by the step
    before and not yet read by the host (a step launched ahead): their input token is a
    placeholder, filled on the device (ModelRunner.prepare). tables_before: the block tables of
    the step before (the very lists): when each row's is the same list, the tables continue
    them (a list is only appended to while it is the request's: StepInputs.tables_continue)."""
    tables = [r.block_table for r in batch.requests]
    same = tables_before is not None and len(tables_before) == len(tables)
    token_ids, context, sample, prompt_logprobs = [], [], [], []
    for i, (r, n) in enumerate(zip(batch.requests, batch.num_new_tokens, strict=True)):
        end = r.num_computed_tokens + n
        token_ids.append([0] if i < num_pending else r.token_ids[end - n : end])
        context.append(end)
        sample.append(i < num_pending or end == len(r.token_ids))
        if r.needs_prompt_logprobs and end - n + 1 < r.num_prompt_tokens:  # (token p predicts prompt token p + 1)
            targets = r.token_ids[end - n + 1 : min(end + 1, r.num_prompt_tokens)]
            prompt_logprobs.append((i, r.params.prompt_logprobs, targets))
    return StepInputs(
        token_ids,
        np.array(context, dtype=np.int64),
        np.array(batch.num_new_tokens, dtype=np.int64),
        tables,
        np.array(sample),
        kv_copies or [],
        prompt_logprobs,
        same and all(map(operator.is_, tables, tables_before)),
    )


def _reads_output(req: Request) -> bool:
    """Whether req's next sample depends on its output so far: penalties, or a min_tokens ban."""
    return req.params.has_penalties or req.num_output_tokens < req.params.min_tokens


def sampling_batch(
    reqs: list[Request],
    finished_ids: list[str],
    bitmask=None,
    num_pending: int = 0,
    before: SamplingBatch | None = None,
) -> SamplingBatch:
    """The sampling rows of the requests that sample, as plain data, with their grammars' bitmask
    (BitmaskFiller; None: none, or filled later: deferred). The first num_pending rows decode a
    token still in flight (a step launched ahead): it is counted in their outputs' lengths (a
    min_tokens ban), and the model runner appends it to their outputs (the penalties).
    before: the batch before, when the same requests sampled in it (SamplingBatch.continues; its
    prompts serve again, not sliced from the requests again)."""
    penalties = any(r.params.has_penalties for r in reqs)
    prompts = None
    if penalties:
        prompts = before.prompt_ids if before is not None else [r.prompt_token_ids for r in reqs]
    return SamplingBatch(
        [r.request_id for r in reqs],
        [r.params for r in reqs],
        [r.seed for r in reqs],
        [r.num_output_tokens + (i < num_pending) for i, r in enumerate(reqs)],
        prompts,
        [r.output_token_ids for r in reqs] if penalties else None,
        finished_ids,
        bitmask,
        before is not None,
    )


class StepLauncher:
    def __init__(
        self,
        scheduler: Scheduler,
        kv_handoff: KVHandoff | None,
        executor: Executor,
        async_scheduling: bool,
        filler: BitmaskFiller,
    ):
        self.scheduler, self.block_manager, self.kv_handoff = scheduler, scheduler.block_manager, kv_handoff
        self.executor, self.async_scheduling = executor, async_scheduling
        self.inflight: LaunchedStep | None = None  # a step launched ahead, its tokens not read yet
        self.filler = filler  # (the structured outputs' bitmasks: StructuredOutputManager's)
        self._filling: Future | None = None  # the bitmask of the step launched ahead (take_tokens)
        self._last_sampling: tuple[list[Request], SamplingBatch, bool] | None = None  # (see _sampling_batch)
        self._last_tables: list[list[int]] | None = None  # the last step's block tables (step_inputs)
        self.num_launched_ahead = 0

    def next_step(self) -> LaunchedStep | None:
        """The step whose tokens to read now: the one launched ahead, else one launched now (None:
        nothing to run); with async scheduling, the step after it is launched before returning.
        A step launched ahead whose grammars waited for the last tokens samples here, as the step
        after it launches, once that step's inputs are built (launch; sample_deferred when no step
        follows): its bitmask filled meanwhile, while the host processed those tokens, scheduled
        the next step and built its inputs."""
        step = self.inflight
        if step is None:
            batch = self.schedule(None)
            if batch is None:
                return None
            _, step = self.launch(batch)
        self.inflight = None
        if self.async_scheduling:
            step, self.inflight = self.launch_ahead(step)
        return step

    def schedule(self, decodes: list[Request] | None) -> ScheduledBatch | None:
        """The scheduler's next batch (schedule_ahead with `decodes`); the pulls of the requests it
        admitted to wait for their KV start here."""
        handoff, sched = self.kv_handoff, self.scheduler
        if handoff is not None:
            sched.paused = handoff.admission_paused
        batch = sched.schedule() if decodes is None else sched.schedule_ahead(decodes)
        if handoff is not None:
            for req in sched.take_new_pulls():
                handoff.start(req)
        return batch

    def reset(self) -> None:
        """Nothing in flight (no request left, or a step failed)."""
        if self._filling is not None:
            self._filling.exception()  # (waits: its matchers are its own until it is done)
        self.inflight, self._last_sampling, self._filling, self._last_tables = None, None, None, None

    def launch(
        self,
        batch: ScheduledBatch,
        num_pending: int = 0,
        pending_rows: list[int] | None = None,
        before: LaunchedStep | None = None,
    ) -> tuple[LaunchedStep | None, LaunchedStep]:
        """Launch the batch's forward; its first num_pending rows decode the tokens the step
        `before` sampled (rows pending_rows of them; None: all), still on the device: `before`
        samples first if it was deferred, under its bitmask, once this forward's inputs are built
        and uploaded (Executor.execute_step: the wait for the fill overlaps that work), and is
        returned sampled with the step launched. A step launched so whose sampling rows include a
        grammar's samples once those tokens are read and its bitmask filled: the forward runs
        meanwhile."""
        step = step_inputs(batch, num_pending, self.block_manager.take_copies(), self._last_tables)
        self._last_tables = step.block_tables
        # the requests whose last token this step computes (step.sample): each samples one token
        reqs = [r for r, sample in zip(batch.requests, step.sample.tolist()) if sample]
        defer = num_pending > 0 and any(r.grammar is not None for r in reqs)
        sampling = self._sampling_batch(reqs, defer, num_pending) if reqs else None
        # (the fill is the launch's until it returns: a launch that fails leaves it to reset)
        filling = self._filling if before is not None and before.deferred else None
        sampled_before, out = self.executor.execute_step(
            ExecuteStep(step, num_pending, pending_rows), sampling, defer, None if filling is None else filling.result
        )
        if filling is not None:
            self._filling = None
            before = before._replace(out=sampled_before, deferred=False)
        number = self.block_manager.step_launched()
        prompt_rows = [
            (batch.requests[i], batch.requests[i].num_computed_tokens, len(t)) for i, _, t in step.prompt_logprobs
        ]
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
        return before, LaunchedStep(batch, reqs, out, number, defer, prompt_rows)

    def take_tokens(self, reqs: list[Request], tokens: list[int]) -> list[str | None]:
        """A step's tokens, read: its rows' grammars take them (accept_tokens: what each row's
        grammar ends it with), then the bitmask of the step launched ahead starts filling, on the
        filler's thread (BitmaskFiller.start), while the engine processes the tokens and
        schedules the next step (next_step)."""
        ends = accept_tokens(reqs, tokens)
        step = self.inflight
        if step is not None and step.deferred:
            self._filling = self.filler.start(step.reqs)
        return ends

    def sample_deferred(self, step: LaunchedStep) -> LaunchedStep:
        """step, sampled: under its bitmask (take_tokens', once it is filled) if it was deferred
        (when no step is launched after it: launch samples it otherwise)."""
        if not step.deferred:
            return step
        bitmask, self._filling = self._filling.result(), None
        return step._replace(out=self.executor.sample_deferred(bitmask), deferred=False)

    def _sampling_batch(self, reqs: list[Request], deferred: bool = False, num_pending: int = 0) -> SamplingBatch:
        """The step's SamplingBatch: the previous step's when the same requests sample again, none
        has finished meanwhile and nothing in it changes per step (no penalties, min_tokens
        reached, no bitmask: none of them has a grammar, or theirs comes later); else a new one,
        marked as continuing the previous one when the same requests sample again. This is the
        one place that decides: rank 0's model runner reuses its sampling tensors exactly when it
        gets the batch it got last, and their parameters' part when the batch continues."""
        finished = self.scheduler.take_finished_ids()
        # a grammar's bitmask changes every step: in the batch unless it comes later (deferred)
        bitmask = None if deferred else self.filler.fill(reqs)
        last = self._last_sampling
        same = not finished and last is not None and len(last[0]) == len(reqs) and all(map(operator.is_, last[0], reqs))
        if same and bitmask is None and last[2]:
            return last[1]
        batch = sampling_batch(reqs, finished, bitmask, num_pending, before=last[1] if same else None)
        # (a batch is sent once with the ids of the requests finished before it)
        static = not finished and bitmask is None and not any(map(_reads_output, reqs))
        self._last_sampling = (reqs, batch, static)
        return batch

    def launch_ahead(self, step: LaunchedStep) -> tuple[LaunchedStep, LaunchedStep | None]:
        """step (sampled, if it was deferred) and the step that follows it, launched before
        step's tokens are read when its schedule does not depend on them
        (Scheduler.schedule_ahead), else None: the requests that sampled in `step` decode the
        tokens it sampled, the others' prompt chunks and new admissions follow. (A min_tokens ban
        counts the token in flight, the penalties read it on the device, a grammar's bitmask waits
        for the tokens: launch's defer.)"""
        batch, rows = self._schedule_ahead(step)
        if batch is None:
            return self.sample_deferred(step), None
        self.num_launched_ahead += 1
        return self.launch(batch, len(rows), rows if len(rows) < len(step.reqs) else None, before=step)

    def _schedule_ahead(self, step: LaunchedStep) -> tuple[ScheduledBatch | None, list[int]]:
        """The batch to launch after `step` (launch_ahead), and the rows of step's samples it decodes."""
        reqs = step.reqs
        if not reqs:
            return None, []
        running = set(map(id, self.scheduler.running))
        if any(id(r) not in running for r in reqs):
            return None, []
        # a request whose token in flight is its last (max_tokens, max_model_len) finishes
        # whatever that token is: it does not go on
        rows = [i for i, r in enumerate(reqs) if not at_length_limit(r, pending=1)]
        if not rows:
            return None, []
        return self.schedule([reqs[i] for i in rows]), rows
