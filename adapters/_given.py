"""What a window is given, checked before any engine call: token ids within the
vocabulary, integer positions, and cold blocks of its own model, layout and KV type whose
bytes are what their metadata says."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvrt import ColdBlockMismatchError, InvalidRangeError, InvalidTokenError
from kvrt.backend import ColdBlock, ModelFacts

__all__ = ["as_position", "check_block", "check_tokens"]


def as_position(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidRangeError(f"{name} must be an integer position, got {value!r}")
    return int(value)


def check_tokens(tokens: Sequence[int], n_vocab: int) -> None:
    for tok in tokens:
        if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
            raise InvalidTokenError(f"token ids must be integers, got {tok!r}")
        if not 0 <= tok < n_vocab:
            raise InvalidTokenError(f"token id {tok} is outside the vocabulary [0, {n_vocab})")


def check_block(block: ColdBlock, fingerprint: str, facts: ModelFacts) -> None:
    """A cold block a window of ``facts`` (whose blocks carry ``fingerprint``) can admit:
    its model and layout, its KV type, its bytes and tokens; else a
    :class:`ColdBlockMismatchError` (or :class:`InvalidTokenError`) saying what differs."""
    meta = block.meta
    if meta.fingerprint != fingerprint:
        raise ColdBlockMismatchError(
            f"cold block belongs to another model or KV layout "
            f"(block {meta.fingerprint[:12]}, context {fingerprint[:12]})"
        )
    if meta.kv_type != facts.kv_type:
        raise ColdBlockMismatchError(
            f"cold block holds {meta.kv_type} KV, this context uses {facts.kv_type}"
        )
    data = block.data
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
        raise ColdBlockMismatchError("cold block bytes must be a 1-D uint8 array")
    if data.size != meta.n_bytes or not meta.tokens:
        raise ColdBlockMismatchError(
            f"cold block holds {data.size} bytes for {len(meta.tokens)} tokens; "
            f"its metadata says {meta.n_bytes}"
        )
    if meta.start < 0:
        raise ColdBlockMismatchError(f"cold block starts at a negative position {meta.start}")
    check_tokens(meta.tokens, facts.n_vocab)
