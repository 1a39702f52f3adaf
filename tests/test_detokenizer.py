"""Incremental detokenization (engine/detokenizer.py): the text streamed token by token, held
back while a character is incomplete, equals what decoding the whole output gives, special tokens
skipped or not, for a byte-level BPE (Qwen, GPT-2 style) and a Metaspace one (SentencePiece
style, whose decoder drops the first token's leading space: the prompt's last tokens must be
decoded with the output); the DecodeStream path (fast tokenizers) and the windowed path (other
tokenizers) show the same text after every token."""

import random

import pytest
from tiny_models import CORPUS, SPECIAL, build_tokenizer

from picovllm import RequestOutputKind, SamplingParams
from picovllm.engine.detokenizer import Detokenizer
from picovllm.engine.output_processor import RequestState


def _metaspace_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIAL + ["<unk>"], show_progress=False)
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["byte-level", "metaspace"])
def tokenizer(tmp_path_factory, request):
    if request.param == "metaspace":
        return _metaspace_tokenizer()
    return build_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


def _streamed(detok: Detokenizer, prompt: list[int], output: list[int], skip: bool) -> list[str]:
    """req.output_text after each token, then after the end-of-request flush."""
    req = RequestState(0, SamplingParams(skip_special_tokens=skip), list(prompt), len(prompt))
    detok.start(req)
    texts = []
    for token in output:
        req.token_ids.append(token)
        assert detok.step(req) is None  # no stop strings here
        texts.append(req.output_text)
    detok.flush(req)
    return texts + [req.output_text]


def _decoded_at_the_end(detok: Detokenizer, prompt: list[int], output: list[int], skip: bool, stopped: bool) -> str:
    """req.output_text of a request whose text is wanted only at its end (FINAL_ONLY, no stop
    string): nothing while it runs; all of it once it ends at its length (flush) or at its last
    token, a stop token left out of the text (stopped)."""
    params = SamplingParams(skip_special_tokens=skip, output_kind=RequestOutputKind.FINAL_ONLY)
    req = RequestState(0, params, list(prompt), len(prompt))
    detok.start(req)
    for token in output:
        req.token_ids.append(token)
        assert detok.step(req) is None and req.output_text == "" and req.decode_stream is None
    detok.stopped(req) if stopped else detok.flush(req)
    return req.output_text


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_streamed_text_equals_the_whole_decode(tokenizer, skip, seed):
    rng = random.Random(seed)
    prompt = tokenizer.encode(rng.choice(CORPUS)[: rng.randrange(1, 40)])
    # the output: pieces of real text (multi-byte characters split over byte tokens, e.g. the
    # emoji's four bytes), random tokens and special tokens
    output = []
    while len(output) < 60:
        kind = rng.random()
        if kind < 0.5:
            start = rng.randrange(len(CORPUS[3]))
            output += tokenizer.encode(CORPUS[3][start : start + rng.randrange(1, 12)])
        elif kind < 0.9:
            output.append(rng.randrange(len(tokenizer)))
        else:
            output.append(rng.randrange(3))  # <|endoftext|>, <|im_start|>, <|im_end|>
    fast = Detokenizer(tokenizer)
    assert fast.backend is not None
    windowed = Detokenizer(tokenizer)
    windowed.backend = None
    texts = _streamed(fast, prompt, output, skip)
    assert texts == _streamed(windowed, prompt, output, skip)
    # at the end, the text streaming shows: after a flush, or up to the last token but one
    assert _decoded_at_the_end(fast, prompt, output, skip, stopped=False) == texts[-1]
    assert _decoded_at_the_end(fast, prompt, output, skip, stopped=True) == texts[-3]
    assert all(a == b[: len(a)] for a, b in zip(texts, texts[1:]))  # text only ever grows
    whole = tokenizer.decode(prompt + output, skip_special_tokens=skip)
    head = tokenizer.decode(prompt, skip_special_tokens=skip)
    assert whole.startswith(head) and texts[-1] == whole[len(head) :]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("completed", [True, False])
def test_a_prompt_that_ends_inside_a_character_keeps_that_character(tokenizer, skip, completed):
    """Token-id prompts may end inside a multi-byte character (the emoji's first bytes): those
    bytes are the prompt's, whether the output completes the character or not. Streamed, windowed
    and decoded at the end, the output's text is what decoding the whole sequence adds to the
    prompt's text."""
    emoji = tokenizer.encode("😀")
    if len(emoji) < 2:
        pytest.skip("this tokenizer has the character whole (no byte fallback)")
    prompt = tokenizer.encode("Hi ") + emoji[:2]
    output = (emoji[2:] if completed else []) + tokenizer.encode(" café and 東京 ok")
    fast = Detokenizer(tokenizer)
    windowed = Detokenizer(tokenizer)
    windowed.backend = None
    texts = _streamed(fast, prompt, output, skip)
    assert texts == _streamed(windowed, prompt, output, skip)
    assert _decoded_at_the_end(fast, prompt, output, skip, stopped=False) == texts[-1]
    whole = tokenizer.decode(prompt + output, skip_special_tokens=skip)
    head = tokenizer.decode(prompt, skip_special_tokens=skip)
    assert texts[-1] == whole[len(head) :] and texts[-1].endswith(" café and 東京 ok")
