"""Reference greedy decoding with Hugging Face transformers, recording how close each step's
top-2 logits were, and the comparison rule for token sequences."""

from __future__ import annotations

import inspect

import torch


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens and, per step, the gap between the reference's top-2 logits (each step one
    token through transformers' KV cache, as its generate runs)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # (5.x: cache)
    ids, past = torch.tensor([prompt_ids], device=model.device), None
    tokens, gaps = [], []
    for _ in range(n):
        out = model(ids, use_cache=True, **{name: past})
        top2 = out.logits[0, -1].float().topk(2)
        tokens.append(int(top2.indices[0]))
        gaps.append(float(top2.values[0] - top2.values[1]))
        ids, past = top2.indices[:1][None], getattr(out, name)
    return tokens, gaps


def assert_greedy_match(ours: list[int], ref: list[int], gaps: list[float], tol: float) -> int:
    """Tokens must be equal up to the first step where the reference's top-2 logits are within
    tol (a near-tie may flip; nothing else may). Returns how many tokens were compared."""
    assert len(ours) == len(ref), (len(ours), len(ref))
    for i, (a, b) in enumerate(zip(ours, ref)):
        if gaps[i] < tol:
            return i
        assert a == b, (
            f"token {i}: ours {a} != reference {b} (top-2 gap {gaps[i]:.4g} >= {tol}); ours {ours}, reference {ref}"
        )
    return len(ref)
