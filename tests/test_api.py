"""The vLLM-style API: prompt forms, output order, n > 1, stop handling, chat, logprobs, abort,
and clear errors on bad input while the engine keeps serving."""

import dataclasses
import os
import subprocess
import sys

import pytest
from conftest import FP32_ONLY, TEST_DTYPE, engine_args, make_llm
from hf_reference import hf_greedy

from picovllm import LLMEngine, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    return make_llm(tiny_qwen[0])


def test_prompt_forms_and_order(llm, tiny_qwen):
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "Hello world", "def add(a, b):"]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    by_text = llm.generate(texts, greedy, use_tqdm=False)
    by_ids = llm.generate([{"prompt_token_ids": tok.encode(t)} for t in texts], greedy, use_tqdm=False)
    single = llm.generate(texts[1], greedy, use_tqdm=False)
    assert [o.prompt for o in by_text] == texts
    assert [o.outputs[0].token_ids for o in by_text] == [o.outputs[0].token_ids for o in by_ids]
    assert single[0].outputs[0].token_ids == by_text[1].outputs[0].token_ids
    for text, out in zip(texts, by_text):
        ids = tok.encode(text)
        assert out.prompt_token_ids == ids
        if TEST_DTYPE == "float32":  # (transformers' reference is fp32)
            assert out.outputs[0].token_ids == hf_greedy(tiny_qwen[1], ids, 6)[0]
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
        assert out.outputs[0].finish_reason == "length" and out.finished


def test_per_prompt_sampling_params(llm):
    outs = llm.generate(
        ["Hello", "Hello"],
        [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="2 sampling_params given for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams()] * 2)


def test_n_gives_distinct_samples(llm):
    out = llm.generate(
        "Hello", SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=1, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    again = llm.generate(
        "Hello", SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=1, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_seeded_generators_live_as_long_as_their_requests(llm):
    """The model runner keeps a seeded request's generator by its id while it runs, and forgets it
    when it finishes: the same id, seeded again, samples the same tokens."""
    engine = llm.llm_engine
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=5, ignore_eos=True)
    engine.add_request("s", "Hello", params)
    engine.add_request("plain", "Hello", SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True))
    engine.step()
    assert sorted(engine.executor.driver.model_runner.generators) == ["s-0", "s-1"]
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.executor.driver.model_runner.generators == {} and engine.scheduler.finished_ids == []
    engine.add_request("s", "Hello", params)
    while engine.has_unfinished_requests():
        again = [o for o in engine.step() if o.finished] or None
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in outs["s"].outputs]


def test_stop_strings_are_trimmed(llm):
    tok = llm.get_tokenizer()
    free = llm.generate("The capital", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    text = free.text
    stop = text[5:8]
    assert stop and stop not in text[:5]
    out = llm.generate(
        "The capital", SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 20
    kept = llm.generate(
        "The capital",
        SamplingParams(temperature=0, max_tokens=20, stop=stop, ignore_eos=True, include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    assert tok.decode(out.token_ids).startswith(out.text)


def test_stop_token_ids_and_eos(llm):
    free = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    target = free.token_ids[3]
    first = free.token_ids.index(target)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[target]), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    delayed = llm.generate(
        "Hello",
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[target], min_tokens=first + 1),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(delayed.token_ids) > first + 1


def test_logprobs(llm):
    out = llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the most likely
        assert len(entry) == 3
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


@FP32_ONLY
def test_prompt_logprobs_equal_transformers_on_every_path(tiny_qwen):
    """prompt_logprobs=k: each prompt token's log-probability given the ones before it (None for the
    first), its rank, and the top k, equal to transformers' (fp32), for a prompt computed in
    8-token chunks beside decodes (async steps), one whose prefix is in the cache (computed again:
    a hit would skip its logits), and n=2 (once, for the request); a DELTA stream has them in
    one output."""
    import torch

    path, hf = tiny_qwen
    llm = make_llm(path, max_num_batched_tokens=8, max_num_seqs=4)
    prompts = [list(range(3, 23)), list(range(40, 45)), list(range(3, 23)) + [7, 8, 9]]
    with torch.no_grad():
        expect = [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1) for p in prompts]
    llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=1), use_tqdm=False)  # (cached)
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, n=n) for n in (1, 1, 2)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out, lp in zip(prompts, outs, expect):
        got = out.prompt_logprobs
        assert len(got) == len(p) and got[0] is None
        for i in range(1, len(p)):
            token, entry = p[i], got[i]
            assert entry[token].logprob == pytest.approx(lp[i - 1, token].item(), abs=1e-4)
            assert entry[token].rank == int((lp[i - 1] > lp[i - 1, token]).sum()) + 1
            top = lp[i - 1].topk(2)
            for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
                assert entry[t].logprob == pytest.approx(v, abs=1e-4) and (t == token or entry[t].rank == rank)
            assert len(entry) in (2, 3)
    assert outs[0].num_cached_tokens == 0  # (its prefix was cached: not used)
    engine = llm.llm_engine
    engine.add_request(
        "s", {"prompt_token_ids": prompts[0]}, dataclasses.replace(params[0], output_kind=RequestOutputKind.DELTA)
    )
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in engine.step() if o.request_id == "s"]
    assert [x is not None for x in seen] == [True] + [False] * (len(seen) - 1)
    assert [e and e[prompts[0][i]].logprob for i, e in enumerate(seen[0])] == pytest.approx(
        [e and e[prompts[0][i]].logprob for i, e in enumerate(outs[0].prompt_logprobs)], abs=1e-5
    )


def test_chat_applies_template(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "Hello"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    expected = tok.encode("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert out.prompt_token_ids == expected
    two = llm.chat(
        [conv, conv + [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Bye"}]],
        SamplingParams(max_tokens=2),
        use_tqdm=False,
    )
    assert len(two) == 2 and two[0].prompt_token_ids == expected
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}])


def test_the_models_generation_config_gives_the_default_sampling_params(
    llm, tiny_qwen, tiny_qwen_generation_config, tmp_path
):
    from picovllm.model_source import sampling_defaults

    gen = make_llm(tiny_qwen_generation_config)
    defaults = gen.get_default_sampling_params()
    expected = SamplingParams(temperature=0.0, top_p=0.8, top_k=20, repetition_penalty=1.05, max_tokens=5)
    assert defaults == expected
    prompts = ["The capital of France is", "Hello world"]
    outputs = gen.generate(prompts, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [
        o.outputs[0].token_ids for o in llm.generate(prompts, expected, use_tqdm=False)
    ]
    assert all(len(o.outputs[0].token_ids) <= 5 for o in outputs)
    # the model without one, "vllm" (none), a directory's, a value SamplingParams refuses
    assert llm.get_default_sampling_params() == SamplingParams()
    assert sampling_defaults("vllm", tiny_qwen_generation_config) == {}
    assert sampling_defaults(tiny_qwen_generation_config, tiny_qwen[0])["top_k"] == 20
    (tmp_path / "generation_config.json").write_text('{"top_p": 1.5, "top_k": null}')
    with pytest.raises(ValueError, match="generation_config.json: top_p .*--generation-config vllm"):
        sampling_defaults(str(tmp_path), None)
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a directory"):
        make_llm(tiny_qwen[0], generation_config=str(tmp_path / "nowhere"))


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm):
    ids = [11, 12, 13, 14, 15, 16, 17]
    params = SamplingParams(temperature=0, max_tokens=3, truncate_prompt_tokens=4)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-4:]
    alone = llm.generate({"prompt_token_ids": ids[-4:]}, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert out.outputs[0].token_ids == alone[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate("Hello", SamplingParams(truncate_prompt_tokens=10**6), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_logit_bias_steers_every_token(llm):
    out = llm.generate(
        "Hello", SamplingParams(temperature=0.8, seed=1, max_tokens=6, logit_bias={42: 100}), use_tqdm=False
    )
    assert out[0].outputs[0].token_ids == [42] * 6
    with pytest.raises(ValueError, match="logit_bias must map token ids"):
        SamplingParams(logit_bias={"42": 1.0})
    with pytest.raises(ValueError, match="logit_bias must map token ids"):
        SamplingParams(logit_bias={42: float("nan")})
    out = llm.generate("Hello", SamplingParams(max_tokens=8, allowed_token_ids=[7, 9]), use_tqdm=False)
    assert set(out[0].outputs[0].token_ids) <= {7, 9}
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
        SamplingParams(allowed_token_ids=[])


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("", None, "empty"),
        ({"prompt_token_ids": []}, None, "empty"),
        ({"prompt_token_ids": [1, 2, 99999]}, None, "out of range"),
        ({"prompt_token_ids": [1, -3]}, None, "out of range"),
        ({"prompt_token_ids": [1, "a"]}, None, "out of range"),
        ({"prompt_tokens": [1]}, None, "prompt_token_ids"),
        (12, None, "must be a string"),
        ("Hello " * 600, None, "max_model_len"),
        ("Hello", SamplingParams(max_tokens=2000), "max_model_len"),
        ("Hello", SamplingParams(min_tokens=1, stop_token_ids=[5, 99999]), "stop_token_ids.*99999.*out of range"),
        ("Hello", SamplingParams(logit_bias={5: 1.0, 99999: 2.0}), "logit_bias.*99999.*out of range"),
        ("Hello", SamplingParams(allowed_token_ids=[5, 99999]), "allowed_token_ids.*99999.*out of range"),
    ],
)
def test_bad_input_rejected_and_engine_keeps_serving(llm, prompt, params, match):
    ok = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match=match):
        llm.generate(["Hello", prompt], [ok, params or SamplingParams()], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing half-queued
    assert len(llm.generate("Hello", ok, use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_engine_level_errors_leave_others_running(tiny_qwen):
    engine = LLMEngine.from_engine_args(
        model=tiny_qwen[0], dtype="float32", device="cpu", kv_cache_memory=16 << 20, max_model_len=128
    )
    engine.add_request("good", "Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", "Hello")
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", {"prompt_token_ids": [5] * 200})
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request("bad", "Hello", {"temperature": 0})
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "good" and len(outs[-1].outputs[0].token_ids) == 8
    bm = engine.block_manager
    assert bm.num_free_blocks + engine.get_metrics()["kv_blocks_cached"] == bm.num_total_blocks
    assert engine.reset_prefix_cache() and bm.num_free_blocks == bm.num_total_blocks


def test_a_request_whose_output_cannot_be_read_fails_alone_offline(tiny_qwen, unreadable_seed):
    """LLMEngine.step reads its own outputs: one that raises there (conftest's unreadable_seed) fails
    its request (take_failed, its blocks freed); the request beside it runs to its end."""
    engine = LLMEngine.from_engine_args(model=tiny_qwen[0], dtype="float32", device="cpu", kv_cache_memory=16 << 20)
    engine.add_request("good", "Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.add_request("bad", "Hello", SamplingParams(seed=unreadable_seed, max_tokens=8, ignore_eos=True))
    outs, failed = [], []
    while engine.has_unfinished_requests():
        outs += engine.step()
        failed += engine.take_failed()
    assert [rid for rid, _ in failed] == ["bad"] and "could not be read: UnicodeDecodeError" in failed[0][1]
    assert {o.request_id for o in outs} == {"good"} and len(outs[-1].outputs[0].token_ids) == 8
    assert not engine.output_processor.groups and engine.reset_prefix_cache()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_abort_frees_blocks_and_stops_output(tiny_qwen):
    engine = LLMEngine.from_engine_args(model=tiny_qwen[0], dtype="float32", device="cpu", kv_cache_memory=16 << 20)
    for i in range(3):
        engine.add_request(f"r{i}", "Hello world", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step(), engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort_request("r1")
    engine.abort_request("never-existed")
    seen = set()
    while engine.has_unfinished_requests():
        seen |= {o.request_id for o in engine.step()}
        engine.check_invariants()
    assert seen == {"r0", "r2"}
    bm = engine.block_manager
    assert bm.num_free_blocks + engine.get_metrics()["kv_blocks_cached"] == bm.num_total_blocks
    assert engine.reset_prefix_cache() and bm.num_free_blocks == bm.num_total_blocks


def test_streaming_steps_are_incremental(tiny_qwen):
    engine = LLMEngine.from_engine_args(model=tiny_qwen[0], dtype="float32", device="cpu", kv_cache_memory=16 << 20)
    engine.add_request("s", "Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    lengths = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            lengths.append(len(out.outputs[0].token_ids))
    assert lengths == [1, 2, 3, 4, 5]


def test_final_only_outputs_come_once(tiny_qwen):
    """RequestOutputKind.FINAL_ONLY (what LLM.generate uses): nothing until the whole group (n=2
    here) has finished, then one output with everything; CUMULATIVE requests in the same steps
    still report every step."""
    engine = LLMEngine.from_engine_args(model=tiny_qwen[0], dtype="float32", device="cpu", kv_cache_memory=16 << 20)
    engine.add_request(
        "final",
        "Hello",
        SamplingParams(n=2, max_tokens=4, ignore_eos=True, seed=1, output_kind=RequestOutputKind.FINAL_ONLY),
    )
    engine.add_request("stream", "Hi", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        seen.append([(o.request_id, o.finished, [len(c.token_ids) for c in o.outputs]) for o in engine.step()])
    assert seen == [
        [("stream", False, [1])],
        [("stream", False, [2])],
        [("stream", True, [3])],
        [("final", True, [4, 4])],
    ]
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final")


def test_final_only_text_is_decoded_at_the_end_as_streaming_shows_it(tiny_qwen):
    """A FINAL_ONLY request without stop strings is not detokenized while it runs (no DecodeStream:
    host time per token saved); its final text is what the same request streamed shows, whether it
    ends at max_tokens, at a stop token or with n = 2. With a stop string it is detokenized as it runs."""
    engine = LLMEngine.from_engine_args(model=tiny_qwen[0], dtype="float32", device="cpu", kv_cache_memory=16 << 20)
    requests = {
        "length": ("Zürich, Köln", SamplingParams(max_tokens=24, ignore_eos=True, seed=3)),
        "stopped": ("Hello", SamplingParams(n=2, max_tokens=60, seed=4, stop_token_ids=list(range(100, 130)))),
        "stop": ("café", SamplingParams(max_tokens=30, ignore_eos=True, seed=5, stop=["zz"])),
    }
    texts = {}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, dataclasses.replace(params, output_kind=kind))
        streams = {
            rid: [c.decode_stream is not None for c in g.children] for rid, g in engine.output_processor.groups.items()
        }
        final = {}
        while engine.has_unfinished_requests():
            final.update({o.request_id: [(c.text, c.finish_reason) for c in o.outputs] for o in engine.step()})
        texts[kind] = final
        final_only = kind is RequestOutputKind.FINAL_ONLY
        assert streams == {"length": [not final_only], "stopped": [not final_only] * 2, "stop": [True]}
    assert texts[RequestOutputKind.FINAL_ONLY] == texts[RequestOutputKind.CUMULATIVE]
    ends = [end for outs in texts[RequestOutputKind.FINAL_ONLY].values() for end in outs]
    assert {r for _, r in ends} == {"stop", "length"} and all(text for text, r in ends if r == "length")


def test_delta_outputs_add_up_to_the_cumulative_ones_and_never_take_text_back(tiny_qwen):
    """RequestOutputKind.DELTA (what the server's engine process asks for): each output carries
    what its step added; joined, they equal the cumulative outputs (tokens, text, logprobs, n=2),
    and text once sent is final: with a stop string that matches mid-text, the text that could
    still be the start of a match stays back until the request finishes."""
    engine = LLMEngine.from_engine_args(model=tiny_qwen[0], dtype="float32", device="cpu", kv_cache_memory=16 << 20)

    def run(kind, stop=()):
        params = SamplingParams(
            n=2, max_tokens=24, ignore_eos=True, seed=3, temperature=0.8, logprobs=2, stop=list(stop), output_kind=kind
        )
        engine.add_request("r", "Hello there", params)
        engine.add_request(
            "g",
            "Hi",
            SamplingParams(
                temperature=0, max_tokens=12, ignore_eos=True, stop=list(stop), logprobs=0, output_kind=kind
            ),
        )
        steps = []
        while engine.has_unfinished_requests():
            steps.extend(engine.step())
        return steps

    def final(steps):
        return {
            o.request_id: [(c.token_ids, c.text, c.logprobs, c.finish_reason) for c in o.outputs]
            for o in steps
            if o.finished
        }

    text = final(run(RequestOutputKind.CUMULATIVE))["g"][0][1]
    assert len(text) > 6
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    for stops in ((), (stop, "zzzzzz")):
        want, deltas = final(run(RequestOutputKind.CUMULATIVE, stops)), run(RequestOutputKind.DELTA, stops)
        joined = {}
        for o in deltas:
            parts = joined.setdefault(o.request_id, [[[], "", []] for _ in o.outputs])
            for c, part in zip(o.outputs, parts):
                part[0] += c.token_ids
                part[1] += c.text
                part[2] += c.logprobs
                # what was sent is a prefix of the final text: nothing is taken back
                assert want[o.request_id][c.index][1].startswith(part[1])
            if o.finished:
                assert [(t, x, lp, c.finish_reason) for (t, x, lp), c in zip(parts, o.outputs)] == want[o.request_id]
        assert set(joined) == {"r", "g"}
    # (the last run's stop string cut the greedy request's text where it first matched)
    assert want["g"][0][3] == "stop" and text.startswith(want["g"][0][1]) and len(want["g"][0][1]) <= len(text) // 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(model="/no/such/dir"), "not found"),
        (dict(model="no-such-builtin-model"), "not found"),
        (dict(model="dummy:no-such-shape"), "unknown dummy"),
        (dict(block_size=0), "block_size"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(dtype="int8"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(max_model_len=10**9), "max_model_len"),
        (dict(not_an_option=1), "unknown engine option"),
    ],
)
def test_bad_engine_options(tiny_qwen, kwargs, match):
    from picovllm import LLM

    args = {"model": tiny_qwen[0], "device": "cpu", "kv_cache_memory": 16 << 20, **kwargs}
    with pytest.raises(ValueError, match=match):
        LLM(**args)


def test_max_tokens_none_runs_to_max_model_len(tiny_qwen):
    llm = make_llm(tiny_qwen[0], max_model_len=40)
    out = llm.generate(
        {"prompt_token_ids": [5] * 30}, SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    assert llm.generate([], use_tqdm=False) == []


def test_kv_cache_memory_sizes_the_pool_on_any_device(tiny_qwen):
    """kv_cache_memory, when given, sets the pool on any device (vLLM's kv_cache_memory_bytes;
    on CUDA it overrides gpu_memory_utilization); num_gpu_blocks_override overrides both."""
    engine = LLMEngine.from_engine_args(**engine_args(tiny_qwen[0], kv_cache_memory=3 << 20))
    cfg = engine.model_config
    import torch

    itemsize = getattr(torch, TEST_DTYPE).itemsize
    per_block = 2 * 16 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize  # K and V
    assert engine.block_manager.num_total_blocks == (3 << 20) // per_block
    engine = LLMEngine.from_engine_args(**engine_args(tiny_qwen[0], num_gpu_blocks_override=7))
    assert engine.block_manager.num_total_blocks == 7


def test_an_engine_is_freed_as_soon_as_its_last_reference_goes(tiny_qwen):
    """No reference cycle holds an engine (its parts call back into none of it): dropping it frees
    its pools and a prefill or decode instance's NIXL agent at once, not at a later collection."""
    import gc
    import weakref

    engine = LLMEngine.from_engine_args(**engine_args(tiny_qwen[0], skip_tokenizer_init=True))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    gone = weakref.ref(engine)
    gc.disable()
    try:
        del engine
        assert gone() is None
    finally:
        gc.enable()


def test_llm_logs_its_start_up_as_vllm_does(tiny_qwen):
    """LLM() says on stderr what it is doing as it starts (the picovllm logger at info, vLLM's
    default), not when the program has set up logging itself (the lines go to its handlers, once
    each) nor with PICOVLLM_CONFIGURE_LOGGING=0."""
    build = f"from picovllm import LLM; LLM({tiny_qwen[0]!r}, device='cpu', dtype='float32', kv_cache_memory=1 << 20)"
    stages = ["loading Qwen2ForCausalLM", "weights loaded in", "KV cache: ", "engine ready in"]

    def start(script: str, **env) -> list[str]:
        run = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
        )
        assert run.returncode == 0, run.stderr[-2000:]
        return [line for line in run.stderr.splitlines() if "picovllm" in line or line.startswith("INFO ")]

    lines = start(build, PICOVLLM_LOGGING_LEVEL="")
    assert [stage for line in lines for stage in stages if stage in line] == stages, lines
    assert all(line.startswith("INFO ") for line in lines), lines
    assert start(build, PICOVLLM_CONFIGURE_LOGGING="0", PICOVLLM_LOGGING_LEVEL="") == []
    own = start(
        "import logging; logging.basicConfig(level=logging.INFO, format='%(name)s| %(message)s'); " + build,
        PICOVLLM_LOGGING_LEVEL="",
    )
    assert [stage for line in own for stage in stages if stage in line] == stages, own
    assert all(line.startswith("picovllm| ") for line in own), own
