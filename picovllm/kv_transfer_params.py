"""kv_transfer_params: what a request of disaggregated serving carries (engine/kv_handoff.py),
between the router, a prefill instance and a decode instance, as one type."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVTransferParams:
    """A request's kv_transfer_params (vLLM's name; engine/kv_handoff.py), parsed once where they
    come in (from_dict) and JSON again only where they go out (to_dict). A prefill instance's
    request asks for do_remote_decode; its answer, and the decode instance's request that carries
    it on, say where the prompt's KV is held: the pool's agent (KVTransfer.agent_info), the
    lease's request id, its block ids, the tokens they hold, the seconds the lease has left and
    what the KV is (kv_compat)."""

    do_remote_decode: bool = False
    remote_request_id: str | None = None  # (set: a decode instance pulls the KV)
    remote_agent: dict | None = None
    remote_block_ids: tuple[int, ...] = ()
    remote_num_tokens: int = 0
    remote_lease_s: float = 0.0
    remote_compat: dict | None = None

    @property
    def pulls(self) -> bool:
        """Whether a decode instance pulls this request's prompt KV."""
        return self.remote_request_id is not None

    @classmethod
    def from_dict(cls, kv) -> KVTransferParams:
        """ValueError ("kv_transfer_params: ...") when kv is not what a request may carry."""
        problem = _kv_shape_problem(kv)
        if problem is not None:
            raise ValueError(f"kv_transfer_params: {problem}")
        if kv.get("do_remote_decode"):
            return cls(do_remote_decode=True)
        return cls(
            remote_request_id=kv["remote_request_id"],
            remote_agent=kv["remote_agent"],
            remote_block_ids=tuple(kv["remote_block_ids"]),
            remote_num_tokens=kv["remote_num_tokens"],
            remote_lease_s=float(kv["remote_lease_s"]),
            remote_compat=kv.get("remote_compat"),
        )

    def to_dict(self) -> dict:
        if not self.pulls:
            return {"do_remote_decode": self.do_remote_decode}
        return {
            "remote_agent": self.remote_agent,
            "remote_request_id": self.remote_request_id,
            "remote_block_ids": list(self.remote_block_ids),
            "remote_num_tokens": self.remote_num_tokens,
            "remote_lease_s": self.remote_lease_s,
            "remote_compat": self.remote_compat,
        }

    def check(self, role: str, block_size: int, num_prompt_tokens: int, params) -> None:
        """Against this instance's role and the request (its SamplingParams): ValueError
        ("kv_transfer_params: ...")."""
        problem = self._fit_problem(role, block_size, num_prompt_tokens, params.n)
        if problem is None and params.prompt_logprobs is not None:
            problem = "prompt_logprobs (echo with logprobs) need the prompt computed where they are asked, not moved"
        if problem is not None:
            raise ValueError(f"kv_transfer_params: {problem}")

    def _fit_problem(self, role: str, block_size: int, num_prompt_tokens: int, n: int) -> str | None:
        if not self.pulls:
            if role != "prefill":
                return f"do_remote_decode needs a prefill instance (this one: {role})"
            return None if n == 1 else "a prefill instance's request computes one completion (n=1)"
        if role != "decode":
            return f"remote blocks need a decode instance (this one: {role})"
        if self.remote_num_tokens != num_prompt_tokens:
            return (
                f"the prefill instance computed {self.remote_num_tokens} prompt tokens, "
                f"this prompt has {num_prompt_tokens}: not the same prompt"
            )
        if len(self.remote_block_ids) * block_size < num_prompt_tokens - 1:
            return "remote_block_ids do not cover the prompt"
        return None


def _kv_shape_problem(kv) -> str | None:
    if not isinstance(kv, dict):
        return "must be an object"
    if kv.get("do_remote_decode"):
        return None
    if "remote_block_ids" not in kv:
        return "need do_remote_decode, or a prefill instance's answer"
    agent, blocks = kv.get("remote_agent"), kv.get("remote_block_ids")
    if not isinstance(agent, dict) or not isinstance(kv.get("remote_request_id"), str):
        return "remote_agent or remote_request_id missing"
    ranks = agent.get("ranks")
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
        return "remote_agent has no ranks"
    if type(kv.get("remote_num_tokens")) is not int:
        return "remote_num_tokens must be an integer"
    if not isinstance(blocks, list):
        return "remote_block_ids must be a list"
    pool = min(r.get("num_blocks") if isinstance(r.get("num_blocks"), int) else 0 for r in ranks)
    if not all(type(b) is int and 0 <= b < pool for b in blocks):
        return f"remote_block_ids must be block ids of the prefill instance's pool (0..{pool - 1})"
    lease = kv.get("remote_lease_s")
    if type(lease) not in (int, float) or not lease > 0:
        return "remote_lease_s must be a number > 0"
    return None
