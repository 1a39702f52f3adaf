"""Shared benchmark helpers: the memory-bandwidth and GEMM ceilings, model byte and FLOP counts,
result tables."""

from __future__ import annotations

import json
import math
import sys
import time

import numpy as np
import torch

from picovllm.model.layers.linear import LinearBase, linear, pack_weights


def ms_stats(seconds: list[float]) -> dict[str, float]:
    """Mean, p50, p90 and p99 of times in seconds, in ms ({} for none)."""
    a = np.asarray(seconds) * 1e3
    if not len(a):
        return {}
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_rate(fn, amount: float, device: torch.device, reps: int) -> float:
    """amount (of bytes, FLOPs...) per call of fn, per second: one call untimed, then reps timed."""
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return amount * reps / (time.perf_counter() - start)


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Measured copy bandwidth in bytes/s, counting bytes read and written (as gpt-fast and
    the roofline do)."""
    nbytes = nbytes or ((2 << 30) if device.type == "cuda" else (256 << 20))
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return measure_rate(lambda: dst.copy_(src), 2 * nbytes, device, 20 if device.type == "cuda" else 5)


def matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Measured dense GEMM throughput in FLOP/s: square matrices of the model's dtype (8,192 on a
    GPU, 1,024 on a CPU), the compute ceiling as copy_bandwidth is the memory one. On a CPU the
    engine's own linear() on a weight prepared as the engine prepares its weights (pack_weights:
    oneDNN's layout, or plain, multiplied in fp32 where oneDNN has no GEMM for bf16 or fp16); torch's
    matmul there may run another GEMM at another rate (bf16's at a hundredth of fp32's on an AVX2 CPU)."""
    if device.type == "cpu":
        n = 1024
        layer = LinearBase(n, n, bias=False, tp_dim=None).to(dtype)
        layer.weight.data.normal_()
        pack_weights(layer)
        x = torch.randn(n, n).to(dtype)
        return measure_rate(lambda: linear(x, layer.weight), 2 * n**3, device, 3)
    n = 8192
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return measure_rate(lambda: a @ b, 2 * n**3, device, 20)


def forward_flops(model: torch.nn.Module, num_new: int, num_cached: int) -> int:
    """FLOPs of a forward that computes num_new tokens after num_cached cached ones and samples
    the last: every linear layer's weights once per token (2 FLOPs per weight), causal attention
    (QK^T and PV over each query's keys, its own included), the LM head for one row."""
    cfg = model.config
    linear = sum(
        p.numel()
        for name, p in model.named_parameters()
        if p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name
    )
    keys = num_new * num_cached + num_new * (num_new + 1) // 2  # summed over the new queries
    attention = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers * keys
    return 2 * linear * num_new + attention + 2 * cfg.vocab_size * cfg.hidden_size


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


class Floors:
    """A prompt's forward's time floor on this device (its time to first token, were nothing else
    in the way): the larger of its FLOPs at the measured GEMM throughput and its bytes (the
    weights once, the sequences' KV) at the measured copy bandwidth."""

    def __init__(self, llm):
        engine = llm.llm_engine
        self.model = engine.executor.driver.model_runner.model
        self.kv_token_bytes = engine.kv_block_bytes // engine.config.block_size
        self.flop_s = matmul_flops(engine.device, engine.dtype)
        self.byte_s = copy_bandwidth(engine.device)

    def seconds(self, prompt_len: int, cached: int = 0, batch: int = 1) -> float:
        """batch prompts of prompt_len tokens, the first `cached` of each cached, in one forward."""
        nbytes = decode_bytes_per_step(self.model, batch, prompt_len, self.kv_token_bytes)
        flops = batch * forward_flops(self.model, prompt_len - cached, cached)
        return max(flops / self.flop_s, nbytes / self.byte_s)


def progress(text: str) -> None:
    """A line on stderr saying what the benchmark runs now (a run takes minutes on a CPU)."""
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format); nothing when there are no rows."""
    if not rows:
        return
    headers = [h for _, h, _ in columns]
    cells = [[("-" if r.get(k) is None else format(r[k], f)) for k, _, f in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def to_json(value) -> str:
    """value as JSON, a number that JSON has not (inf, nan: an unbounded request rate) as null."""

    def finite(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        return [finite(x) for x in v] if isinstance(v, list | tuple) else v

    return json.dumps(finite(value), allow_nan=False)


def print_json(kind: str, payload: dict) -> None:
    print(to_json({"benchmark": kind, **payload}))


def plot_latency(rows: list[dict], path: str) -> None:
    """Decode tok/s per batch size for each system, with the achieved fraction of the copy
    bandwidth on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = sorted({r["system"] for r in rows}, key=lambda s: s != "picovllm")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax2 = ax.twinx()
    for system in systems:
        pts = sorted((r["batch"], r["decode_tok_s"], r["bw_frac"]) for r in rows if r["system"] == system)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{system} tok/s")
        ax2.plot(
            [p[0] for p in pts], [100 * p[2] for p in pts], linestyle="--", marker="x", label=f"{system} % of copy BW"
        )
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="decode tok/s")
    batches = sorted({r["batch"] for r in rows})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax2.set_ylabel("% of copy bandwidth")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
