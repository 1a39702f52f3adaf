"""FP8 weights (quantization="fp8"), or an FP8 KV cache (--kv-cache-dtype fp8), against the model's
dtype on a real model: the perplexity of two texts that ship with Python (code: the start of
json/decoder.py's source; prose: the Zen of Python, `this.s`) from prompt_logprobs, and greedy
agreement over 20 fixed prompts (the tokens before the first difference, of 32 each).

Usage: python benchmarks/fp8_accuracy.py [MODEL] [--device cpu|cuda] [--dtype bfloat16] [--kv-cache-dtype fp8]
       (MODEL: default the built-in default model; with --kv-cache-dtype the weights stay in --dtype)."""

import argparse
import codecs
import inspect
import json.decoder
import math
import this
import time

from picovllm import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "import numpy as np\n",
    "The three primary colors are",
    "SELECT name FROM users WHERE",
    "In 1969, the first humans",
    "class Stack:\n    def __init__(self):",
    "The largest planet in the solar system is",
    "To sort a list in Python, you can",
    "Photosynthesis is the process by which",
    "#include <stdio.h>\nint main() {",
    "The theory of relativity was developed by",
    "def is_prime(n):",
    "A haiku about the sea:\n",
    "The speed of light is approximately",
    "git commit -m",
    "The Pythagorean theorem states that",
    "function add(a, b) {",
    "The main ingredients of bread are",
]
TOKENS = 32
TEXTS = {"code": inspect.getsource(json.decoder)[:1700], "prose": codecs.decode(this.s, "rot13")}


def perplexity(llm: LLM, text: str) -> float:
    """exp of the mean negative log-probability of the text's tokens after the first."""
    out = llm.generate(text, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    return math.exp(-sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))) / (len(ids) - 1))


def run(args, fp8: bool) -> tuple[list[list[int]], dict[str, float], float]:
    """(greedy tokens per prompt, perplexity of each text, seconds); fp8: the FP8 weights or cache."""
    start = time.perf_counter()
    kv = dict(kv_cache_dtype=args.kv_cache_dtype) if fp8 and args.kv_cache_dtype else {}
    quantization = "fp8" if fp8 and not kv else None
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=512, quantization=quantization, **kv)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True), use_tqdm=False)
    ppl = {name: perplexity(llm, text) for name, text in TEXTS.items()}
    return [o.outputs[0].token_ids for o in outs], ppl, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", choices=("fp8", "fp8_e4m3"), default=None)
    args = parser.parse_args()
    base, fp8 = run(args, False), run(args, True)
    common = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), TOKENS) for a, b in zip(base[0], fp8[0])]
    for name in TEXTS:
        a, b = base[1][name], fp8[1][name]
        print(f"perplexity of the {name} text: {args.dtype} {a:.3f}, fp8 {b:.3f} ({b / a - 1:+.1%})")
    print(f"greedy agreement {sum(common) / (TOKENS * len(PROMPTS)):.1%} (tokens before the first difference)")
    print(f"wall {base[2]:.1f} s, fp8 {fp8[2]:.1f} s")


if __name__ == "__main__":
    main()
