"""GET /kv_transfer/info and POST /kv_transfer/release, for a disaggregated instance's router (they
need its secret, serving.KV_SECRET_HEADER): what this instance is (its role, and what its KV is:
the router checks that its prefill and decode instances agree), and ending a prefill instance's
lease on a prompt's KV at once (the router gave up on the request: its decode instance refused it
or failed, or the client left)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from picovllm.entrypoints.openai.serving import APIError, State

router = APIRouter()


@router.get("/kv_transfer/info")
async def info(state: State, request: Request):
    state.check_kv_secret(request)
    engine = state.engine
    return {"role": engine.kv_role, "kv_compat": engine.kv_compat, "max_model_len": engine.max_model_len}


class ReleaseRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    request_id: str  # the prefill instance's, as its kv_transfer_params name it (remote_request_id)


@router.post("/kv_transfer/release")
async def release(body: ReleaseRequest, state: State, request: Request):
    state.check_kv_secret(request)
    if state.engine.kv_role != "prefill":
        raise APIError(400, f"only a prefill instance holds KV for others (this one: {state.engine.kv_role})")
    state.engine.abort(body.request_id)  # (a finished request's lease ends; an unknown id is ignored)
    return {}
