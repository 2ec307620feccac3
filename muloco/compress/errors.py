"""The one error type of muloco.compress (a ValueError, so callers that catch bad input catch it too)."""


class CompressionError(ValueError):
    """A payload that cannot be decoded (malformed, corrupted, from another version), or a tensor that cannot
    be encoded (NaN/Inf, too large, not floating point). The message says which and what to check."""
