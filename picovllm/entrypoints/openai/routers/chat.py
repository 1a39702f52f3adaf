"""POST /v1/chat/completions: a conversation through the model's chat template, streamed or not."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from picovllm.entrypoints.openai.protocol import ChatCompletionRequest
from picovllm.entrypoints.openai.serving import (
    APIError,
    EventTemplates,
    ServerState,
    State,
    cancel_on_disconnect,
    chat_logprobs,
    collect,
    new_completions,
    sse,
    usage,
)

router = APIRouter()


def chat_text(tokenizer, messages, add_generation_prompt: bool) -> str:
    """The conversation through the model's chat template (400 when there is none, or the
    template refuses the conversation)."""
    if not tokenizer.chat_template:
        raise APIError(400, "this model has no chat template", param="messages")
    conv = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # the template raises its own errors on malformed conversations
        raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None


@router.post("/chat/completions")
async def chat(req: ChatCompletionRequest, state: State, raw_request: Request):
    state.check_model(req.model)
    state.check_kv_secret(raw_request, req.kv_transfer_params)
    state.need_tokenizer()
    tokenizer = state.tokenizer
    text = chat_text(tokenizer, req.messages, req.add_generation_prompt)
    prompt = {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:  # OpenAI's default: as long as the context allows
        max_tokens = max(1, state.max_model_len - len(prompt["prompt_token_ids"]))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = state.sampling_params(req, max_tokens, logprobs)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await state.start(
        [prompt], params, [rid], req.kv_transfer_params, prompt_param="messages", structured_param=req.structured_field
    )
    created = int(time.time())
    if req.stream:
        return sse(_stream(streams[0], req, params.n, params.logprobs, rid, created, state), streams)
    (out,) = await cancel_on_disconnect(raw_request, collect(streams, state.metrics))
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "logprobs": {"content": chat_logprobs(c, params.logprobs)} if req.logprobs else None,
        }
        for c in out.outputs
    ]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": state.served_model_name,
        "choices": choices,
        "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens),
        **({"kv_transfer_params": out.kv_transfer_params.to_dict()} if out.kv_transfer_params is not None else {}),
    }


async def _stream(
    stream, req: ChatCompletionRequest, n: int, top_logprobs: int | None, rid: str, created: int, state: ServerState
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

    def chunk(index: int, text: str | None, logprobs=None, finish_reason=None) -> dict:
        return {
            **base,
            "choices": [
                {
                    "index": index,
                    "delta": {} if text is None else {"content": text},
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
            if not req.logprobs and c.finish_reason is None:
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
