"""A completion's tokens as text, piece by piece, with stop sequences.

Each token is its bytes (``Tokenizer.token_bytes``); a UTF-8 character may span tokens, so
the bytes go through an incremental decoder (``errors="replace"``, as ``generate`` decodes)
and a piece never ends inside a character. A stop sequence ends the completion and is not
part of it (the OpenAI API's rule); text that could be the start of a stop sequence is held
back until the next tokens tell, so what was streamed never has to be taken back.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from silentswarm.agent.runtime.tokenizer import Tokenizer


class TextAssembler:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded, not yet given out
        self.stopped = False

    def add(self, token: int) -> str:
        """The text ``token`` completes (maybe ""); sets ``stopped`` at a stop sequence,
        after which nothing more is given out."""
        if self.stopped:
            return ""
        self.ids.append(token)
        self._held += self._decoder.decode(self.tokenizer.token_bytes(token))
        cut = min((i for i in (self._held.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._held = self._held[:cut], ""
            return out
        keep = self._stop_prefix()
        out = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return out

    def finish(self) -> str:
        """What is held back, once no token follows."""
        if self.stopped:
            return ""
        out = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return out

    def _stop_prefix(self) -> int:
        """The length of the longest end of the held text that begins a stop sequence."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self._held)), longest, -1):
                if self._held.endswith(stop[:n]):
                    longest = n
                    break
        return longest
