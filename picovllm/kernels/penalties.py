"""Repetition, frequency and presence penalties (vLLM's definitions) at the tokens each row has
seen: repetition divides a positive logit of a token in the prompt or the output by the penalty
and multiplies a negative one; then logit -= frequency * count_in_output + presence *
(count_in_output > 0). Computed at the tokens the prompt and output hold, not over the
vocabulary. Prompt and output ids are padded with the vocabulary size.

The reference gathers and scatters into a new tensor (some twenty launches); the Triton path is a
sort of the outputs (each token's count: the length of its run, found by binary search) and one
kernel writing into the logits themselves (the sampler's own fp32 copy): every seen token's logit
is read before any is written, so that a token seen twice is penalised once."""

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
def _search(ordered, token, length, steps, AFTER: tl.constexpr):
    """In a sorted row of `length` ids, the first index holding token or more (AFTER: more)."""
    lo = tl.zeros(token.shape, tl.int32)
    hi = lo + length
    for _ in range(steps):
        mid = (lo + hi) // 2
        v = tl.load(ordered + mid, mask=lo < hi, other=0)
        go = (lo < hi) & ((v <= token) if AFTER else (v < token))
        hi = tl.where((lo < hi) & ~go, mid, hi)
        lo = tl.where(go, mid + 1, lo)
    return lo


@triton.jit
def _seen(prompt_ids, output_ids, row, cols, s_p, s_o, prompt_len, output_len, vocab):
    """The row's seen tokens at positions cols of prompt + output (vocab: none there)."""
    in_prompt = cols < prompt_len
    in_output = (cols >= prompt_len) & (cols < prompt_len + output_len)
    token = tl.load(prompt_ids + row * s_p + cols, mask=in_prompt, other=vocab)
    return tl.where(in_output, tl.load(output_ids + row * s_o + cols - prompt_len, mask=in_output, other=vocab), token)


@triton.jit(do_not_specialize=["s_p", "s_o", "s_x", "prompt_len", "output_len", "steps"])  # (they change every step)
def _penalty_kernel(logits, prompt_ids, output_ids, ordered, seen_logits, repetition, frequency, presence,
                    s_l, s_p, s_o, s_x, prompt_len, output_len, vocab, steps, TILE: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """One program a row: each seen token's logit gathered into seen_logits, then (all read) each
    written back penalised; a token seen twice is written twice with the same value."""
    row = tl.program_id(0)
    pdl_wait(USE_PDL)
    r = tl.load(repetition + row)
    f = tl.load(frequency + row)
    p = tl.load(presence + row)
    for start in range(0, prompt_len + output_len, TILE):
        cols = start + tl.arange(0, TILE)
        token = _seen(prompt_ids, output_ids, row, cols, s_p, s_o, prompt_len, output_len, vocab)
        x = tl.load(logits + row * s_l + token, mask=token < vocab, other=0.0)
        tl.store(seen_logits + row * s_x + cols, x, mask=cols < prompt_len + output_len)
    tl.debug_barrier()  # (every read done before the first write)
    for start in range(0, prompt_len + output_len, TILE):
        cols = start + tl.arange(0, TILE)
        token = _seen(prompt_ids, output_ids, row, cols, s_p, s_o, prompt_len, output_len, vocab)
        x = tl.load(seen_logits + row * s_x + cols, mask=cols < prompt_len + output_len, other=0.0)
        first = _search(ordered + row * s_o, token, output_len, steps, False)
        count = (_search(ordered + row * s_o, token, output_len, steps, True) - first).to(tl.float32)
        y = tl.where(x > 0, tl.math.div_rn(x, r), x * r)
        y = y - f * count - p * (count > 0).to(tl.float32)
        tl.store(logits + row * s_l + token, y, mask=token < vocab)


def apply_penalties_triton(logits, prompt_ids, output_ids, repetition, frequency, presence, tile: int = 512):
    """In place into logits (contiguous rows), which it returns."""
    assert logits.stride(1) == 1, "the penalties' kernel writes into rows of contiguous logits"
    output_ids = output_ids.contiguous()
    ordered = output_ids.sort(dim=1).values
    prompt_len, output_len = prompt_ids.shape[1], output_ids.shape[1]
    seen_logits = torch.empty((logits.shape[0], prompt_len + output_len), dtype=logits.dtype, device=logits.device)
    _penalty_kernel[(logits.shape[0],)](
        logits, prompt_ids, output_ids, ordered, seen_logits, repetition, frequency, presence, logits.stride(0),
        prompt_ids.stride(0), ordered.stride(0), seen_logits.stride(0), prompt_len, output_len, logits.shape[1],
        output_len.bit_length(), TILE=tile, **pdl(logits))
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """The penalised logits: on the Triton path the logits themselves, written in place."""
    return (apply_penalties_triton if use_triton(logits) else apply_penalties_ref)(
        logits, prompt_ids, output_ids, repetition, frequency, presence
    )
