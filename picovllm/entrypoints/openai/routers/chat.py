"""POST /v1/chat/completions: a conversation through the model's chat template, streamed or not."""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass, field, replace

from fastapi import APIRouter, Request

from picovllm.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice
from picovllm.entrypoints.openai.serving import (
    APIError,
    EventTemplates,
    ServerState,
    State,
    chat_logprobs,
    collect,
    new_completions,
    sse,
    usage,
)
from picovllm.entrypoints.openai.tool_calls import (
    TOOL_PARSERS,
    ToolParser,
    call_id,
    constrained_calls,
    resolve_tool_choice,
    template_messages,
    tool_constraint,
)

router = APIRouter()


def chat_text(tokenizer, messages, add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
    """The conversation (and the tools, if any) through the model's chat template (400 when
    there is none, or the template refuses the conversation)."""
    if not tokenizer.chat_template:
        raise APIError(400, "this model has no chat template", param="messages")
    conv = template_messages([m.for_template() for m in messages])
    try:
        return tokenizer.apply_chat_template(
            conv, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # the template raises its own errors on malformed conversations
        raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None


def _tools(req: ChatCompletionRequest, state: ServerState) -> tuple[list[dict] | None, str | None]:
    """(the request's tools as dicts, its resolved tool choice: tool_calls.resolve_tool_choice)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    try:
        return tools, resolve_tool_choice(tools, choice, state.enable_auto_tool_choice)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None


@router.post("/chat/completions")
async def chat(req: ChatCompletionRequest, state: State, raw_request: Request):
    state.check_model(req.model)
    state.check_kv_secret(raw_request, req.kv_transfer_params)
    state.need_tokenizer()
    tokenizer = state.tokenizer
    tools, choice = _tools(req, state)
    text = chat_text(tokenizer, req.messages, req.add_generation_prompt, tools if choice != "none" else None)
    prompt = {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    prompt_len = len(prompt["prompt_token_ids"])
    if (keep := req.truncate_prompt_tokens) is not None:  # (the engine keeps the prompt's last `keep`)
        prompt_len = min(prompt_len, state.max_model_len if keep == -1 else keep)
    room = max(1, state.max_model_len - prompt_len)  # (OpenAI's default: all the context)
    max_tokens = state.max_tokens(requested, room)
    if requested is None:  # (a server's default beyond what the context allows: what it allows)
        max_tokens = min(max_tokens, room)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = state.sampling_params(req, max_tokens, logprobs)
    structured_param = req.structured_field
    if tools and (constraint := tool_constraint(tools, choice, req.parallel_tool_calls)) is not None:
        if params.structured_outputs is not None:
            raise APIError(
                400, f"tool_choice {choice!r} and {structured_param} both constrain the output", param="tool_choice"
            )
        params, structured_param = replace(params, structured_outputs=constraint), "tools"
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await state.start(
        [prompt], params, [rid], req.kv_transfer_params, prompt_param="messages", structured_param=structured_param
    )
    created = int(time.time())
    calls = _ToolCalls(choice, state.tool_call_parser, tools) if choice not in (None, "none") else None
    if req.stream:
        return sse(_stream(streams[0], req, params.n, params.logprobs, rid, created, state, calls), streams)
    (out,) = await collect(raw_request, streams, state.metrics)
    choices = []
    for c in out.outputs:
        message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
        if calls is not None:
            message, finish_reason = calls.message(c.text, c.finish_reason)
        choices.append(
            {
                "index": c.index,
                "message": message,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
                "logprobs": {"content": chat_logprobs(c, params.logprobs)} if req.logprobs else None,
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": state.served_model_name,
        "choices": choices,
        "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens),
        **({"kv_transfer_params": out.kv_transfer_params.to_dict()} if out.kv_transfer_params is not None else {}),
    }


@dataclass
class _CallStream:
    """One completion's tool calls as they stream."""

    parser: ToolParser | None  # ("auto")
    pieces: list[str] = field(default_factory=list)  # ("required": the answer so far)
    num_calls: int = 0  # calls sent
    call_id: str = field(default_factory=call_id)  # (a named tool's one call)


class _ToolCalls:
    """The tool calls in a request's completions: parsed from the model's markup ("auto") or read
    from the constrained answer ("required", a named tool), whole (message) or as they stream
    (feed)."""

    def __init__(self, choice: str, parser: str, tools: list[dict]):
        names = {t["function"]["name"] for t in tools}
        self.choice, self.parser = choice, functools.partial(TOOL_PARSERS[parser], names)
        self.streams: dict[int, _CallStream] = {}  # by completion index

    def _finish_reason(self, num_calls: int, finish_reason: str | None) -> str | None:
        named = self.choice not in ("auto", "required")
        return "tool_calls" if num_calls and finish_reason == "stop" and not named else finish_reason

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        if self.choice == "auto":
            content, calls = self.parser().parse(text)
        elif (calls := constrained_calls(text, self.choice)) is not None:
            content = ""
        else:  # ("required" cut off inside its array: no call to give)
            content, calls = text, []
        message = {"role": "assistant", "content": (content.strip() or None) if calls else content}
        if calls:
            message["tool_calls"] = [call.to_dict() for call in calls]
        return message, self._finish_reason(len(calls), finish_reason)

    def feed(self, index: int, text: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """A completion's new text as the stream's deltas ({"content"} or {"tool_calls"}), and
        its finish_reason once it has one."""
        s = self.streams.setdefault(index, _CallStream(self.parser() if self.choice == "auto" else None))
        deltas, calls = [], []
        if self.choice == "auto":
            content, calls = s.parser.feed(text)
            if finish_reason is not None:
                rest, more = s.parser.finish()
                content, calls = content + rest, calls + more
            if content:
                deltas.append({"content": content})
        elif self.choice == "required":  # (whole calls once the array is complete)
            s.pieces.append(text)
            if finish_reason is not None:
                answer = "".join(s.pieces)
                calls = constrained_calls(answer, self.choice)
                if calls is None:  # (cut off inside its array: the text, as message gives it)
                    calls = []
                    if answer:
                        deltas.append({"content": answer})
        elif text or not s.num_calls:  # a named tool: its one call's arguments as they come
            head = {"id": s.call_id, "type": "function", "function": {"name": self.choice, "arguments": text}}
            deltas.append(
                {"tool_calls": [{"index": 0, **(head if not s.num_calls else {"function": {"arguments": text}})}]}
            )
            s.num_calls = 1
        for call in calls:
            deltas.append({"tool_calls": [call.to_dict(s.num_calls)]})
            s.num_calls += 1
        return deltas, None if finish_reason is None else self._finish_reason(s.num_calls, finish_reason)


async def _stream(
    stream,
    req: ChatCompletionRequest,
    n: int,
    top_logprobs: int | None,
    rid: str,
    created: int,
    state: ServerState,
    calls: _ToolCalls | None = None,
):
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.served_model_name}
    for i in range(n):
        yield {
            **base,
            "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
        }

    def chunk(index: int, text: str | None, logprobs=None, finish_reason=None, delta: dict | None = None) -> dict:
        return {
            **base,
            "choices": [
                {
                    "index": index,
                    "delta": delta if delta is not None else {} if text is None else {"content": text},
                    "finish_reason": finish_reason,
                    "logprobs": logprobs,
                }
            ],
        }

    templates = EventTemplates(chunk)
    tracker, done = state.metrics.track(), set()
    prompt_tokens = completion_tokens = cached_tokens = 0
    async for out in stream:
        tracker.update(out)
        prompt_tokens, cached_tokens = len(out.prompt_token_ids), out.num_cached_tokens
        for c in new_completions(out, done):
            completion_tokens += len(c.token_ids)
            if calls is not None:
                deltas, finish_reason = calls.feed(c.index, c.text, c.finish_reason)
                # the tokens' logprobs go with the first chunk (one of their own while the text is held)
                logprobs = {"content": chat_logprobs(c, top_logprobs)} if req.logprobs and c.token_ids else None
                for delta in deltas:
                    yield chunk(c.index, None, logprobs, delta=delta)
                    logprobs = None
                if finish_reason is not None or logprobs is not None:
                    yield chunk(c.index, None, logprobs, finish_reason=finish_reason)
            elif not req.logprobs and c.finish_reason is None:
                yield templates.event(c.index, c.text)
            else:
                yield chunk(
                    c.index,
                    c.text if c.text or c.finish_reason is None else None,
                    {"content": chat_logprobs(c, top_logprobs)} if req.logprobs else None,
                    c.finish_reason,
                )
    if include_usage:
        yield {**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
