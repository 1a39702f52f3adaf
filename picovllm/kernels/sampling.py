"""The random draw of a batch of logits under each row's temperature, min_p, top_k and top_p
(vLLM's semantics and order; worker/sampler.py applies penalties, biases and masks before it),
greedy rows beside them taking the argmax, and a grammar's bitmask applied as the rows are read
where nothing else needs the masked logits (the sampler's choice).

The reference: temperature -> min_p -> top_k -> top_p as masks over each row (sorting each row's
largest top_k logits, not its whole vocabulary), then a draw by the exponential race (argmax of
p / q with q = -log(U) ~ Exp(1), taken as argmax of logits - log q: the same draw without the
softmax, which costs a pass over a 152k vocabulary per row), each seeded row drawing its noise
from its own generator so that its samples do not depend on what else is in the batch.

The Triton path keeps the same tokens as one threshold a row and draws without writing a mask or
the noise: a handful of launches where the reference makes some forty, whatever the batch.
1. The row's largest logits: torch.topk of the batch's largest top_k; the sorted row when top_p
   is asked of a row without a top_k; the row's maximum for min_p alone.
2. With top_k and top_p both asked, the logits tied with the k-th beyond those largest are
   counted in chunks of the row (_count_kernel): top_p's total includes them, as the reference's.
3. Each row's threshold (_threshold_kernel): the k-th largest, min_p's floor, and the value
   below which top_p's smallest set of most likely tokens ends.
4. The race in chunks of the row (_race_kernel): Philox noise from the row's seed and each token's
   index (a seeded row's seed drawn from its generator, so that its samples depend on nothing
   else in the batch; a greedy row's score its logit), each chunk's best (score, token) packed in
   an int64 key that orders it first, and the least key a row taken atomically.
"""

from __future__ import annotations

import torch

from picovllm.kernels.triton_utils import next_pow2, pdl, pdl_wait, tl, triton, use_triton

_NEG_INF = float("-inf")
_SEED_HIGH = 2**62


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int | None = None
) -> torch.Tensor:
    """top_k keeps the k largest logits (and ties with the k-th); top_p then keeps each token whose
    more likely tokens' probability (renormalised over those top_k kept) is below p: the smallest
    set of most likely tokens that reaches p, and ties with its least likely (always one at least).
    With a top_k only the max_top_k largest logits of each row are sorted (torch.topk; max_top_k,
    the largest top_k, is known on the host), not the whole vocabulary: ties with a k-th beyond
    them are counted."""
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    width = min(max_top_k or vocab_size, vocab_size) if top_k is not None else vocab_size
    # (descending; torch.topk of a whole row is slower than its sort)
    values = logits.topk(width, dim=-1).values if width < vocab_size else logits.sort(dim=-1, descending=True).values
    kth = values.gather(1, top_k.clamp(1, width)[:, None] - 1) if top_k is not None else None
    if top_p is None:
        return logits.masked_fill(logits < kth, _NEG_INF)
    weights = (values - values[:, :1]).exp()  # (probabilities, not normalised)
    if kth is not None:
        weights = weights.masked_fill(values < kth, 0)
        beyond = (logits >= kth).sum(dim=-1, keepdim=True) - (values >= kth).sum(dim=-1, keepdim=True)
        total = weights.sum(dim=-1, keepdim=True) + beyond * (kth - values[:, :1]).exp()
    else:
        total = weights.sum(dim=-1, keepdim=True)
    # a token stays if the tokens before it hold less than p: the first, and one past each such sum
    below = torch.searchsorted(weights.cumsum(dim=-1), top_p[:, None] * total)
    threshold = values.gather(1, (below + 1).clamp(max=width) - 1)
    if kth is not None:  # (rounding at p = 1 never lets top_p keep what top_k dropped)
        threshold = torch.maximum(threshold, kth)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits with -inf where the row's bitmask (int32 words of 32 tokens, a grammar's: xgrammar's
    layout) has the token's bit clear."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    bits = (bitmask[:, cols // 32] >> (cols % 32)) & 1
    return logits.masked_fill(bits == 0, _NEG_INF)


@triton.jit
def _masked_fp32_kernel(logits, bitmask, out, s_l, s_b, vocab, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    pdl_wait(USE_PDL)
    bits = tl.load(bitmask + row * s_b + cols // 32, mask=inside, other=0)
    x = tl.load(logits + row * s_l + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + row * vocab + cols, tl.where(((bits >> (cols % 32)) & 1) != 0, x, -float("inf")), mask=inside)


def masked_fp32(logits: torch.Tensor, bitmask: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """apply_bitmask's, in fp32 and a tensor of its own (which the masks after it may write): the
    copy and the mask in one pass on the Triton path."""
    if not use_triton(logits):
        return apply_bitmask(logits.float(), bitmask)
    rows, vocab = logits.shape
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    _masked_fp32_kernel[(rows, triton.cdiv(vocab, block))](logits, bitmask, out, logits.stride(0), bitmask.stride(0),
                                                           vocab, BLOCK=block, **pdl(logits))
    return out


def sample_ref(logits, temperature, top_k, top_p, min_p, max_top_k, generators, greedy=None, bitmask=None):
    if bitmask is not None:
        logits = apply_bitmask(logits, bitmask)
    if greedy is True:
        return logits.argmax(dim=-1)
    argmax = logits.argmax(dim=-1) if greedy is not None else None
    logits = logits / temperature[:, None]
    if min_p is not None:
        logits = apply_min_p(logits, min_p)
    logits = apply_top_k_top_p(logits, top_k, top_p, max_top_k)
    # Exp(1) noise as -log(U): on the CPU four times faster than exponential_()
    uniform = torch.rand_like(logits)
    for i, gen in enumerate(generators):
        if gen is not None:
            uniform[i].uniform_(generator=gen)
    # argmax(p / q) = argmax(log p - log q) = argmax(logits - log q): no softmax needed
    drawn = logits.sub_(uniform.log_().neg_().log_()).argmax(dim=-1)
    return drawn if argmax is None else torch.where(greedy, argmax, drawn)


@triton.jit(do_not_specialize=["s_v", "width"])  # (the batch's largest top_k: no compilation mid-serving)
def _count_kernel(logits, values, top_k, counts, s_l, s_v, vocab, width, chunks,
                  CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    """counts[row, chunk]: the chunk's logits at or above the row's k-th largest."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = cols < vocab
    pdl_wait(USE_PDL)
    k = tl.minimum(tl.load(top_k + row), width).to(tl.int32)
    kth = tl.load(values + row * s_v + k - 1)
    x = tl.load(logits + row * s_l + cols, mask=inside, other=0.0)
    tl.store(counts + row * chunks + chunk, tl.sum((inside & (x >= kth)).to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["s_v", "width", "has_top_k", "has_top_p", "has_min_p", "has_counts"])
def _threshold_kernel(values, temperature, top_k, top_p, min_p, counts, thresholds, s_v, width, chunks,
                      has_top_k, has_top_p, has_min_p, has_counts,
                      TILE: tl.constexpr, CHUNKS: tl.constexpr, USE_PDL: tl.constexpr):
    """thresholds[row]: the least logit the row keeps. values: its largest logits, descending.
    What the batch asks for is a runtime flag: one compiled kernel serves every batch."""
    row = tl.program_id(0)
    pdl_wait(USE_PDL)
    t = tl.load(temperature + row)
    top = tl.load(values + row * s_v)
    lower = -float("inf")
    kth = -float("inf")
    if has_top_k:
        kth = tl.load(values + row * s_v + tl.minimum(tl.load(top_k + row), width).to(tl.int32) - 1)
        lower = kth
    if has_min_p:  # (p / p_max >= min_p at temperature t)
        lower = tl.maximum(lower, top + t * tl.log(tl.load(min_p + row)))
    if has_top_p:
        p = tl.load(top_p + row)
        total = 0.0
        within = 0  # (the values at or above the k-th)
        for start in range(0, width, TILE):
            cols = start + tl.arange(0, TILE)
            v, w = _kept_weights(values + row * s_v, cols, width, lower, top, t)
            total += tl.sum(w, axis=0)
            within += tl.sum((v >= kth).to(tl.int32), axis=0)
        if has_counts:  # (ties with the k-th beyond the values, where top_k is what bounds the row)
            parts = tl.arange(0, CHUNKS)
            beyond = tl.sum(tl.load(counts + row * chunks + parts, mask=parts < chunks, other=0), axis=0) - within
            total += tl.where(kth >= lower, beyond.to(tl.float32) * tl.exp((kth - top) / t), 0.0)
        # the first value whose running sum reaches p * total (the last if rounding keeps it short)
        target = p * total
        run = 0.0
        first = width - 1
        for start in range(0, width, TILE):
            cols = start + tl.arange(0, TILE)
            _, w = _kept_weights(values + row * s_v, cols, width, lower, top, t)
            reached = (tl.cumsum(w, axis=0) + run >= target) & (cols < width)
            first = tl.minimum(first, tl.min(tl.where(reached, cols, width - 1), axis=0))
            run += tl.sum(w, axis=0)
        lower = tl.maximum(lower, tl.load(values + row * s_v + first))
    tl.store(thresholds + row, lower)


@triton.jit
def _kept_weights(values, cols, width, lower, top, t):
    """The values at cols of a row's largest (descending), and their probabilities relative to
    the largest's (0 for those below lower)."""
    v = tl.load(values + cols, mask=cols < width, other=-float("inf"))
    return v, tl.where(v >= lower, tl.exp((v - top) / t), 0.0)


@triton.jit(do_not_specialize=["s_b", "has_threshold", "greedy_rows", "has_bitmask"])
def _race_kernel(logits, temperature, thresholds, seeds, keys, greedy, bitmask, s_l, s_b, vocab,
                 has_threshold, greedy_rows, has_bitmask, CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    """keys[row]: the least key of the row's kept tokens, the key of a score (logit / t - log(q),
    q = -log(U) ~ Exp(1) from the row's seed and the token's index: Philox gives four numbers a
    call, a chunk's four quarters take one each; a greedy row's logit alone) and a token: the
    score's bits ordered as an int32 and inverted in the high half (the greatest score the least
    key), the token in the low (ties: the first token, as an argmax). greedy_rows: 0 none, 1 the
    rows of greedy, 2 all. A token is kept at or above the row's threshold and, with has_bitmask,
    where its bit in the row's bitmask is set (a grammar's tokens, int32 words of 32)."""
    QUARTER: tl.constexpr = CHUNK // 4
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    i = tl.arange(0, QUARTER)
    u0, u1, u2, u3 = tl.rand4x(tl.load(seeds + row), chunk * QUARTER + i)
    pdl_wait(USE_PDL)
    # (a parameter the batch does not ask for is another tensor of its type, never read)
    is_greedy = greedy_rows == 2
    if greedy_rows == 1:
        is_greedy = tl.load(greedy + row) != 0
    t = 1.0
    if greedy_rows != 2:
        t = tl.load(temperature + row)
    threshold = -float("inf")
    if has_threshold != 0:
        threshold = tl.load(thresholds + row)
    first = logits + row * s_l
    words = bitmask + row * s_b
    cols = chunk * CHUNK + i
    best = _best(first, words, cols, u0, t, threshold, vocab, is_greedy, has_bitmask)
    best = tl.minimum(best, _best(first, words, cols + QUARTER, u1, t, threshold, vocab, is_greedy, has_bitmask))
    best = tl.minimum(best, _best(first, words, cols + 2 * QUARTER, u2, t, threshold, vocab, is_greedy, has_bitmask))
    best = tl.minimum(best, _best(first, words, cols + 3 * QUARTER, u3, t, threshold, vocab, is_greedy, has_bitmask))
    tl.atomic_min(keys + row, best)


@triton.jit
def _best(row, words, cols, u, t, threshold, vocab, is_greedy, has_bitmask):
    """The least key of these tokens of the row (-inf's score for those not kept)."""
    inside = cols < vocab
    x = tl.load(row + cols, mask=inside, other=-float("inf")).to(tl.float32)
    kept = inside & (x >= threshold)
    if has_bitmask != 0:
        bits = tl.load(words + cols // 32, mask=inside, other=0)
        kept = kept & (((bits >> (cols % 32)) & 1) != 0)
    score = tl.where(kept, tl.where(is_greedy, x, x / t - tl.log(-tl.log(u))), -float("inf"))
    bits = score.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # (a float's order as a signed integer's)
    return tl.min(((~ordered).to(tl.int64) << 32) | cols.to(tl.int64), axis=0)


def _seeds(rows: int, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """A seed a row: a seeded row's from its generator, the others' from torch's."""
    seeds = torch.randint(_SEED_HIGH, (rows,), device=device)
    if not any(g is not None for g in generators):
        return seeds
    own = [seeds[i : i + 1] if g is None else torch.randint(_SEED_HIGH, (1,), generator=g, device=device)
           for i, g in enumerate(generators)]
    return torch.cat(own)


def thresholds_triton(logits, temperature, top_k, top_p, min_p, max_top_k, chunk: int) -> torch.Tensor | None:
    """The least logit each row keeps (None: every token), for contiguous logits."""
    if top_k is None and top_p is None and min_p is None:
        return None
    rows, vocab = logits.shape
    width = min(max_top_k or vocab, vocab) if top_k is not None else vocab
    if width < vocab:
        values = logits.topk(width, dim=-1).values
    elif top_k is not None or top_p is not None:
        values = logits.sort(dim=-1, descending=True).values
    else:  # (min_p alone: the row's maximum)
        values, width = logits.amax(dim=-1, keepdim=True), 1
    chunks = triton.cdiv(vocab, chunk)
    count_ties = top_k is not None and top_p is not None and width < vocab  # (the k-th's ties beyond the values)
    counts = torch.empty((rows, chunks) if count_ties else 1, dtype=torch.int32, device=logits.device)
    if count_ties:
        _count_kernel[(rows, chunks)](logits, values, top_k, counts, logits.stride(0), values.stride(0), vocab,
                                      width, chunks, CHUNK=chunk, **pdl(logits))
    thresholds = torch.empty(rows, dtype=torch.float32, device=logits.device)
    asked = [int(v is not None) for v in (top_k, top_p, min_p)] + [int(count_ties)]
    # (a parameter the batch does not ask for: another tensor of its type in its place, never read)
    _threshold_kernel[(rows,)](
        values, temperature, top_k if top_k is not None else counts.new_empty(1, dtype=torch.int64),
        temperature if top_p is None else top_p, temperature if min_p is None else min_p, counts, thresholds,
        values.stride(0), width, chunks, *asked, TILE=1024, CHUNKS=next_pow2(chunks), **pdl(logits))
    return thresholds


def sample_triton(logits, temperature, top_k, top_p, min_p, max_top_k, generators, greedy=None, bitmask=None,
                  *, chunk: int = 2048) -> torch.Tensor:
    rows, vocab = logits.shape
    logits = logits.contiguous()
    keys = torch.full((rows,), 2**63 - 1, dtype=torch.int64, device=logits.device)
    # (what the batch does not ask for: another tensor of its type in its place, never read; an
    # all-greedy batch draws no noise: its seeds are the keys)
    all_greedy = greedy is True
    seeds = keys if all_greedy else _seeds(rows, generators, logits.device)
    thresholds = None if all_greedy else thresholds_triton(logits, temperature, top_k, top_p, min_p, max_top_k, chunk)
    unused = keys.view(torch.float32)
    _race_kernel[(rows, triton.cdiv(vocab, chunk))](
        logits, unused if temperature is None else temperature, unused if thresholds is None else thresholds, seeds,
        keys, keys.view(torch.bool) if greedy is None or all_greedy else greedy,
        keys.view(torch.int32) if bitmask is None else bitmask, logits.stride(0),
        0 if bitmask is None else bitmask.stride(0), vocab, int(thresholds is not None),
        2 if all_greedy else int(greedy is not None), int(bitmask is not None), CHUNK=chunk, **pdl(logits))
    return keys & 0xFFFFFFFF


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    max_top_k: int | None,
    generators: list[torch.Generator | None],
    greedy: torch.Tensor | bool | None = None,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token a row (int64) drawn from the logits (fp32 where a threshold is asked; else also
    the model's bf16 or fp16, each value taken as its fp32 value). greedy: the rows that take the
    argmax instead ([B] bool; True: all, temperature None then), their temperature not read.
    bitmask: [B, ceil(vocab / 32)] int32, the tokens each row may take (a grammar's), applied as
    the row is read (the Triton path writes no masked copy)."""
    return (sample_triton if use_triton(logits) else sample_ref)(
        logits, temperature, top_k, top_p, min_p, max_top_k, generators, greedy, bitmask
    )
