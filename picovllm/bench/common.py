"""Shared benchmark helpers: the memory-bandwidth ceiling, model byte counts, result tables."""
from __future__ import annotations

import json
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Measured copy bandwidth in bytes/s, counting bytes read and written (as gpt-fast and
    the roofline do)."""
    nbytes = nbytes or ((2 << 30) if device.type == "cuda" else (256 << 20))
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    reps = 20 if device.type == "cuda" else 5
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - start)


def decode_bytes_per_step(model: torch.nn.Module, batch: int, context: int, kv_bytes_per_token: int) -> int:
    """Bytes a decode step must read: every weight once (the embedding only for the batch's rows
    unless it is tied to the LM head) plus the KV cache of each sequence."""
    total = 0
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if "embed_tokens" in name and not getattr(model.config, "tie_word_embeddings", False):
            total += batch * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total + batch * context * kv_bytes_per_token


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format)."""
    headers = [h for _, h, _ in columns]
    cells = [[("-" if r.get(k) is None else format(r[k], f)) for k, _, f in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def print_json(kind: str, payload: dict) -> None:
    print(json.dumps({"benchmark": kind, **payload}))
