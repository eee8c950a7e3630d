"""After which blocks a model with recurrent layers keeps its recurrent state.

A hybrid's recurrent state has integrated every token before it; a checkpoint of it after a
block lets that block end a restored context (in any session, any tier, after a restart)
and lets the context go back there without computing from an earlier one. It costs the
checkpoint's bytes in the block's cold entry.
"""

from __future__ import annotations

from kvrt.policy import CheckpointView, register

from .write_through import STABLE

__all__ = ["EveryBlock", "KvSized"]


@register("checkpoint", "every_block")
class EveryBlock:
    """After every block: every block can end a restored context."""

    def keep(self, block: CheckpointView) -> bool:
        return True


@register("checkpoint", "kv_sized")
class KvSized:
    """After a block whose KV bytes are at least the checkpoint's (the checkpoint at most
    doubles its cold bytes), and after the stable classes (system prompts, repo maps),
    which other sessions send again: on a model with a large recurrent state, small
    blocks of volatile turns do without."""

    def keep(self, block: CheckpointView) -> bool:
        return block.cache_class in STABLE or block.kv_bytes >= block.checkpoint_bytes
