"""POST /v1/completions: a prompt (a string, strings, token ids or lists of them), streamed or not."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

from fastapi import APIRouter, Request

from picovllm.entrypoints.openai.protocol import CompletionRequest
from picovllm.entrypoints.openai.serving import (
    APIError,
    EventTemplates,
    ServerState,
    State,
    collect,
    completion_logprobs,
    new_completions,
    sse,
    usage,
)

router = APIRouter()


def _prompt_list(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


def _echoed(out, state: ServerState) -> str:
    """The prompt as echo returns it: its text, or a token-id prompt's tokens decoded."""
    return out.prompt or state.tokenizer.decode(out.prompt_token_ids)


def _logprobs(c, out, state: ServerState, offset: int, echoed: str) -> dict:
    """completion_logprobs of c, the echoed prompt's tokens first when it has their logprobs."""
    if echoed and out.prompt_logprobs is not None:
        prompt = (out.prompt_token_ids, out.prompt_logprobs)
        return completion_logprobs(c, offset, prompt, lambda t: state.tokenizer.decode([t]))
    return completion_logprobs(c, offset + len(echoed))


@router.post("/completions")
async def completions(req: CompletionRequest, state: State, raw_request: Request):
    state.check_model(req.model)
    state.check_kv_secret(raw_request, req.kv_transfer_params)
    prompts = _prompt_list(req.prompt)
    params = state.sampling_params(req, state.max_tokens(req.max_tokens, 16), req.logprobs)
    if req.echo:
        state.need_tokenizer()
        if req.logprobs is not None:  # (the prompt's tokens' too, as vLLM gives them)
            params = replace(params, prompt_logprobs=req.logprobs)
    rid = f"cmpl-{uuid.uuid4().hex}"
    if req.kv_transfer_params is not None and len(prompts) != 1:
        raise APIError(400, "kv_transfer_params go with one prompt", param="kv_transfer_params")
    ids = [f"{rid}-{i}" for i in range(len(prompts))]
    streams = await state.start(prompts, params, ids, req.kv_transfer_params, structured_param=req.structured_field)
    created = int(time.time())
    if req.stream:
        return sse(_stream(streams, req, params.n, rid, created, state), streams)
    choices, prompt_tokens, completion_tokens, cached_tokens, kv_transfer_params = [], 0, 0, 0, None
    for i, out in enumerate(await collect(raw_request, streams, state.metrics)):
        kv_transfer_params = out.kv_transfer_params
        prompt_tokens += len(out.prompt_token_ids)
        cached_tokens += out.num_cached_tokens
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            echoed = _echoed(out, state) if req.echo else ""
            choices.append(
                {
                    "index": i * params.n + c.index,
                    "text": echoed + c.text,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "logprobs": _logprobs(c, out, state, 0, echoed) if req.logprobs is not None else None,
                }
            )
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": state.served_model_name,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
        **({"kv_transfer_params": kv_transfer_params.to_dict()} if kv_transfer_params is not None else {}),
    }


async def _stream(streams, req: CompletionRequest, n: int, rid: str, created: int, state: ServerState):
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    prompt_tokens = completion_tokens = cached_tokens = 0
    model = state.served_model_name

    def chunk(index: int, text: str, logprobs=None, finish_reason=None, stop_reason=None) -> dict:
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": stop_reason,
                }
            ],
        }

    templates = EventTemplates(chunk)
    for i, stream in enumerate(streams):
        tracker, done, sent = state.metrics.track(), set(), {}  # (sent: each choice's next text offset)
        prompt_out = None  # (the output with the prompt's logprobs: the first)
        async for out in stream:
            tracker.update(out)
            prompt_out = prompt_out or out
            for c in new_completions(out, done):
                echoed = _echoed(out, state) if req.echo and c.index not in sent else ""
                start = sent.setdefault(c.index, 0)
                text = echoed + c.text
                completion_tokens += len(c.token_ids)
                index = i * n + c.index
                logprobs = None
                if req.logprobs is not None:  # (offsets go on where the tokens sent end, as the whole answer's)
                    logprobs = _logprobs(c, prompt_out, state, start, echoed)
                    offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
                    sent[c.index] = offsets[-1] + len(tokens[-1] or "") if tokens else start + len(echoed)
                if logprobs is None and c.finish_reason is None:
                    yield templates.event(index, text)
                else:
                    yield chunk(index, text, logprobs, c.finish_reason, c.stop_reason)
            if out.finished:
                prompt_tokens += len(out.prompt_token_ids)
                cached_tokens += out.num_cached_tokens
    if include_usage:
        yield {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
        }
