"""Chat messages for the command line's jobs, on models with and without a chat template."""

from __future__ import annotations

from kvrt import CacheClass, Runtime, Segment

__all__ = ["message"]


def message(
    rt: Runtime,
    name: str,
    role: str,
    text: str,
    *,
    cache_class: CacheClass = CacheClass.VOLATILE,
    generation_prompt: bool = False,
) -> Segment:
    """One message in the model's chat template, or its plain text where the model has no
    template (a base model such as Gemma 3 270M)."""
    if not rt.model_info.model.chat_template:
        return Segment(name, text, cache_class=cache_class)
    return rt.chat_segment(
        name, role, text, cache_class=cache_class, generation_prompt=generation_prompt
    )
