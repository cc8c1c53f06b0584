"""User-facing errors.

A `SpecDecodeError` means the input or the environment is wrong (unknown model, corrupt file,
invalid setting), not that specdecode has a bug. The CLI prints its message as one line and exits
non-zero; the API raises it (it is a `ValueError`, so callers that catch those keep working).
"""


class SpecDecodeError(ValueError):
    """Bad input or environment, explained in one line that names the setting or file."""


class OutOfKVBlocks(SpecDecodeError):
    """A paged KV cache's pool has no free block: the memory budget is spent for now."""
