"""The engine's counters and gauges, as LLMEngine.get_metrics reports them (the server exports
them as Prometheus metrics: entrypoints/openai/metrics.py)."""

from __future__ import annotations

from picovllm.engine.kv_handoff import KVHandoff
from picovllm.engine.scheduler import Scheduler

OFFLOAD_METRICS = {  # LLMEngine.get_metrics' keys with a host tier (kv_offload_memory), and what they count
    "prefix_cache_host_hit_tokens": "Prompt tokens served by prefix-cache blocks promoted from the host tier.",
    "kv_offload_blocks_total": "Blocks of the host tier.",
    "kv_offload_blocks_free": "Free blocks of the host tier.",
    "kv_offload_demoted_blocks": "GPU blocks the prefix cache evicted to the host tier (no copy if already there).",
    "kv_offload_promoted_blocks": "Host-tier blocks the prefix cache brought back to the GPU on a hit.",
    "kv_offload_evicted_blocks": "Blocks the host tier evicted.",
    "kv_offload_bytes_to_host": "Bytes copied from the GPU to the host tier (per rank; demotions and swaps).",
    "kv_offload_bytes_to_gpu": "Bytes copied from the host tier to the GPU (per rank; promotions and swaps).",
    "num_swapped_out": "Preemptions that swapped the request's KV to the host tier (preemption_mode 'swap').",
}


def engine_stats(scheduler: Scheduler, kv_handoff: KVHandoff | None, kv_block_bytes: int) -> dict[str, int]:
    """What LLMEngine.get_metrics reports: the KV pool's blocks, the prefix cache's counters, the
    queues, the host tier's (OFFLOAD_METRICS) and a prefill or decode instance's."""
    bm, cache = scheduler.block_manager, scheduler.cache
    return {
        "kv_blocks_total": bm.num_total_blocks,
        "kv_blocks_free": bm.num_free_blocks,
        "kv_blocks_cached": cache.num_cached_blocks,
        "prefix_cache_queried_tokens": cache.queried_tokens,
        "prefix_cache_hit_tokens": cache.hit_tokens,
        "prefix_cache_evicted_blocks": cache.evicted_blocks,
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting) + len(scheduler.transferring),
        "num_preemptions": scheduler.num_preemptions,
        **(_offload_stats(scheduler, kv_block_bytes) if bm.host is not None else {}),
        **(kv_handoff.get_metrics() if kv_handoff is not None else {}),
    }


def _offload_stats(scheduler: Scheduler, kv_block_bytes: int) -> dict[str, int]:
    """The host tier's (kv_offload_memory): OFFLOAD_METRICS."""
    bm, cache = scheduler.block_manager, scheduler.cache
    to_gpu, to_host = bm.copied_blocks
    return {
        "prefix_cache_host_hit_tokens": cache.host_hit_tokens,
        "kv_offload_blocks_total": bm.host.num_blocks,
        "kv_offload_blocks_free": bm.host.num_free,
        "kv_offload_demoted_blocks": cache.demoted_blocks,
        "kv_offload_promoted_blocks": cache.promoted_blocks,
        "kv_offload_evicted_blocks": cache.host_evicted_blocks,
        "kv_offload_bytes_to_host": to_host * kv_block_bytes,
        "kv_offload_bytes_to_gpu": to_gpu * kv_block_bytes,
        "num_swapped_out": scheduler.num_swapped_out,
    }
