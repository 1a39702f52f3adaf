"""Tool (function) calling in /v1/chat/completions, as OpenAI's clients call it.

The tools go to the model through its chat template (Qwen2.5's has them). What comes back
depends on tool_choice:

    "none"       text; the tools are not shown to the model
    "auto"       the model's own tool-call markup, parsed (a ToolParser: --tool-call-parser,
                 hermes by default: Qwen2.5's <tool_call>{"name": ..., "arguments": ...}</tool_call>);
                 what is not a call stays text; finish_reason "tool_calls" when there are calls
    "required"   output constrained (structured outputs) to a JSON array of calls, each
                 {"name": one of the tools, "parameters": under its schema}: the arguments
                 always parse; finish_reason "tool_calls" (an array cut off by max_tokens or a
                 stop string: its text as content)
    a named one  output constrained to that tool's parameters: one call of it (cut off: the
                 arguments as far as they came, as they stream)
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from picovllm.sampling_params import StructuredOutputsParams


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=call_id)

    def to_dict(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def resolve_tool_choice(tools: list[dict] | None, tool_choice, auto_enabled: bool) -> str | None:
    """ "none", "auto", "required" or the named tool's name; ValueError naming the field when the
    choice does not fit the tools. None: no tools."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, dict):
        name = tool_choice.get("function", {}).get("name")
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise ValueError(f"tool_choice names {name!r}, which is not one of the tools")
        return name
    if tool_choice != "none" and not tools:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools")
    if tool_choice == "auto" and not auto_enabled:
        raise ValueError('tool_choice "auto" needs the server started with --enable-auto-tool-choice')
    return tool_choice if tools else None


def tool_constraint(tools: list[dict], choice: str, parallel: bool) -> StructuredOutputsParams | None:
    """The structured output that makes the answer a call ("required", a named tool); None for
    "auto" and "none"."""
    if choice in ("auto", "none"):
        return None
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if choice != "required":
        return StructuredOutputsParams(json=params[choice])
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in params.items()
        ]
    }
    return StructuredOutputsParams(
        json={"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    )


def constrained_calls(text: str, choice: str) -> list[ToolCall] | None:
    """The calls of an answer made under tool_constraint: a named tool's one call, its arguments
    the text as it came (cut off too: max_tokens or a stop string may end it early, and its
    arguments stream as they come); "required": the calls of its JSON array, None when the array
    was cut off before it was complete."""
    if choice != "required":
        return [ToolCall(choice, text)]
    try:
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
    except (ValueError, TypeError, KeyError):
        return None


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI's messages for a chat template: an assistant's tool calls with their arguments as
    objects (templates write them with tojson), as vLLM passes them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_call_for_template(c) for c in calls]}
        out.append(m)
    return out


def _call_for_template(call: dict) -> dict:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass
    return {**call, "function": fn}


class ToolParser:
    """Finds tool calls in a model's text as it streams: feed() each piece of text, then
    finish(); each returns (text that is not a call, the calls completed). tool_names: the
    request's tools."""

    def __init__(self, tool_names: set[str]):
        self.tool_names = tool_names

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole answer at once."""
        content, calls = self.feed(text)
        rest, more = self.finish()
        return content + rest, calls + more


class HermesToolParser(ToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes; Qwen2.5's template asks
    for it), and an answer that is nothing but such objects, untagged or in a ```json fence
    (small Qwen2.5 models often leave the tags out), when each names one of the tools. Text that only might be the start
    of a call is held until it is known; a block that does not parse as a call, or is cut off,
    stays text."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: set[str]):
        super().__init__(tool_names)
        self.buffer = ""  # text not yet given back: a possible opening tag, or a call in progress
        self.in_call = False
        self.bare: bool | None = None  # whether the answer opens with "{" or a fence (None: not known yet)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        head = self.buffer.lstrip()
        if self.bare is None and (head.startswith("{") or len(head) >= 3):
            self.bare = head.startswith(("{", "```"))
        if self.bare is not False:  # (held whole until finish)
            return "", []
        content, calls = [], []
        while True:
            if self.in_call:
                end = self.buffer.find(self.CLOSE)
                if end < 0:
                    break
                block, self.buffer = self.buffer[:end], self.buffer[end + len(self.CLOSE) :]
                self.in_call = False
                call = _hermes_call(block)
                if call is None:
                    content.append(self.OPEN + block + self.CLOSE)
                else:
                    calls.append(call)
                continue
            start = self.buffer.find(self.OPEN)
            if start >= 0:
                content.append(self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start + len(self.OPEN) :], True
                continue
            keep = _partial_tag(self.buffer, self.OPEN)
            content.append(self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep :]
            break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest = (self.OPEN if self.in_call else "") + self.buffer
        self.buffer, self.in_call = "", False
        calls = _bare_calls(rest, self.tool_names) if self.bare else None
        return ("", calls) if calls else (rest, [])


def _hermes_call(block: str) -> ToolCall | None:
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    return ToolCall(call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _bare_calls(text: str, tool_names: set[str]) -> list[ToolCall] | None:
    """The calls of an answer that is nothing but call objects one after another (untagged, or
    in a code fence), each naming one of the tools; None if it is anything else."""
    text, calls, decoder = _unfenced(text), [], json.JSONDecoder()
    while text:
        try:
            obj, end = decoder.raw_decode(text)
        except ValueError:
            return None
        call = _hermes_call(json.dumps(obj))
        if call is None or call.name not in tool_names:
            return None
        calls.append(call)
        text = text[end:].lstrip()
    return calls


def _unfenced(text: str) -> str:
    """text without a Markdown code fence around it (```json ... ```)."""
    text = text.strip()
    if text.startswith("```") and text.endswith("```"):
        return text[3:-3].removeprefix("json").strip()
    return text


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at text's end begin tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


TOOL_PARSERS = {"hermes": HermesToolParser}  # --tool-call-parser: a name, and its parser
