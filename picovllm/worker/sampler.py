"""Batched sampling on the device with per-request parameters (vLLM's semantics).

Order: structured outputs' bitmask, min_tokens masking (except on a row whose grammar then allows
nothing: its stop tokens stay, as vLLM has it), logit_bias, allowed_token_ids and penalties on the
logits -> greedy rows take the argmax, the others draw under temperature, min_p, top_k and top_p
(kernels/sampling.py), each seeded request's from its own generator so that its samples do not
depend on what else is in the batch. A bitmask with nothing else to mask or threshold the logits
is applied by the draw as it reads them (no fp32 copy, no launch of its own).
Log-probabilities are those of the raw model output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from picovllm.kernels.penalties import apply_penalties
from picovllm.kernels.sampling import masked_fp32, sample
from picovllm.messages import SamplerOutput, SamplingBatch
from picovllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingTensors:
    temperature: torch.Tensor | None  # [B], 1.0 on greedy rows; None when all rows are greedy
    greedy: torch.Tensor | None  # [B] bool; None when all rows are greedy or none is
    top_k: torch.Tensor | None  # [B] int, vocab size where off
    top_p: torch.Tensor | None  # [B]
    min_p: torch.Tensor | None  # [B]
    repetition_penalty: torch.Tensor | None  # [B, 1]
    presence_penalty: torch.Tensor | None  # [B, 1]
    frequency_penalty: torch.Tensor | None  # [B, 1]
    prompt_ids: torch.Tensor | None  # [B, max_prompt] padded with vocab_size
    output_ids: torch.Tensor | None  # [B, max_output] padded with vocab_size
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) masked by min_tokens
    bias: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None  # ((rows, token ids), values): logit_bias
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows with a list, (rows, ids) of theirs)
    generators: list[torch.Generator | None]
    all_greedy: bool
    max_logprobs: int | None  # the largest logprobs=k asked for; None when no request asked
    bitmask: torch.Tensor | None = None  # [B, vocab / 32] int32: the tokens each row's grammar allows
    max_top_k: int | None = None  # the largest of top_k (on the host): how many logits of a row are sorted

    def with_in_flight(self, tokens: torch.Tensor, vocab_size: int) -> SamplingTensors:
        """These tensors with the first len(tokens) rows' tokens in flight (sampled, still on the
        device: a step launched ahead decodes them) appended to their output_ids, which the host
        built without them, so that the penalties count them."""
        column = torch.full((self.output_ids.shape[0], 1), vocab_size, dtype=torch.long, device=tokens.device)
        column[: tokens.shape[0], 0] = tokens
        return dataclasses.replace(self, output_ids=torch.cat([self.output_ids, column], dim=1))

    @classmethod
    def from_batch(
        cls,
        batch: SamplingBatch,
        generators: list[torch.Generator | None],
        vocab_size: int,
        eos_ids: set[int],
        device: torch.device,
        before: SamplingTensors | None = None,
        output_ids: torch.Tensor | None = None,
    ) -> SamplingTensors:
        """before: the tensors of the batch before when this one continues it (SamplingBatch.continues:
        the same requests, so the same parameters); only what changes per step is built then.
        output_ids: the rows' outputs on the device, grown from the batch before's (else padded
        from the batch's lists here)."""
        if output_ids is None and batch.output_ids is not None:
            output_ids = _pad(batch.output_ids, vocab_size, device)
        banned = _min_tokens_bans(batch, eos_ids, device)
        bitmask = None if batch.bitmask is None else pinned_to(batch.bitmask, device)
        if before is not None:
            return dataclasses.replace(before, output_ids=output_ids, banned=banned, bitmask=bitmask)
        params = batch.params

        def column(values, dtype=torch.float32, off=None):
            if off is not None and all(v == off for v in values):
                return None
            return to_device(values, dtype, device)

        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        penalties = batch.prompt_ids is not None
        bias_rows, bias_ids, bias_values = [], [], []
        for i, p in enumerate(params):
            for token, value in (p.logit_bias or {}).items():
                bias_rows.append(i)
                bias_ids.append(token)
                bias_values.append(value)
        allowed_rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
        allowed_pairs = [(i, t) for i in allowed_rows for t in params[i].allowed_token_ids]
        return cls(
            temperature=None if all_greedy else column([1.0 if g else p.temperature for g, p in zip(greedy, params)]),
            greedy=None if all_greedy or not any(greedy) else to_device(greedy, torch.bool, device),
            top_k=column(top_k, torch.long, off=vocab_size),
            top_p=column([p.top_p for p in params], off=1.0),
            min_p=column([p.min_p for p in params], off=0.0),
            repetition_penalty=column([p.repetition_penalty for p in params])[:, None] if penalties else None,
            presence_penalty=column([p.presence_penalty for p in params])[:, None] if penalties else None,
            frequency_penalty=column([p.frequency_penalty for p in params])[:, None] if penalties else None,
            prompt_ids=_pad(batch.prompt_ids, vocab_size, device) if penalties else None,
            output_ids=output_ids,
            banned=banned,
            bias=(
                (to_device(bias_rows, torch.long, device), to_device(bias_ids, torch.long, device)),
                to_device(bias_values, torch.float32, device),
            )
            if bias_rows
            else None,
            allowed=(
                to_device(allowed_rows, torch.long, device),
                to_device([i for i, _ in allowed_pairs], torch.long, device),
                to_device([t for _, t in allowed_pairs], torch.long, device),
            )
            if allowed_rows
            else None,
            generators=generators,
            all_greedy=all_greedy,
            max_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
            bitmask=bitmask,
            max_top_k=max(top_k),
        )


def _min_tokens_bans(batch: SamplingBatch, eos_ids: set[int], device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids): the stop tokens of each row short of its min_tokens (None: none)."""
    rows, ids = [], []
    for i, (n, p) in enumerate(zip(batch.num_output_tokens, batch.params)):
        if n < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids)
            rows += [i] * len(stops)
            ids += sorted(stops)
    return (to_device(rows, torch.long, device), to_device(ids, torch.long, device)) if rows else None


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Rows of token ids as one [rows, longest] tensor padded with pad (numpy fills a row from a list
    three times faster than torch.tensor reads lists of lists)."""
    padded = np.full((len(rows), max(1, max(map(len, rows)))), pad, dtype=np.int64)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
    return pinned_to(torch.from_numpy(padded), device)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, without waiting for the work queued on the device: copied
    from pinned memory with non_blocking. (torch.tensor(values, device="cuda") copies from pageable
    memory and synchronises the stream: with a step launched ahead, every change of the sampling
    requests would wait there for the running step.)"""
    return pinned_to(torch.tensor(values, dtype=dtype), device)


def pinned_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device, through pinned memory (see to_device)."""
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t


class Sampler:
    def warm_up(self, vocab_size: int, device: torch.device, dtype: torch.dtype) -> None:
        """A draw under every sampling parameter and a grammar's bitmask (the logits' fp32 copy
        masked), and one under a temperature alone (the model's dtype, `dtype`, as the draw reads
        it): a GPU compiles the sampler's kernels here (one of each serves every batch), before
        serving, not in a step."""
        every_token = torch.full((1, -(-vocab_size // 32)), -1, dtype=torch.int32)
        for params, bitmask in (
            (SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.05), every_token),
            (SamplingParams(temperature=0.7), None),
        ):
            batch = SamplingBatch(["warm-up"], [params], [None], [1], [[0]], [[1]], bitmask=bitmask)
            tensors = SamplingTensors.from_batch(batch, [None], vocab_size, set(), device)
            self(torch.zeros(1, vocab_size, dtype=dtype, device=device), tensors)

    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        # A grammar's bitmask with no other mask or threshold is applied by the draw as it reads the
        # rows (kernels/sampling.py); else to an fp32 copy of the logits first (in one pass), which
        # the masks after it and the thresholds read.
        masks = any(x is not None for x in (t.banned, t.bias, t.allowed, t.repetition_penalty))
        thresholds = any(x is not None for x in (t.top_k, t.top_p, t.min_p))
        in_draw = t.bitmask is not None and not masks and not thresholds
        if t.bitmask is not None and not in_draw:  # (structured outputs: engine/structured_output.py)
            raw_logprobs = logits.float().log_softmax(dim=-1) if t.max_logprobs is not None else None
            logits = masked_fp32(logits, t.bitmask)
        else:
            # fp32 where the logits are written (the penalties: into a copy of their own) or their
            # sums and differences count (log-probabilities, biases, the top-k, top-p and min_p
            # thresholds); the argmax and the temperature's draw read a bf16 or fp16 model's logits
            # as they are, each value exactly its fp32 value, so the tokens are the same
            writes = t.repetition_penalty is not None
            if writes or thresholds or t.max_logprobs is not None or t.bias is not None:
                logits = logits.to(torch.float32, copy=writes)
            raw_logprobs = logits.log_softmax(dim=-1) if t.max_logprobs is not None else None
        if t.banned is not None:
            banned = logits.index_put(t.banned, torch.full((), _NEG_INF, dtype=logits.dtype, device=logits.device))
            if t.bitmask is not None:  # (a grammar that allows only stop tokens outranks min_tokens)
                banned = torch.where(banned.amax(dim=-1, keepdim=True) == _NEG_INF, logits, banned)
            logits = banned
        if t.bias is not None:
            logits = logits.index_put(*t.bias, accumulate=True)
        if t.allowed is not None:
            rows, pair_rows, pair_ids = t.allowed
            keep = torch.ones_like(logits, dtype=torch.bool)
            keep[rows] = False
            keep[pair_rows, pair_ids] = True
            logits = logits.masked_fill(~keep, _NEG_INF)
        if t.repetition_penalty is not None:
            logits = apply_penalties(
                logits, t.prompt_ids, t.output_ids, t.repetition_penalty, t.frequency_penalty, t.presence_penalty
            )
        if t.all_greedy and not in_draw:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = sample(
                logits, t.temperature, t.top_k, t.top_p, t.min_p, t.max_top_k, t.generators,
                True if t.all_greedy else t.greedy, t.bitmask if in_draw else None,
            )  # fmt: skip
        return (
            SamplerOutput(sampled, None, None, None, None)
            if raw_logprobs is None
            else token_logprobs(sampled, raw_logprobs, t.max_logprobs)
        )


def token_logprobs(sampled: torch.Tensor, raw: torch.Tensor, k: int) -> SamplerOutput:
    """The tokens `sampled` (one per row) with their log-probabilities under raw (log-softmaxed
    logits), their ranks, and each row's top k (k 0: none). Also prompt tokens' (ModelRunner)."""
    chosen = raw.gather(1, sampled[:, None])
    ranks = (raw > chosen).sum(dim=-1) + 1
    top = raw.topk(k, dim=-1) if k else None
    return SamplerOutput(
        sampled, chosen[:, 0], ranks, top.values if top is not None else None, top.indices if top is not None else None
    )
