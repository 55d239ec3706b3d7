"""What the runtime's command-line tools (glue, generate) share: one stderr line and an exit
code for every error, argparse's usage errors included, never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


def first_line(exc: BaseException) -> str:
    """An unexpected error as a tool says it: its type and its message's first line
    (TensorFlow's messages run on for pages)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def exit_with(prog: str, message: str, code: int) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


class ToolParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        exit_with(self.prog, message, 2)
