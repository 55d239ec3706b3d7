"""A stranger's words made safe to show: in a terminal (``swarm`` output) or a log line."""

from __future__ import annotations

import re

# What a terminal would act on in a stranger's text: C0 controls but newline and tab, DEL,
# C1 controls (CSI among them), line and paragraph separators, bidi overrides and isolates.
_TERMINAL_UNSAFE = re.compile(
    r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)
# The same, newline and tab included: what could forge a line of a log.
_LINE_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escaped(unsafe: re.Pattern[str], text: str) -> str:
    """``text`` with what ``unsafe`` matches written as its escape (``\\x1b``)."""
    return unsafe.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def terminal_safe(text: str) -> str:
    """A fellow's words (a log line) made safe to print: what a terminal would act on is
    shown escaped (``\\x1b``); lines and tabs stay, so a traceback reads as one."""
    return _escaped(_TERMINAL_UNSAFE, text)


def loggable(text: str, limit: int = 300) -> str:
    """A fellow's words for one line of this process's log: every control, line-breaking
    and bidi character escaped (no forged lines, no terminal escapes), at most ``limit``
    characters of it (then ``...``)."""
    more = "..." if len(text) > limit else ""
    return _escaped(_LINE_UNSAFE, text[:limit]) + more
