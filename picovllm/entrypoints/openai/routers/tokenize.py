"""POST /tokenize and /detokenize (vLLM's): the server's tokenizer, without generating."""

from __future__ import annotations

from fastapi import APIRouter

from picovllm.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from picovllm.entrypoints.openai.routers.chat import chat_text
from picovllm.entrypoints.openai.serving import APIError, State

router = APIRouter()


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, state: State):
    state.check_model(req.model)
    state.need_tokenizer()
    tokenizer = state.tokenizer
    if req.messages is not None:
        text = chat_text(tokenizer, req.messages, True)
        tokens = tokenizer.encode(text, add_special_tokens=False)
    elif req.prompt is not None:
        tokens = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        raise APIError(400, "give either prompt or messages", param="prompt")
    return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, state: State):
    state.check_model(req.model)
    state.need_tokenizer()
    vocab = state.engine.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}
