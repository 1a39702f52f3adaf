"""Structured outputs (engine/structured_output.py) on a tiny random model: whatever the model
would say, the output is what the schema, regex, choice or grammar allows, and requests without
one are not changed by those with one."""

import dataclasses
import json
import re
import threading
from types import SimpleNamespace

import jsonschema
import pytest
import xgrammar
from conftest import make_llm

from picovllm import SamplingParams, StructuredOutputsParams
from picovllm.engine.structured_output import BitmaskFiller, accept_tokens

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z0-9]{0,3}$"}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Rome"]}, "zip": {"type": "integer", "maximum": 99}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "home"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-[0-9]{2}"
CHOICES = ["yes", "no", 'maybe "so"', "ünïcode", "a\\b\nc\x01d"]
GRAMMAR = 'root ::= "(" num (" + " num)? ")"\nnum ::= [1-9] [0-9]?'
PROMPTS = ["Hello", "Give me JSON", "a b c", "1 2 3 4"]


def _so(**kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=5, max_tokens=200, structured_outputs=StructuredOutputsParams(**kw))


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    return make_llm(tiny_qwen[0], block_size=4, max_num_seqs=8)


def _outputs(llm, prompts, params) -> list:
    """Each prompt's RequestOutput; the constrained ones must have ended with their grammar."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o, p in zip(outs, params if isinstance(params, list) else [params] * len(outs)):
        assert p.structured_outputs is None or all(c.finish_reason == "stop" for c in o.outputs), o.outputs
    return outs


def _texts(llm, prompts, params) -> list[list[str]]:
    """Each prompt's completions' texts (_outputs)."""
    return _texts_of(_outputs(llm, prompts, params))


def _texts_of(outs) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in outs]


def test_every_output_follows_its_schema_regex_choice_or_grammar(llm):
    params = [
        SamplingParams(
            n=2, temperature=1.0, seed=1, max_tokens=160, structured_outputs=StructuredOutputsParams(json=SCHEMA)
        ),
        _so(regex=REGEX),
        _so(choice=CHOICES),
        _so(grammar=GRAMMAR),
    ]
    schema, regex, choice, grammar = _texts(llm, PROMPTS, params)
    for text in schema:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch(REGEX, regex[0]), regex
    assert choice[0] in CHOICES, choice
    assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)?\)", grammar[0]), grammar
    json_text = _texts(llm, PROMPTS[:1], _so(json=json.dumps(SCHEMA)))[0][0]  # (the schema as text)
    jsonschema.validate(json.loads(json_text), SCHEMA)


def test_the_same_with_and_without_async_scheduling_and_under_preemption(tiny_qwen, llm):
    """Seeded, mixed with unconstrained requests, some with penalties (the model runner appends the
    tokens in flight, here to a deferred sampling's rows): the engine that launches steps ahead
    (their sampling deferred until the grammars have the tokens in flight), the synchronous engine
    and one whose pool is too small for the batch (requests preempted and recomputed) give the very
    same outputs."""
    penalised = dataclasses.replace(_so(json=SCHEMA), temperature=0, repetition_penalty=3.0, frequency_penalty=1.0)
    free = SamplingParams(temperature=0, max_tokens=40, repetition_penalty=2.0, frequency_penalty=1.0)
    params = [penalised, free, _so(regex=REGEX)] * 3
    prompts = PROMPTS * 2 + PROMPTS[:1]
    before = llm.llm_engine.launcher.num_launched_ahead
    outs = _outputs(llm, prompts, params)
    want = _texts_of(outs)
    # (steps were launched ahead of constrained requests' tokens, their sampling waiting for them:
    # all but the first steps of the longest completion, a constrained one)
    longest = max(outs, key=lambda o: len(o.outputs[0].token_ids))
    assert longest.outputs[0].token_ids and params[outs.index(longest)].structured_outputs is not None
    assert llm.llm_engine.launcher.num_launched_ahead - before >= len(longest.outputs[0].token_ids) - 2
    sync = make_llm(tiny_qwen[0], block_size=4, max_num_seqs=8, async_scheduling=False)
    assert _texts(sync, prompts, params) == want
    small = make_llm(tiny_qwen[0], block_size=4, max_num_seqs=8, num_gpu_blocks_override=56)
    assert _texts(small, prompts, params) == want
    assert small.llm_engine.scheduler.num_preemptions > 0


def test_a_request_without_constraints_is_unchanged_by_one_with(llm):
    free = SamplingParams(temperature=0.9, seed=4, max_tokens=30, ignore_eos=True)
    alone = llm.generate(["The quick brown fox"], free, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(["The quick brown fox", "Hello"], [free, _so(json=SCHEMA)], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    launched = llm.llm_engine.launcher.num_launched_ahead
    llm.generate(["The quick brown fox"], free, use_tqdm=False)
    assert llm.llm_engine.launcher.num_launched_ahead > launched  # (no grammar: the overlap stays)


def test_a_deferred_step_samples_once_the_next_steps_inputs_are_built(llm, monkeypatch):
    """A step launched ahead of its grammars' tokens samples as the next step launches, after that
    step's inputs are built and uploaded (so that the wait for the bitmask overlaps that work):
    when it samples, one more step's inputs have been built than when it ran; only a last one
    that no step follows samples without."""
    runner = llm.llm_engine.executor.driver.model_runner
    built, deferred, at_sampling = [0], [], []
    build, run, sample = runner._build, runner.run, runner.sample_deferred

    def counted_build(step):
        built[0] += 1
        return build(step)

    def recorded_run(step, sampling, pending=None, num_pending=0, defer=False):
        out = run(step, sampling, pending, num_pending, defer)
        if defer:
            deferred.append(built[0])
        return out

    def recorded_sample(bitmask):
        at_sampling.append(built[0] - deferred[len(at_sampling)])
        return sample(bitmask)

    monkeypatch.setattr(runner, "_build", counted_build)
    monkeypatch.setattr(runner, "run", recorded_run)
    monkeypatch.setattr(runner, "sample_deferred", recorded_sample)
    out = llm.generate(["Hello"], _so(json=SCHEMA), use_tqdm=False)[0].outputs[0]
    # (the step launched ahead when the grammar ends is dropped unsampled)
    assert len(out.token_ids) > 3 and len(deferred) - 1 <= len(at_sampling) <= len(deferred) and len(at_sampling) > 2
    assert at_sampling[:-1] == [1] * (len(at_sampling) - 1) and at_sampling[-1] in (0, 1)


def test_max_tokens_inside_the_grammar_ends_with_length(llm):
    params = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    out = llm.generate(["Hi"], params, use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_complete_grammar_ends_its_request_before_min_tokens(tiny_qwen, llm, async_scheduling):
    """min_tokens bans the stop tokens, but a grammar that allows nothing else has the last word
    (vLLM's): the request ends "stop" there, its output what the grammar allows, rather than
    sampling a token the grammar refuses. Rows whose grammar still allows other tokens, and rows
    without one, keep the ban."""
    engine = llm if async_scheduling else make_llm(tiny_qwen[0], block_size=4, max_num_seqs=8, async_scheduling=False)
    choice = SamplingParams(
        temperature=0, max_tokens=40, min_tokens=30, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    regex = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=40,
        min_tokens=4,
        structured_outputs=StructuredOutputsParams(regex="[a-z]{8,12}"),
    )
    first = engine.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    stop = first[0].outputs[0].token_ids[0]  # (what the free row would take first: banned)
    free = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_token_ids=[stop])
    outs = _outputs(engine, PROMPTS[:3], [choice, regex, free])
    assert outs[0].outputs[0].text in ("yes", "no") and outs[0].outputs[0].finish_reason == "stop"
    assert re.fullmatch("[a-z]{8,12}", outs[1].outputs[0].text), outs[1].outputs[0].text
    assert len(outs[1].outputs[0].token_ids) >= 4
    assert outs[2].outputs[0].token_ids[0] != stop and len(outs[2].outputs[0].token_ids) >= 2


def test_allowed_token_ids_that_leave_the_grammar_nothing_end_the_request_alone(llm, caplog):
    """allowed_token_ids disjoint from what the grammar allows: every logit of the row is -inf;
    the request ends "abort" at its first token (logged), the other requests of the batch are
    served as alone."""
    tok = llm.get_tokenizer()
    digits = sorted({t for d in "0123456789" for t in tok.encode(d, add_special_tokens=False)})
    stuck = SamplingParams(
        temperature=0,
        max_tokens=8,
        allowed_token_ids=digits,
        structured_outputs=StructuredOutputsParams(regex="[a-z]+"),
    )
    other = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], other, use_tqdm=False)[0].outputs[0]
    with caplog.at_level("ERROR", logger="picovllm"):
        outs = llm.generate(PROMPTS[:2], [stuck, other], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "abort" and len(outs[0].outputs[0].token_ids) <= 1
    assert "its grammar refuses token" in caplog.text
    assert outs[1].outputs[0].token_ids == alone.token_ids and outs[1].outputs[0].finish_reason == "length"


def test_a_request_waits_for_its_grammar_without_holding_the_others(llm, monkeypatch):
    engine = llm.llm_engine
    release, compile_ = threading.Event(), engine.structured.compile
    monkeypatch.setattr(engine.structured, "compile", lambda so: release.wait(30) and compile_(so))
    engine.add_request("slow", "Hello", _so(regex=REGEX))
    engine.add_request("free", "Hello", SamplingParams(temperature=0, max_tokens=5))
    finished = set()
    for _ in range(50):
        finished |= {o.request_id for o in engine.step() if o.finished}
        if "free" in finished:
            break
    assert finished == {"free"} and engine.has_unfinished_requests()
    engine.add_request("gone", "Hello", _so(regex=REGEX))  # (aborted while it compiles)
    engine.abort_request("gone")
    release.set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"free", "slow"} and not engine.structured.compiling
    engine.check_invariants()
    assert engine.reset_prefix_cache() and engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def _row(grammar, finished=False, text=""):
    """A sampling row as the bitmask and accept_tokens see it, its matcher past `text`."""
    assert grammar is None or grammar.accept_string(text)
    return SimpleNamespace(request_id="r", grammar=grammar, is_finished=finished)


def test_the_bitmask_is_each_rows_grammar_and_the_matchers_take_the_tokens(llm):
    engine = llm.llm_engine
    compiled = engine.structured.compile(StructuredOutputsParams(regex=REGEX))
    (eos,) = engine.eos_token_ids
    matcher = xgrammar.GrammarMatcher
    done = _row(matcher(compiled), text="ab-12")
    assert accept_tokens([done], [eos]) == ["stop"] and done.grammar.is_terminated()
    rows = [_row(matcher(compiled)), _row(None), _row(matcher(compiled), text="abc-1")]
    rows += [_row(matcher(compiled), finished=True), done]
    filler = BitmaskFiller(engine.model_config.vocab_size, pin_memory=False)
    mask = filler.fill(rows).clone()  # (the filler's buffer serves every fill)
    own = xgrammar.allocate_token_bitmask(2, engine.model_config.vocab_size)
    rows[0].grammar.fill_next_token_bitmask(own, 0)
    rows[2].grammar.fill_next_token_bitmask(own, 1)
    assert mask[0].tolist() == own[0].tolist() and mask[2].tolist() == own[1].tolist()
    assert (mask[[1, 3, 4]] == -1).all() and (mask[[0, 2]] != -1).any()  # (all allowed: no grammar to follow)
    assert filler.start(rows).result().equal(mask) and filler.fill(rows[1:2]) is None
    # a row that held a grammar's bits in the last fill allows every token once it has none
    again = filler.fill([rows[1], rows[2]])
    assert (again[0] == -1).all() and again[1].tolist() == own[1].tolist()
    filler.shutdown()
    # a token the grammar refuses ends its row; a row without a grammar, or finished, takes nothing
    digit = engine.tokenizer.convert_tokens_to_ids("5")
    assert accept_tokens(rows[:4], [digit] * 4) == ["abort", None, None, None]
    assert rows[2].grammar.accept_token(eos) and rows[3].grammar.accept_string("ab")  # ("abc-15"; none)


@pytest.mark.parametrize(
    "so, said",
    [
        (dict(json={"type": "objectx"}), "structured_outputs has an invalid JSON schema"),
        (dict(regex="a("), "structured_outputs has an invalid regex"),
        (dict(grammar="root ::= "), "structured_outputs has an invalid grammar"),
    ],
)
def test_bad_structured_outputs_are_refused_before_anything_runs(llm, so, said):
    with pytest.raises(ValueError, match=said):
        llm.generate(["Hello", "Hi"], [SamplingParams(), _so(**so)], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_structured_outputs_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of .* got json, regex"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="choice must be non-empty strings"):
        StructuredOutputsParams(choice=["a", ""])
    params = SamplingParams.from_dict({"structured_outputs": {"regex": "a+"}})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")
