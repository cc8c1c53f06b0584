"""Token ids to text, released as it can no longer change, cut before a stop string."""

from __future__ import annotations

from specdecode.models.tokenizer import Tokenizer


class TextStream:
    """Turns a growing list of token ids into text deltas, ending the text before a stop string.

    Text is released only when it cannot change any more: a trailing incomplete UTF-8 sequence
    (decoded as U+FFFD) and any tail that could be the start of a stop string are held back.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # the whole text so far, after any stop cut
        self.sent = 0  # characters of `text` already released
        self.stopped = False

    def update(self, token_ids: list[int], final: bool) -> str:
        """Decode all tokens so far; return the newly releasable text."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(token_ids)
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s)))
            if at != -1:
                text, final, self.stopped = text[:at], True, True
        self.text = text
        if final:
            ready = len(text)
        else:
            ready = len(text) - self.hold
            if text.endswith("\ufffd"):
                ready = min(ready, len(text.rstrip("\ufffd")))
        if ready <= self.sent:
            return ""
        delta, self.sent = text[self.sent : ready], ready
        return delta
