"""Incremental detokenization and stop strings.

Each step decodes only a short window of tokens: text appears once it is complete (a
multi-byte character split across tokens decodes to U+FFFD until its last byte arrives).
"""
from __future__ import annotations

from picovllm.engine.request import Request

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first output tokens, for correct spacing


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def start(self, req: Request) -> None:
        req.read_offset = req.num_prompt_tokens
        req.prefix_offset = max(req.num_prompt_tokens - _PROMPT_CONTEXT, 0)

    def step(self, req: Request) -> str | None:
        """Append the text of the newest token(s) to req.output_text; return the stop string
        that matched (the text is then trimmed at it), else None."""
        skip = req.params.skip_special_tokens
        ids = req.token_ids
        prefix = self.tokenizer.decode(ids[req.prefix_offset:req.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[req.prefix_offset:], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        new_text = full[len(prefix):]
        req.prefix_offset, req.read_offset = req.read_offset, len(ids)
        old_len = len(req.output_text)
        req.output_text += new_text
        if req.num_output_tokens < req.params.min_tokens:
            return None
        return self._check_stop(req, old_len)

    def flush(self, req: Request) -> str | None:
        """At the end of a request, append text still held back (an incomplete character at the
        very end stays as U+FFFD, as decoding all the tokens gives); return a stop string hit."""
        skip = req.params.skip_special_tokens
        prefix = self.tokenizer.decode(req.token_ids[req.prefix_offset:req.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(req.token_ids[req.prefix_offset:], skip_special_tokens=skip)
        if len(full) <= len(prefix):
            return None
        old_len = len(req.output_text)
        req.output_text += full[len(prefix):]
        req.prefix_offset = req.read_offset = len(req.token_ids)
        return self._check_stop(req, old_len)

    @staticmethod
    def _check_stop(req: Request, old_len: int) -> str | None:
        text = req.output_text
        # a stop string ending in the new text may have started before it; the earliest one wins
        hits = [(idx, stop) for stop in req.params.stop
                if (idx := text.find(stop, max(0, old_len - len(stop) + 1))) != -1]
        if not hits:
            return None
        idx, stop = min(hits)
        end = idx + len(stop) if req.params.include_stop_str_in_output else idx
        req.output_text = text[:end]
        return stop
