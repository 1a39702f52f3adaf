"""Disaggregated prefill on the engine: a prefill instance computes the prompt and holds its KV, a
decode instance pulls it over NIXL (UCX over TCP on loopback) and generates what a colocated
engine generates. Both engines in this process, each with its own NIXL agent."""

import time

import pytest
import torch
from conftest import TEST_DEVICE, engine_args, need_nixl

need_nixl()


from picovllm import LLMEngine, SamplingParams  # noqa: E402
from picovllm.kv_transfer_params import KVTransferParams  # noqa: E402

PROMPTS = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([5, 16, 17, 40, 33])]


def _engine(path, **kwargs) -> LLMEngine:
    kwargs = engine_args(path, skip_tokenizer_init=True, **kwargs)
    kwargs.setdefault("kv_cache_memory", 1 << 20)  # 16-token blocks: a few dozen
    return LLMEngine.from_engine_args(**kwargs)


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams, KVTransferParams | None]]) -> dict:
    for rid, ids, params, kv in requests:
        engine.add_validated_request(rid, None, ids, params, kv)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return outs


def _disaggregated(prefill, decode, prompts, params, prefix="r"):
    """Each prompt through the prefill instance (max_tokens 1), then the decode instance."""
    first = SamplingParams(temperature=0, max_tokens=1)
    held = _run(prefill, [(f"{prefix}{i}", p, first, DO_REMOTE_DECODE) for i, p in enumerate(prompts)])
    kv = {rid: out.kv_transfer_params for rid, out in held.items()}
    assert all(k.remote_num_tokens == len(p) for k, p in zip(kv.values(), prompts))
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
    out = _run(prefill, [("x", PROMPTS[3], SamplingParams(max_tokens=1), DO_REMOTE_DECODE)])["x"]
    assert len(out.kv_transfer_params.remote_block_ids) == 3
    assert prefill.block_manager.num_free_blocks == free - 3 and prefill.kv_busy
    prefill.check_invariants()
    _settle(prefill)
    assert prefill.block_manager.num_free_blocks == free and not prefill.kv_busy
    assert prefill.get_metrics()["kv_leases_expired"] == 1
    prefill.shutdown()


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_held_prompts_bound_a_prefill_instance_a_new_prompt_waits_for_a_lease_to_end(tiny_qwen, prefix_caching):
    """Back-pressure: prompts awaiting pickup hold their blocks; when they fill the pool, the next
    prompt waits (it neither fails nor takes held blocks) until a lease ends. With the prefix cache
    on, a lease locks its prompt's blocks in the tree as a live request does: they are not counted
    as evictable (they were, and the next prompt's allocation failed)."""
    prefill = _engine(
        tiny_qwen[0],
        kv_role="prefill",
        kv_lease_s=0.5,
        enable_prefix_caching=prefix_caching,
        num_gpu_blocks_override=8,
    )
    prefill.debug_invariants = True
    first = SamplingParams(max_tokens=1)
    distinct = [[100 * i + 60 + j for j in range(40)] for i in range(2)]  # (no shared prefix)
    held = _run(prefill, [(f"h{i}", p, first, DO_REMOTE_DECODE) for i, p in enumerate(distinct)])
    assert prefill.block_manager.num_free_blocks == 2 and len(held) == 2
    prefill.add_validated_request("next", None, PROMPTS[3], first, DO_REMOTE_DECODE)
    start = time.monotonic()
    while time.monotonic() - start < 0.3:  # (the leases still run)
        assert prefill.step() == []
        assert prefill.get_metrics()["num_waiting"] == 1
        prefill.check_invariants()
    out = _run(prefill, [])
    assert set(out) == {"next"} and out["next"].kv_transfer_params.remote_num_tokens == len(PROMPTS[3])
    assert prefill.get_metrics()["kv_leases_expired"] >= 1  # (what let it in)
    _settle(prefill)
    assert prefill.get_metrics()["kv_leases_expired"] == 3
    assert prefill.reset_prefix_cache() and prefill.block_manager.num_free_blocks == 8
    prefill.shutdown()


def test_a_pull_from_a_gone_prefill_instance_is_prefilled_here(tiny_qwen, colocated):
    prefill = _engine(tiny_qwen[0], kv_role="prefill")
    decode = _engine(tiny_qwen[0], kv_role="decode")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    held = _run(prefill, [("g", PROMPTS[3], SamplingParams(max_tokens=1), DO_REMOTE_DECODE)])
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
        colocated.add_validated_request("z", None, [1, 2, 3], SamplingParams(), DO_REMOTE_DECODE)
    decode = _engine(tiny_qwen[0], kv_role="decode")
    agent = {"ranks": [{"num_blocks": 4}]}
    bad = KVTransferParams(remote_request_id="q", remote_agent=agent, remote_block_ids=(0,), remote_num_tokens=9)
    with pytest.raises(ValueError, match="not the same prompt"):
        decode.add_validated_request("z", None, [1, 2, 3], SamplingParams(), bad)
    assert not decode.has_unfinished_requests()
    decode.shutdown()


DO_REMOTE_DECODE = KVTransferParams(do_remote_decode=True)


def test_kv_transfer_params_are_parsed_whole_or_refused():
    """from_dict takes a request's JSON once, at the door; to_dict gives it back as it came."""
    agent = {"ranks": [{"num_blocks": 8}]}
    answer = {
        "remote_agent": agent,
        "remote_request_id": "r",
        "remote_block_ids": [3, 7],
        "remote_num_tokens": 20,
        "remote_lease_s": 30.0,
        "remote_compat": {"model": "m"},
    }
    kv = KVTransferParams.from_dict(answer)
    assert kv.pulls and kv.remote_block_ids == (3, 7) and kv.to_dict() == answer
    assert KVTransferParams.from_dict({"do_remote_decode": True}) == DO_REMOTE_DECODE and not DO_REMOTE_DECODE.pulls
    for bad, said in [
        ([], "must be an object"),
        ({}, "need do_remote_decode, or a prefill instance's answer"),
        ({**answer, "remote_request_id": 5}, "remote_agent or remote_request_id missing"),
        ({**answer, "remote_agent": {"ranks": []}}, "remote_agent has no ranks"),
        ({**answer, "remote_num_tokens": "20"}, "remote_num_tokens must be an integer"),
        ({**answer, "remote_block_ids": [3, 8]}, r"block ids of the prefill instance's pool \(0..7\)"),
        ({**answer, "remote_block_ids": [True]}, "block ids of the prefill instance's pool"),
        ({**answer, "remote_lease_s": 0}, "remote_lease_s must be a number > 0"),
    ]:
        with pytest.raises(ValueError, match="^kv_transfer_params: .*" + said):
            KVTransferParams.from_dict(bad)
    one = SamplingParams()
    with pytest.raises(ValueError, match="remote_block_ids do not cover the prompt"):
        kv.check("decode", 4, 20, one)
    kv.check("decode", 16, 20, one)
    with pytest.raises(ValueError, match="remote blocks need a decode instance"):
        kv.check("both", 16, 20, one)
    with pytest.raises(ValueError, match="^kv_transfer_params: prompt_logprobs"):
        kv.check("decode", 16, 20, SamplingParams(prompt_logprobs=1))


ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)
OTHER_40 = list(range(200, 240))  # (another 40-token prompt: three 16-token blocks)


def test_a_request_queued_on_the_decode_instance_keeps_its_lease(tiny_qwen, colocated):
    """The decode instance renews the lease of a request waiting in its queue, so that the prefill
    instance keeps the KV past kv_lease_s (on main it freed it, let another prompt overwrite it, and
    the pull read that: wrong tokens). P's pool holds one prompt; the next prompt waits for the lease."""
    prefill = _engine(tiny_qwen[0], kv_role="prefill", kv_lease_s=2.0, num_gpu_blocks_override=3)
    decode = _engine(tiny_qwen[0], kv_role="decode", max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    held = _run(prefill, [("a", PROMPTS[3], ONE_TOKEN, DO_REMOTE_DECODE)])["a"]
    prefill.add_validated_request("c", None, OTHER_40, ONE_TOKEN, DO_REMOTE_DECODE)  # (waits for a's blocks)
    busy = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for i in range(8):  # (D's one seat, taken for 8 x 1,019 steps)
        decode.add_validated_request(f"busy{i}", None, PROMPTS[0], busy)
    decode.add_validated_request("a", None, PROMPTS[3], params, held.kv_transfer_params)
    end = time.monotonic() + 3.0  # (a lease and a half: renewals every 0.67 s, none missed by 0.33 s)
    while time.monotonic() < end:
        decode.step()
        prefill.step()
    assert decode.get_metrics()["num_running"] == 1 and decode.get_metrics()["kv_transfers_started"] == 0
    assert prefill.get_metrics()["num_waiting"] == 1 and prefill.get_metrics()["kv_leases_expired"] == 0
    decode.abort_request([f"busy{i}" for i in range(8)])
    out = _run(decode, [])["a"]
    assert out.outputs[0].token_ids == _run(colocated, [("a", PROMPTS[3], params, None)])["a"].outputs[0].token_ids
    assert decode.get_metrics()["kv_transfers_done"] == 1
    assert set(_run(prefill, [])) == {"c"}  # (a's lease ended with the pull: c ran)
    for engine in (prefill, decode):
        engine.shutdown()


def test_a_lease_that_ended_while_the_decode_instance_was_frozen_is_not_pulled(tiny_qwen, colocated):
    """A decode instance that did not run for longer than the lease (SIGSTOP, a long GC) does not pull
    blocks the prefill instance may have reused since (on main it did: another prompt's KV); it
    prefills the prompt itself."""
    prefill = _engine(tiny_qwen[0], kv_role="prefill", kv_lease_s=0.4, num_gpu_blocks_override=3)
    decode = _engine(tiny_qwen[0], kv_role="decode")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    held = _run(prefill, [("a", PROMPTS[3], ONE_TOKEN, DO_REMOTE_DECODE)])["a"]
    decode.add_validated_request("a", None, PROMPTS[3], params, held.kv_transfer_params)  # (then D stops)
    assert set(_run(prefill, [("c", OTHER_40, ONE_TOKEN, DO_REMOTE_DECODE)])) == {"c"}  # (in a's blocks)
    assert prefill.get_metrics()["kv_leases_expired"] == 1
    out = _run(decode, [])["a"]
    assert out.outputs[0].token_ids == _run(colocated, [("a", PROMPTS[3], params, None)])["a"].outputs[0].token_ids
    m = decode.get_metrics()
    assert m["kv_pulls_skipped"] == 1 and m["kv_transfers_started"] == 0
    for engine in (prefill, decode):
        engine.shutdown()


def test_a_pull_reported_for_an_ended_lease_is_counted_as_late(tiny_qwen):
    from picovllm.distributed.kv_transfer import LeaseNotice
    from picovllm.distributed.kv_transfer.nixl import NixlKVTransfer

    prefill = _engine(tiny_qwen[0], kv_role="prefill", kv_lease_s=0.1)
    held = _run(prefill, [("a", PROMPTS[3], ONE_TOKEN, DO_REMOTE_DECODE)])["a"]
    _settle(prefill)  # (the lease ends)
    peer = NixlKVTransfer()
    peer.register(torch.zeros(1, 2, 1, 1, 1, 1))
    for kind in ("release", "pulled", "renew"):  # (only the read counts)
        peer.notify(held.kv_transfer_params.remote_agent, LeaseNotice(kind, "a"))
    deadline = time.monotonic() + 5
    while not prefill.get_metrics()["kv_late_pulls"] and time.monotonic() < deadline:
        prefill.step()
        time.sleep(0.01)
    time.sleep(0.1)
    prefill.step()
    assert prefill.get_metrics()["kv_late_pulls"] == 1 and not prefill.kv_busy
    peer.close()
    prefill.shutdown()


@pytest.mark.parametrize("mismatch", ["weights", "dtype", "kv_cache_dtype"])
def test_a_prefill_instance_of_another_model_or_dtype_is_not_pulled_from(tiny_qwen, tmp_path, mismatch):
    """P and D must hold the same KV: the same weights (two fine-tunes of one base have the same
    shapes), dtype (bf16 and fp16 have the same head bytes) and KV cache dtype (an FP8 pool's
    blocks are not fp32 ones). On main D pulled and decoded garbage; now it refuses the pull
    (counted) and prefills the prompt itself."""
    from tiny_models import build_model

    other = str(tmp_path)
    build_model(other, "qwen2", seed=7)  # (the same shapes, other weights)
    p_path, p_dtype, d_dtype, p_kv = {
        "weights": (tiny_qwen[0], "float32", "float32", "auto"),
        "dtype": (other, "bfloat16", "float16", "auto"),
        "kv_cache_dtype": (other, "float32", "float32", "fp8"),
    }[mismatch]
    prefill = _engine(p_path, kv_role="prefill", dtype=p_dtype, kv_cache_dtype=p_kv)
    decode = _engine(other, kv_role="decode", dtype=d_dtype)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    held = _run(prefill, [("a", PROMPTS[3], ONE_TOKEN, DO_REMOTE_DECODE)])["a"]
    out = _run(decode, [("a", PROMPTS[3], params, held.kv_transfer_params)])["a"]
    reference = _engine(other, dtype=d_dtype)
    assert out.outputs[0].token_ids == _run(reference, [("a", PROMPTS[3], params, None)])["a"].outputs[0].token_ids
    m = decode.get_metrics()
    assert m["kv_transfers_incompatible"] == 1 and m["kv_transfers_started"] == 0
    _settle(prefill)
    assert prefill.get_metrics()["kv_blocks_held_for_pickup"] == 0  # (D released the lease)
    for engine in (prefill, decode, reference):
        engine.shutdown()


def test_the_weights_fingerprint_is_the_same_for_every_tensor_parallel_rank_and_size(tiny_qwen):
    """The fingerprint covers each checkpoint tensor whole, before it is sharded."""
    from picovllm.config import ModelConfig
    from picovllm.model.loader.model_loader import load_model

    cfg = ModelConfig.from_dir(tiny_qwen[0])
    one = load_model(cfg, tiny_qwen[0], torch.float32, torch.device("cpu"), 256).weights_fingerprint
    dummy = [
        load_model(cfg, None, torch.float32, torch.device("cpu"), 256, seed=s).weights_fingerprint for s in (0, 0, 1)
    ]
    assert len(one) == 16 and dummy[0] == dummy[1] != dummy[2] and one not in dummy


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the order of a GPU's streams")
def test_pulls_into_blocks_freed_under_a_step_in_flight_are_not_overwritten(tmp_path):
    """With async scheduling, step k+1 is launched before step k's tokens are read. A request
    aborted while k+1 computes a chunk of its prompt frees blocks that k+1 is still writing, and
    the next step's schedule (launched ahead, a neighbour decoding) can admit a pull into them. A
    pull's copies start after the step in flight (on main the CUDA IPC copy did not wait for it:
    the chunk's KV landed on the pulled KV, and the request decoded other tokens). Each of D's steps
    first sleeps 20 ms on the GPU, so that a copy not ordered after the step lands before the step's
    stores do. P runs in a process of its own (a CUDA IPC handle opens only in another one); fp32,
    so that equal KV means equal tokens."""
    import httpx
    from tiny_models import build_model

    from picovllm.entrypoints.openai.async_engine import EngineProcess
    from picovllm.entrypoints.openai.server import build_app, serve_in_thread
    from picovllm.entrypoints.openai.serving import KV_SECRET_HEADER, kv_transfer_secret

    path = str(tmp_path)
    build_model(
        path, "qwen2", vocab_size=1024, hidden=256, heads=4, kv_heads=2, head_dim=64, layers=4, max_position=2048
    )
    fp32 = dict(dtype="float32", kv_cache_memory=None)
    prefill = EngineProcess(engine_args(path, kv_role="prefill", num_gpu_blocks_override=4096, **fp32))
    url, stop = serve_in_thread(build_app(prefill, "m"))
    colocated = _engine(path, num_gpu_blocks_override=4096, **fp32)
    # 72 blocks: a 1,100-token prompt's first chunk (1,023 tokens) takes 64, and the pulled
    # 200-token prompt (13 blocks) waits for them
    decode = _engine(path, kv_role="decode", num_gpu_blocks_override=72, max_num_batched_tokens=1024, **fp32)
    forward = decode.executor.driver.model_runner.step_logits

    def slow_step(*args, **kwargs):
        torch.cuda._sleep(40_000_000)  # (cycles: about 20 ms)
        return forward(*args, **kwargs)

    decode.executor.driver.model_runner.step_logits = slow_step
    try:
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        busy = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        rounds = 4
        pulled = [[(11 * i + j) % 300 + 1 for j in range(200)] for i in range(rounds)]
        want = _run(colocated, [(f"p{i}", p, greedy, None) for i, p in enumerate(pulled)])
        wrong = []
        for i, prompt in enumerate(pulled):
            body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": DO_REMOTE_DECODE.to_dict()}
            r = httpx.post(url + "/v1/completions", json=body, headers={KV_SECRET_HEADER: kv_transfer_secret()})
            assert decode.reset_prefix_cache()  # (the blocks the pull can take: the long prompt's)
            decode.add_validated_request(f"n{i}", None, [400 + i] * 16, busy)  # (keeps steps launching ahead)
            for _ in range(3):
                decode.step()
            decode.add_validated_request(f"long{i}", None, [(13 * i + j) % 500 + 500 for j in range(1100)], busy)
            decode.add_validated_request(
                f"p{i}", None, prompt, greedy, KVTransferParams.from_dict(r.json()["kv_transfer_params"])
            )
            while decode.get_metrics()["num_running"] < 2:  # (the long prompt's first chunk launched)
                decode.step()
            decode.abort_request(f"long{i}")  # (its chunk in flight: its blocks go to the pull)
            got = {}
            while f"p{i}" not in got:
                got.update({o.request_id: o for o in decode.step() if o.finished})
            wrong += [i] if got[f"p{i}"].outputs[0].token_ids != want[f"p{i}"].outputs[0].token_ids else []
            decode.abort_request(f"n{i}")
            _run(decode, [])
        assert not wrong, f"pulled requests {wrong} of {rounds} decoded other tokens"
        m = decode.get_metrics()
        assert m["kv_transfers_done"] == rounds and m["kv_transfers_cuda_ipc"] == rounds
    finally:
        stop()
        prefill.shutdown()
        for engine in (colocated, decode):
            engine.shutdown()
