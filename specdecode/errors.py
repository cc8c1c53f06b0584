"""User-facing errors.

A `SpecDecodeError` means the input or the environment is wrong (unknown model, corrupt file,
invalid setting), not that specdecode has a bug. The CLI prints its message as one line and exits
non-zero; the API raises it (it is a `ValueError`, so callers that catch those keep working).
"""

from typing import Any


class SpecDecodeError(ValueError):
    """Bad input or environment, explained in one line that names the setting or file."""


def require_positive(args: Any, *names: str) -> None:
    """Raise `SpecDecodeError` naming the first of the command-line options `names` (attributes
    of parsed `args`, as `max_len` for `--max-len`) whose value is below 1."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise SpecDecodeError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


class OutOfKVBlocks(SpecDecodeError):
    """A paged KV cache's pool has no free block: the memory budget is spent for now."""
