"""What the `picovllm` logger says (a request field ignored, the KV cache's size, a step that
failed) goes to stderr, one line a message, `LEVEL MM-DD HH:MM:SS message` as vLLM's, once an
entry point has called configure_logging: the command line does, at `--log-level` (serve,
router; info) or warning (the other commands), and so does every process it starts
(PICOVLLM_LOGGING_LEVEL carries the level to them). On the Python API, LLM() does the same at
info (configure_default_logging), as vLLM does, unless the program has set up logging itself or
PICOVLLM_CONFIGURE_LOGGING=0 (vLLM's VLLM_CONFIGURE_LOGGING)."""

from __future__ import annotations

import logging
import sys

from picovllm import envs


class _StderrHandler(logging.StreamHandler):
    """A handler on the stderr of the moment (a test, or a program, may replace sys.stderr)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _) -> None:
        pass


def configure_logging(level: str | None = None) -> None:
    """The picovllm logger on stderr at level (a name: debug, info, warning, error, critical;
    None: PICOVLLM_LOGGING_LEVEL's, and nothing when it is not set), for this process and the
    ones it starts; once per process, a later call only changes the level."""
    if level is None and (level := envs.logging_level()) is None:
        return
    envs.set_logging_level(level)
    logger = logging.getLogger("picovllm")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
    logger.setLevel(level.upper())


def configure_default_logging() -> None:
    """configure_logging at PICOVLLM_LOGGING_LEVEL's level, else info, unless an entry point has
    configured the picovllm logger, the program has configured logging (the root logger has a
    handler: the messages go there) or PICOVLLM_CONFIGURE_LOGGING=0."""
    if envs.configure_logging() and not logging.getLogger("picovllm").handlers and not logging.getLogger().handlers:
        configure_logging(envs.logging_level() or "info")
