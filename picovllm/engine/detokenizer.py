"""Incremental detokenization and stop strings.

Text appears once it is complete (a multi-byte character split across tokens shows when its
last byte arrives). Tokenizers backed by Hugging Face `tokenizers` (every fast tokenizer) decode
token by token in Rust with its DecodeStream, primed with the prompt's last tokens for the right
spacing, a few times faster than the windowed decoding that other tokenizers use (two `decode`
calls over the newest tokens per step). At the end, text still
held back (an incomplete character) is decoded as a whole `decode` would show it.

A request whose text nothing reads before it ends (RequestOutputKind.FINAL_ONLY, LLM.generate's,
and no stop string to look for) is decoded once, when it ends (req.text_at_end): the same text,
without the per-token work.

Text that a stop string found later could still cut off is not final (final_text_len): streams
send only final text, so that what a client has seen is never taken back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from picovllm.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from picovllm.engine.output_processor import RequestState

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first output tokens, for correct spacing


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)  # a fast tokenizer's Rust tokenizer
        self.backend = backend if isinstance(backend, Tokenizer) else None

    def start(self, req: RequestState) -> None:
        """req.read_offset: the tokens whose text is in req.output_text (or the prompt's);
        req.prefix_offset: a few tokens before it, decoded with what follows for spacing."""
        req.read_offset = req.num_prompt_tokens
        req.prefix_offset = max(req.num_prompt_tokens - _PROMPT_CONTEXT, 0)
        if self.backend is not None:
            p = req.params
            req.text_at_end = p.output_kind is RequestOutputKind.FINAL_ONLY and not p.stop
            if not req.text_at_end:
                self._open_stream(req)

    def _open_stream(self, req: RequestState) -> None:
        """The stream, primed with the prompt's last tokens. A prompt of token ids may end inside a
        character: the stream then holds its bytes and would show them with the output's first
        text; that first text is taken from the windowed decoding instead (_stream), which leaves
        them to the prompt."""
        req.decode_stream = DecodeStream(skip_special_tokens=req.params.skip_special_tokens)
        piece = None
        for token in req.token_ids[req.prefix_offset : req.read_offset]:
            piece = req.decode_stream.step(self.backend, token)
        req.num_streamed = req.read_offset
        req.stream_holds_prompt = req.read_offset > req.prefix_offset and piece is None

    def step(self, req: RequestState) -> str | None:
        """Append the text of the newest token(s) to req.output_text; return the stop string
        that matched (the text is then trimmed at it), else None. Nothing for a request decoded
        at its end (see stopped and flush)."""
        if req.text_at_end:
            return None
        new_text = self._stream(req) if self.backend is not None else self._window(req)
        if not new_text:
            return None
        old_len = len(req.output_text)
        req.output_text += new_text
        if req.num_output_tokens < req.params.min_tokens:
            return None
        return self._check_stop(req, old_len)

    def stopped(self, req: RequestState) -> None:
        """req ended at its last token (EOS, a stop token, its grammar), which is not part of its
        text: a request decoded at its end gets the text that streaming would have shown."""
        if req.text_at_end:
            self._open_stream(req)
            req.output_text = self._stream(req, len(req.token_ids) - 1)

    def _stream(self, req: RequestState, end: int | None = None) -> str:
        """The text of tokens num_streamed..end (None: all) that is complete."""
        ids, pieces = req.token_ids, []
        end = len(ids) if end is None else end
        for i in range(req.num_streamed, end):
            piece = req.decode_stream.step(self.backend, ids[i])
            if piece:
                if req.stream_holds_prompt:  # (the output's first text: the prompt's bytes left out)
                    piece, req.stream_holds_prompt = self._window_text(req, i + 1, final=True), False
                pieces.append(piece)
                req.read_offset = i + 1
        req.num_streamed = end
        req.prefix_offset = max(req.read_offset - _PROMPT_CONTEXT, 0)  # (for flush)
        return "".join(pieces)

    def _window(self, req: RequestState, final: bool = False) -> str:
        """The text of the tokens past read_offset, decoded after the few before it (spacing);
        nothing while it ends in an incomplete character, unless final."""
        text = self._window_text(req, len(req.token_ids), final)
        if text:
            req.prefix_offset, req.read_offset = req.read_offset, len(req.token_ids)
        return text

    def _window_text(self, req: RequestState, end: int, final: bool) -> str:
        """The text of tokens read_offset..end, as _window decodes it (offsets unchanged)."""
        skip = req.params.skip_special_tokens
        ids = req.token_ids
        prefix = self.tokenizer.decode(ids[req.prefix_offset : req.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[req.prefix_offset : end], skip_special_tokens=skip)
        if len(full) <= len(prefix) or (not final and full.endswith("\ufffd")):
            return ""
        return full[len(prefix) :]

    def flush(self, req: RequestState) -> str | None:
        """At the end of a request, append text still held back (an incomplete character at the
        very end stays as U+FFFD, as decoding all the tokens gives); return a stop string hit. (A
        request decoded at its end gets all its text here, in one decode.)"""
        new_text = self._window(req, final=True)
        if not new_text:
            return None
        old_len = len(req.output_text)
        req.output_text += new_text
        return self._check_stop(req, old_len)

    @staticmethod
    def final_text_len(req: RequestState) -> int:
        """How much of req.output_text is final: all of it once req has finished; otherwise all
        but the longest tail that is the start of one of its stop strings (a later match can only
        begin there)."""
        text = req.output_text
        if req.is_finished or not req.params.stop:
            return len(text)
        hold = 0
        for stop in req.params.stop:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return len(text) - hold

    @staticmethod
    def _check_stop(req: RequestState, old_len: int) -> str | None:
        text = req.output_text
        # a stop string ending in the new text may have started before it; the earliest one wins
        hits = [
            (idx, stop) for stop in req.params.stop if (idx := text.find(stop, max(0, old_len - len(stop) + 1))) != -1
        ]
        if not hits:
            return None
        idx, stop = min(hits)
        end = idx + len(stop) if req.params.include_stop_str_in_output else idx
        req.output_text = text[:end]
        return stop
