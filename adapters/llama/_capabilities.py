"""What a llama.cpp window promises (:class:`Capabilities`): which moves it can make,
which of its results are exact, and why, in words a caller (``kvrt describe``, a
session's report) can show. It follows from the model's facts and the window's kind."""

from __future__ import annotations

from kvrt.backend import Capabilities, ModelFacts

__all__ = ["window_capabilities"]


def window_capabilities(
    facts: ModelFacts, *, can_shift: bool, turned_here: bool, keys_read: bool, together: bool
) -> Capabilities:
    """A window of ``facts``' model: ``can_shift`` (a range can come back at other
    positions), ``turned_here`` (kvrt turns the keys of a moved range, not llama.cpp),
    ``keys_read`` (relevance reads its keys), ``together`` (its steps run beside other
    windows')."""
    recurrent = bool(facts.checkpoint_bytes)
    state_only = facts.recurrent == "recurrent"
    notes = ["tail admission re-rotates keys (each layer by its own RoPE base): not bit-exact"]
    if turned_here:
        notes.append(
            "keys are turned by kvrt when a range moves: llama.cpp's own shift would "
            "scale YaRN or LongRoPE keys again, or crash on these quantized keys"
        )
    elif facts.key_shift == "none":
        notes.append("ranges come back at their own positions only: no key shift fits")
    if not keys_read:
        notes.append(
            "key relevance cannot read this model's keys (sliding-window caches or a "
            "multi-axis RoPE): a relevance policy scores its tokens instead"
        )
    if facts.sliding_window_live:
        notes.append(
            "windowed layers keep every position, so in-place restores inside and beyond "
            "the sliding window are bit-exact"
        )
    if recurrent:
        notes = [
            "recurrent layers: their state has seen every token computed, in order; it "
            "is checkpointed after each block and each prefill, and removing the tail "
            "computes again from the nearest checkpoint before it",
            "ranges come back at their own positions only (a recurrent state cannot move)",
        ]
        if state_only:
            notes.append(
                "no attention KV: only the window's tail can leave it, and a block comes "
                "back only as the window's end, with the checkpoint after it"
            )
    kernels = facts.kernels
    if kernels is not None and not kernels.exact:
        notes.insert(0, f"kernels: {kernels.reason}")
    if together:
        notes.append(
            "a reply's steps run beside other sessions' in one engine call, each window "
            "in a KV stream of its own: bit-exact, as the kernel probe measured here"
        )
    return Capabilities(
        remove_middle=not state_only,
        position_shift=can_shift,
        exact_in_place=facts.exact_in_place,
        exact_compute=kernels is None or kernels.exact,
        exact_tail=False,
        sliding_window=facts.sliding_window_live,
        kv_type=facts.kv_type,
        notes=tuple(notes),
        recurrent=recurrent,
    )
