"""Disaggregated prefill on the engine: a prefill instance computes the prompt and holds its KV, a
decode instance pulls it over NIXL (UCX over TCP on loopback) and generates what a colocated
engine generates. Both engines in this process, each with its own NIXL agent."""

import os
import time

import pytest

from picovllm.distributed.kv_transfer import nixl_api

try:
    nixl_api()
except ModuleNotFoundError as e:
    pytest.skip(str(e), allow_module_level=True)
os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from conftest import engine_args  # noqa: E402

from picovllm import LLMEngine, SamplingParams  # noqa: E402

PROMPTS = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([5, 16, 17, 40, 33])]


def _engine(path, **kwargs) -> LLMEngine:
    kwargs = engine_args(path, skip_tokenizer_init=True, **kwargs)
    kwargs.setdefault("kv_cache_memory", 1 << 20)  # 16-token blocks: a few dozen
    return LLMEngine.from_engine_args(**kwargs)


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams, dict | None]]) -> dict:
    for rid, ids, params, kv in requests:
        engine.add_validated_request(rid, None, ids, params, kv)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return outs


def _disaggregated(prefill, decode, prompts, params, prefix="r"):
    """Each prompt through the prefill instance (max_tokens 1), then the decode instance."""
    first = SamplingParams(temperature=0, max_tokens=1)
    held = _run(prefill, [(f"{prefix}{i}", p, first, {"do_remote_decode": True}) for i, p in enumerate(prompts)])
    kv = {rid: out.kv_transfer_params for rid, out in held.items()}
    assert all(k["remote_num_tokens"] == len(p) for k, p in zip(kv.values(), prompts))
    return _run(decode, [(f"{prefix}{i}", p, params, kv[f"{prefix}{i}"]) for i, p in enumerate(prompts)])


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in outs[rid].outputs] for rid in sorted(outs)]


@pytest.fixture(scope="module")
def colocated(tiny_qwen):
    return _engine(tiny_qwen[0])


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_decode_instance_generates_what_a_colocated_engine_does(tiny_qwen, colocated, mode):
    prefill = _engine(tiny_qwen[0], kv_role="prefill", kv_transfer_mode=mode)
    decode = _engine(tiny_qwen[0], kv_role="decode", kv_transfer_mode=mode)
    prefill.debug_invariants = decode.debug_invariants = True
    for params in [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=8, ignore_eos=True, logprobs=2),
    ]:
        ref = _run(colocated, [(f"r{i}", p, params, None) for i, p in enumerate(PROMPTS)])
        got = _disaggregated(prefill, decode, PROMPTS, params)
        assert _tokens(got) == _tokens(ref)
    m = decode.get_metrics()
    assert m["kv_transfers_done"] == m["kv_transfers_started"] > 0 and m["kv_transfers_failed"] == 0
    # D's pulls released P's leases: everything back, nothing held for pickup
    _settle(prefill)
    assert prefill.get_metrics()["kv_blocks_held_for_pickup"] == 0
    for engine in (prefill, decode):
        assert (
            engine.reset_prefix_cache()
            and engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
        )
        engine.shutdown()


def _settle(prefill: LLMEngine, timeout: float = 5.0) -> None:
    """Let the prefill instance take the releases in (as its server loop does while idle)."""
    deadline = time.monotonic() + timeout
    while prefill.kv_busy and time.monotonic() < deadline:
        prefill.step()
        time.sleep(0.01)


def test_decode_pulls_only_what_its_prefix_cache_lacks(tiny_qwen):
    prefill = _engine(tiny_qwen[0], kv_role="prefill")
    decode = _engine(tiny_qwen[0], kv_role="decode")
    shared = list(range(100, 164))  # four full blocks
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    _disaggregated(prefill, decode, [shared + [7, 8, 9]], params, prefix="a")
    pulled = decode.get_metrics()["kv_transfer_blocks"]
    assert pulled == 5  # 66 tokens before the last: 4 full blocks and a partial one
    out = _disaggregated(prefill, decode, [shared + [1, 2, 3, 4, 5]], params, prefix="b")["b0"]
    assert out.num_cached_tokens == 64  # D's own prefix cache
    assert decode.get_metrics()["kv_transfer_blocks"] - pulled == 1  # only the block after the shared ones
    prefill.shutdown()
    decode.shutdown()


def test_an_unpulled_lease_expires_and_frees_the_blocks(tiny_qwen):
    prefill = _engine(tiny_qwen[0], kv_role="prefill", kv_lease_s=0.2, enable_prefix_caching=False)
    free = prefill.block_manager.num_free_blocks
    out = _run(prefill, [("x", PROMPTS[3], SamplingParams(max_tokens=1), {"do_remote_decode": True})])["x"]
    assert len(out.kv_transfer_params["remote_block_ids"]) == 3
    assert prefill.block_manager.num_free_blocks == free - 3 and prefill.kv_busy
    prefill.check_invariants()
    _settle(prefill)
    assert prefill.block_manager.num_free_blocks == free and not prefill.kv_busy
    assert prefill.get_metrics()["kv_leases_expired"] == 1
    prefill.shutdown()


def test_held_prompts_bound_a_prefill_instance_a_new_prompt_waits_for_a_lease_to_end(tiny_qwen):
    """Back-pressure: prompts awaiting pickup hold their blocks; when they fill the pool, the next
    prompt waits (it neither fails nor takes held blocks) until a lease ends."""
    prefill = _engine(
        tiny_qwen[0], kv_role="prefill", kv_lease_s=0.5, enable_prefix_caching=False, num_gpu_blocks_override=8
    )
    first = SamplingParams(max_tokens=1)
    held = _run(prefill, [(f"h{i}", PROMPTS[3][:-1] + [i], first, {"do_remote_decode": True}) for i in range(2)])
    assert prefill.block_manager.num_free_blocks == 2 and len(held) == 2
    prefill.add_validated_request("next", None, PROMPTS[3], first, {"do_remote_decode": True})
    start = time.monotonic()
    while time.monotonic() - start < 0.3:  # (the leases still run)
        assert prefill.step() == []
        assert prefill.get_metrics()["num_waiting"] == 1
        prefill.check_invariants()
    out = _run(prefill, [])
    assert set(out) == {"next"} and out["next"].kv_transfer_params["remote_num_tokens"] == len(PROMPTS[3])
    assert prefill.get_metrics()["kv_leases_expired"] >= 1  # (what let it in)
    _settle(prefill)
    assert prefill.get_metrics()["kv_leases_expired"] == 3 and prefill.block_manager.num_free_blocks == 8
    prefill.shutdown()


def test_a_pull_from_a_gone_prefill_instance_is_prefilled_here(tiny_qwen, colocated):
    prefill = _engine(tiny_qwen[0], kv_role="prefill")
    decode = _engine(tiny_qwen[0], kv_role="decode")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    held = _run(prefill, [("g", PROMPTS[3], SamplingParams(max_tokens=1), {"do_remote_decode": True})])
    prefill.shutdown()  # its pool unregistered: the pull cannot read it
    del prefill
    out = _run(decode, [("g", PROMPTS[3], params, held["g"].kv_transfer_params)])["g"]
    ref = _run(colocated, [("g", PROMPTS[3], params, None)])["g"]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert decode.get_metrics()["kv_transfers_failed"] == 1
    assert decode.reset_prefix_cache() and decode.block_manager.num_free_blocks == decode.block_manager.num_total_blocks
    decode.shutdown()


def test_kv_transfer_params_are_checked_against_the_role(tiny_qwen, colocated):
    with pytest.raises(ValueError, match="kv_transfer_params: do_remote_decode needs a prefill instance"):
        colocated.add_validated_request("z", None, [1, 2, 3], SamplingParams(), {"do_remote_decode": True})
    decode = _engine(tiny_qwen[0], kv_role="decode")
    bad = {"remote_block_ids": [0], "remote_num_tokens": 9, "remote_agent": {}, "remote_request_id": "q"}
    with pytest.raises(ValueError, match="not the same prompt"):
        decode.add_validated_request("z", None, [1, 2, 3], SamplingParams(), bad)
    assert not decode.has_unfinished_requests()
    decode.shutdown()
