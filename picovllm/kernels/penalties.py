"""Repetition, frequency and presence penalties (vLLM's definitions) at the tokens each row has
seen: repetition divides a positive logit of a token in the prompt or the output by the penalty
and multiplies a negative one; then logit -= frequency * count_in_output + presence *
(count_in_output > 0). Computed at the tokens the prompt and output hold, not over the
vocabulary, into a copy of the logits. Prompt and output ids are padded with the vocabulary size.

The reference gathers and scatters (some twenty launches); the Triton path is a sort of the
outputs (each token's count: the length of its run, found by binary search) and one kernel."""

from __future__ import annotations

import torch

from picovllm.kernels.triton_utils import pdl, pdl_wait, tl, triton, use_triton


def apply_penalties_ref(logits, prompt_ids, output_ids, repetition, frequency, presence) -> torch.Tensor:
    """A row's padding stands for its first prompt token: each value written is a function of its
    token (and row), so a token written twice gets the same value twice. The penalties are [rows, 1]."""
    vocab_size = logits.shape[1]
    first = prompt_ids[:, :1]  # (prompts are never empty)
    output = torch.where(output_ids < vocab_size, output_ids, first)
    seen = torch.cat([torch.where(prompt_ids < vocab_size, prompt_ids, first), output], dim=1)
    x = logits.gather(1, seen)
    penalised = logits.scatter(1, seen, torch.where(x > 0, x / repetition, x * repetition))
    ordered = output_ids.sort(dim=1).values  # (each output token's count: where its run starts and ends)
    counts = (torch.searchsorted(ordered, output, right=True) - torch.searchsorted(ordered, output)).float()
    y = penalised.gather(1, output)
    return penalised.scatter_(1, output, y - frequency * counts - presence * (counts > 0))


@triton.jit
def _count_in(ordered, token, length, steps):
    """How many times each token occurs in a sorted row of `length` ids: two binary searches."""
    lo = tl.zeros(token.shape, tl.int32)
    hi = lo + length
    for _ in range(steps):  # (the first index holding token or more)
        mid = (lo + hi) // 2
        go = (lo < hi) & (tl.load(ordered + mid, mask=lo < hi, other=0) < token)
        hi = tl.where((lo < hi) & ~go, mid, hi)
        lo = tl.where(go, mid + 1, lo)
    start = lo
    hi = tl.zeros(token.shape, tl.int32) + length
    for _ in range(steps):  # (the first index holding more than token)
        mid = (lo + hi) // 2
        go = (lo < hi) & (tl.load(ordered + mid, mask=lo < hi, other=0) <= token)
        hi = tl.where((lo < hi) & ~go, mid, hi)
        lo = tl.where(go, mid + 1, lo)
    return lo - start


@triton.jit(do_not_specialize=["s_p", "s_o", "prompt_len", "output_len", "steps"])  # (they change every step)
def _penalty_kernel(logits, out, prompt_ids, output_ids, ordered, repetition, frequency, presence,
                    s_l, s_p, s_o, prompt_len, output_len, vocab, steps, TILE: tl.constexpr, USE_PDL: tl.constexpr):
    """One program a row: each seen token's logit, read from logits, written penalised to out."""
    row = tl.program_id(0)
    pdl_wait(USE_PDL)
    r = tl.load(repetition + row)
    f = tl.load(frequency + row)
    p = tl.load(presence + row)
    for start in range(0, prompt_len + output_len, TILE):
        cols = start + tl.arange(0, TILE)
        in_prompt = cols < prompt_len
        in_output = (cols >= prompt_len) & (cols < prompt_len + output_len)
        token = tl.load(prompt_ids + row * s_p + cols, mask=in_prompt, other=vocab)
        token = tl.where(in_output, tl.load(output_ids + row * s_o + cols - prompt_len, mask=in_output, other=vocab),
                         token)
        seen = token < vocab
        x = tl.load(logits + row * s_l + token, mask=seen, other=0.0)
        count = _count_in(ordered + row * s_o, token, output_len, steps).to(tl.float32)
        y = tl.where(x > 0, tl.math.div_rn(x, r), x * r)
        y = y - f * count - p * (count > 0).to(tl.float32)
        tl.store(out + row * s_l + token, y, mask=seen)


def apply_penalties_triton(logits, prompt_ids, output_ids, repetition, frequency, presence, tile: int = 512):
    logits, output_ids = logits.contiguous(), output_ids.contiguous()
    out = logits.clone()
    ordered = output_ids.sort(dim=1).values
    output_len = output_ids.shape[1]
    _penalty_kernel[(logits.shape[0],)](
        logits, out, prompt_ids, output_ids, ordered, repetition, frequency, presence, logits.stride(0),
        prompt_ids.stride(0), ordered.stride(0), prompt_ids.shape[1], output_len, logits.shape[1],
        output_len.bit_length(), TILE=tile, **pdl(logits))
    return out


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    return (apply_penalties_triton if use_triton(logits) else apply_penalties_ref)(
        logits, prompt_ids, output_ids, repetition, frequency, presence
    )
