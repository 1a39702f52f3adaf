"""What the server's routes share: the server's state (the engine, the model's name, sampling
defaults, metrics) as a FastAPI dependency, OpenAI errors, starting and collecting a request's
outputs, Server-Sent Events and the OpenAI shapes of usage and logprobs.

The engine delivers RequestOutputKind.DELTA outputs (what each step added, only text that no
stop string can still cut off: engine/detokenizer.py): streams send them as they come, and a
request that does not stream joins them (collect).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from picovllm.engine.structured_output import check_structured_outputs
from picovllm.entrypoints.openai.async_engine import AsyncEngine, EngineClient, EngineError, RequestStream
from picovllm.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from picovllm.kv_transfer_params import KVTransferParams
from picovllm.model_source.builtin import cache_root
from picovllm.outputs import CompletionOutput, RequestOutput
from picovllm.sampling_params import RequestOutputKind, SamplingParams


def error_response(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    """An error as OpenAI's API answers it (the server's and the router's)."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}}, status)


_HTTP_ERRORS = {401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError"}


async def http_error(_, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown path, a wrong method) as OpenAI errors too."""
    response = error_response(exc.status_code, str(exc.detail), _HTTP_ERRORS.get(exc.status_code, "HTTPError"))
    response.headers.update(exc.headers or {})
    return response


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "BadRequestError",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers or {}


RETRY_AFTER_S = 1  # what a request refused for a full queue is told to wait
KV_SECRET_HEADER = "X-KV-Transfer-Secret"  # the router's proof, on requests with kv_transfer_params


def kv_transfer_secret(given: str | None = None) -> str:
    """The secret a router and its prefill and decode instances share: `given`
    (--kv-transfer-secret), else this user's on this machine, made once in the cache directory
    (readable by this user only), so that the processes of one machine agree without being told."""
    if given:
        return given
    path = os.path.join(cache_root(), "kv_transfer_secret")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        mine = f"{path}.{os.getpid()}"
        fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        try:
            os.link(mine, path)  # (made whole, or not at all: another process may be here too)
        except FileExistsError:
            pass
        finally:
            os.unlink(mine)
    with open(path) as f:
        return f.read().strip()


@dataclass
class ServerState:
    engine: AsyncEngine | EngineClient
    served_model_name: str
    api_key: str | None
    sampling_defaults: dict  # what a request leaves out: the model's generation config under serve's sampling flags
    metrics: ServerMetrics
    max_num_waiting: int | None = None
    kv_transfer_secret: str | None = None  # a prefill or decode instance's: what its router sends
    tool_call_parser: str = "hermes"  # tool_calls.TOOL_PARSERS: how "auto" finds the model's calls
    enable_auto_tool_choice: bool = True
    validating: int = 0  # requests past the door, their prompts being validated (not streams yet)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")

    def check_kv_secret(self, request: Request, kv_transfer_params: dict | None = None) -> None:
        """Transfer parameters and the /kv_transfer routes are for this instance's router only: 403
        without its secret (a prefill or decode instance; an ordinary one refuses the parameters
        later, by its role)."""
        if self.kv_transfer_secret is None or (kv_transfer_params is None and request.url.path.startswith("/v1")):
            return
        given = request.headers.get(KV_SECRET_HEADER, "")
        if not hmac.compare_digest(given.encode(), self.kv_transfer_secret.encode()):
            raise APIError(
                403,
                f"kv_transfer_params need this instance's router ({KV_SECRET_HEADER}: the --kv-transfer-secret)",
                "PermissionDeniedError",
                "kv_transfer_params",
            )

    def need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise APIError(400, "the server runs without a tokenizer: send token ids")

    @property
    def max_tokens_bound(self) -> int | None:
        """The generation config's max_new_tokens (the engine's defaults): vLLM's server-wide bound."""
        return self.engine.sampling_defaults.get("max_tokens")

    def max_tokens(self, requested: int | None, otherwise: int) -> int:
        """A request's max_tokens: its own, else the server's default (serve's --max-tokens, the
        generation config's max_new_tokens), else `otherwise` (OpenAI's default); at most the
        generation config's max_new_tokens whichever it is."""
        n = requested if requested is not None else self.sampling_defaults.get("max_tokens", otherwise)
        return n if self.max_tokens_bound is None else min(n, self.max_tokens_bound)

    def sampling_params(self, req, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams, asking for DELTA outputs: a stream sends each step's as it
        comes, a whole answer joins them (collect), and the metrics time each step's tokens."""
        try:
            params = req.sampling_params(self.sampling_defaults, max_tokens, logprobs)
            return replace(params, output_kind=RequestOutputKind.DELTA)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split()[0].rstrip(":")) from None

    async def start(
        self,
        prompts: list,
        params: SamplingParams,
        request_ids: list[str],
        kv_transfer_params: dict | None = None,
        prompt_param: str = "prompt",
        structured_param: str = "structured_outputs",
    ) -> list[RequestStream]:
        """Validate the prompts (400 on bad input), then start generating all of them at once: their
        streams (the caller closes them). 503 when max_num_waiting requests are waiting already:
        started ones, and those between this door and the engine (validating). kv_transfer_params
        (the request's JSON) are parsed here, once, and the structured outputs' schema, regex or
        grammar checked (off the event loop; a 400 names structured_param, the field it came in)."""
        if self.max_num_waiting is not None:
            engine = self.engine
            waiting = self.validating + engine.num_open_requests - engine.num_running
            if waiting >= self.max_num_waiting:
                self.metrics.rejected.inc()
                raise APIError(
                    503,
                    f"{waiting} requests are waiting already (at most {self.max_num_waiting} in this HTTP process: "
                    "--max-num-waiting, split between --api-server-count processes): retry later",
                    "ServiceUnavailableError",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
        if params.structured_outputs is not None:
            try:
                await asyncio.to_thread(
                    check_structured_outputs, params.structured_outputs, self.tokenizer, structured_param
                )
            except ValueError as e:
                raise APIError(400, str(e), param=structured_param) from None
        self.validating += len(prompts)
        try:
            kv = None if kv_transfer_params is None else KVTransferParams.from_dict(kv_transfer_params)
            valid = [await self.engine.validate(p, params, kv) for p in prompts]
        except ValueError as e:
            raise APIError(400, str(e), param=_prompt_error_param(str(e), prompt_param)) from None
        finally:
            self.validating -= len(prompts)
        # (no await from here on: the streams are open before another request passes the door)
        try:
            return [self.engine.generate(rid, text, ids, params, kv) for rid, (text, ids) in zip(request_ids, valid)]
        except EngineError as e:  # (the engine is gone: nothing was started)
            raise APIError(500, str(e), "InternalServerError") from None


def _prompt_error_param(message: str, prompt_param: str) -> str:
    """The field a prompt's validation error (engine/input_processor.py) is about."""
    for field in ("kv_transfer_params", "max_tokens", "stop"):
        if message.startswith(field) or f"+ {field} " in message:
            return field
    return prompt_param


async def server_state(request: Request) -> ServerState:
    """(async: FastAPI runs a plain function dependency on a worker thread, a hop per request)"""
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]  # a route's parameter: the server's state


async def authorize(request: Request) -> None:
    """/v1 routes need the key when the server has one (as vLLM's)."""
    key = request.app.state.server.api_key
    if key and request.headers.get("authorization") != f"Bearer {key}":
        raise APIError(401, "invalid or missing API key", "AuthenticationError")


class ClientGone(Exception):
    """The client disconnected before its answer was ready (nothing more is sent to it)."""


T = TypeVar("T")


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first: then it is cancelled (the request streams
    it holds are closed, which aborts their requests) and ClientGone is raised, as vLLM's
    with_cancellation does. For answers sent whole: a streamed one notices when a send fails."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # (this handler cancelled: the server stopping)
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task not in done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()


async def collect(request: Request, streams: list[RequestStream], metrics: ServerMetrics) -> list[RequestOutput]:
    """The final outputs of started requests (ServerState.start), one after another, for an answer
    sent whole; closes their streams (the rest are aborted when one fails). A client that
    disconnects before they are ready, or as they come, is ClientGone, and its requests are all
    aborted, finished ones too: a finished request's abort frees what the engine still holds for
    it, a prefill instance's prompt blocks held for pickup, which no one would pull now."""
    try:
        outputs = await cancel_on_disconnect(request, _collect_all(streams, metrics))
        if not await request.is_disconnected():
            return outputs
    except ClientGone:
        pass
    for stream in streams:
        stream.abandon()
    raise ClientGone()


async def _collect_all(streams: list[RequestStream], metrics: ServerMetrics) -> list[RequestOutput]:
    try:
        return [await _collect(stream, metrics.track()) for stream in streams]
    finally:
        for stream in streams:
            stream.close()


async def _collect(stream: RequestStream, tracker: RequestTracker) -> RequestOutput:
    """A request's final output: each completion's DELTA outputs joined."""
    outputs: dict[int, CompletionOutput] = {}
    out = prompt_logprobs = None
    try:
        async for out in stream:
            tracker.update(out)
            prompt_logprobs = prompt_logprobs or out.prompt_logprobs  # (in one of the outputs)
            for c in out.outputs:
                prev = outputs.get(c.index)
                if prev is None:
                    outputs[c.index] = CompletionOutput(
                        c.index,
                        c.text,
                        list(c.token_ids),
                        c.cumulative_logprob,
                        None if c.logprobs is None else list(c.logprobs),
                        c.finish_reason,
                        c.stop_reason,
                    )
                    continue
                prev.text += c.text
                prev.token_ids += c.token_ids
                if prev.logprobs is not None:
                    prev.logprobs += c.logprobs
                prev.cumulative_logprob, prev.finish_reason, prev.stop_reason = (
                    c.cumulative_logprob,
                    c.finish_reason,
                    c.stop_reason,
                )
    except EngineError as e:
        raise APIError(500, str(e), "InternalServerError") from None
    return RequestOutput(
        out.request_id,
        out.prompt,
        out.prompt_token_ids,
        [outputs[i] for i in sorted(outputs)],
        out.finished,
        out.num_cached_tokens,
        kv_transfer_params=out.kv_transfer_params,
        prompt_logprobs=prompt_logprobs,
    )


def new_completions(out: RequestOutput, done: set[int]):
    """The completions of a DELTA output that carry something new: text, tokens, or their end
    (reported once: done collects the indices that have ended)."""
    for c in out.outputs:
        if c.index in done or not (c.text or c.token_ids or c.finish_reason):
            continue
        if c.finish_reason is not None:
            done.add(c.index)
        yield c


class _EventStream(StreamingResponse):
    """A StreamingResponse that closes the request streams it sends when it ends, however it ends
    (its body sent, or the client gone, even before the body began)."""

    def __init__(self, body: AsyncIterator[str], streams: list[RequestStream]):
        super().__init__(body, media_type="text/event-stream")
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.close()


def sse(chunks: AsyncIterator[dict | str], streams: list[RequestStream]) -> StreamingResponse:
    """Server-Sent Events of the chunks (made from the streams' outputs): dicts, or events already
    serialised (EventTemplates). A stream whose engine dies ends with an error event (OpenAI's
    error JSON, code 500). Closes the streams when the response ends."""

    async def body():
        try:
            async for chunk in chunks:
                yield chunk if isinstance(chunk, str) else f"data: {json.dumps(chunk)}\n\n"
        except EngineError as e:
            error = {"message": str(e), "type": "InternalServerError", "param": None, "code": 500}
            yield f"data: {json.dumps({'error': error})}\n\n"
            return
        yield "data: [DONE]\n\n"

    return _EventStream(body(), streams)


class EventTemplates:
    """The SSE events of a stream's common chunk (one more piece of text, no logprobs, not the
    last), serialised once per choice around the text: filling the template costs a fraction of
    json.dumps of the whole chunk per token."""

    _HOLE = "\x00text\x00"

    def __init__(self, chunk: Callable[[int, str], dict]):
        self.chunk, self.parts = chunk, {}

    def event(self, index: int, text: str) -> str:
        if index not in self.parts:
            self.parts[index] = f"data: {json.dumps(self.chunk(index, self._HOLE))}\n\n".split(json.dumps(self._HOLE))
        head, tail = self.parts[index]
        return head + json.dumps(text) + tail


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage, with the prompt tokens the prefix cache served (prompt_tokens_details)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _lp_item(lp) -> dict:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}


def completion_logprobs(c: CompletionOutput, offset: int = 0, prompt: tuple | None = None, decode=None) -> dict:
    """/v1/completions' logprobs of c's tokens; text_offset: where each token's text starts, each
    token's text after the one before (as vLLM counts it), from offset (an echoed prompt's
    length, or in a stream where the tokens sent before end, so that the streamed offsets are the
    whole answer's). prompt: (token ids, RequestOutput.prompt_logprobs)
    of an echoed prompt, whose tokens come first (as vLLM gives them: the first without a
    log-probability, its text from decode)."""
    ids, entries = list(c.token_ids), list(c.logprobs or [])
    if prompt is not None:
        ids, entries = list(prompt[0]) + ids, list(prompt[1]) + entries
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(ids, entries, strict=False):
        text = decode(tid) if entry is None else entry[tid].decoded_token
        tokens.append(text)
        token_lps.append(None if entry is None else entry[tid].logprob)
        tops.append(None if entry is None else {lp.decoded_token: lp.logprob for lp in entry.values()})
        offsets.append(offset)
        offset += len(text or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, k: int) -> list[dict]:
    """Each of c's tokens with its log-probability and the k most likely tokens at its step."""
    content = []
    for tid, entry in zip(c.token_ids, c.logprobs or [], strict=False):
        top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
        content.append({**_lp_item(entry[tid]), "top_logprobs": [_lp_item(lp) for lp in top]})
    return content
