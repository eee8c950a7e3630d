"""A model's chat template rendered as transformers renders it: Jinja in a sandbox.

kvrt renders a template itself where the engine's own rendering takes only roles and
contents (llama.cpp's built-in templates): to give the model its ``tools``, and to use a
template given in the configuration (``engine.chat_template``). The environment is
jinja2's immutable sandbox (no attribute writes, no unsafe calls) with what Hugging Face
chat templates expect: ``trim_blocks``/``lstrip_blocks``, loop controls, ``tojson``
(``ensure_ascii=False``, as transformers), ``raise_exception`` and ``strftime_now``.

Which tool-call format a template teaches its model is read from its source:
``<tool_call>`` JSON (Hermes, Qwen 2.5 and 3) or a bare ``{"name": ..., "parameters":
...}`` object (Llama 3.1 to 3.3); see :mod:`kvrt._chat.call_formats`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .._engine.contract import TemplateSource
from .._errors import ConfigError, EngineError, InvalidArgumentError

__all__ = ["CallStyle", "JinjaTemplate", "read_template_file"]

CallStyle = Literal["tagged", "json"]
"""How a template's model writes tool calls: ``tagged`` (``<tool_call>\\n{...}\\n
</tool_call>``) or ``json`` (the whole reply one ``{"name", "parameters"}`` object)."""

_MAX_TEMPLATE_BYTES = 1 << 20


def _tojson(
    value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return time.strftime(fmt)


class JinjaTemplate:
    """One chat template, compiled once.

    >>> t = JinjaTemplate(TemplateSource(text="{% for m in messages %}{{ m.content }}{% endfor %}"))
    >>> t.render([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    'hi'
    """

    def __init__(self, source: TemplateSource) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols"],
            undefined=jinja2.Undefined,
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        try:
            parsed = env.parse(source.text)
            self._template = env.from_string(source.text)
        except jinja2.TemplateError as exc:
            raise EngineError(f"the chat template does not compile: {exc}") from None
        self.knows_tools = "tools" in meta.find_undeclared_variables(parsed)
        """The template renders a ``tools`` list (it teaches the model its tools)."""
        self.call_style: CallStyle | None = _call_style(source.text) if self.knows_tools else None
        """The tool-call format the template teaches, when kvrt knows it."""

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The conversation as the model reads it."""
        context: dict[str, Any] = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.source.bos_token,
            "eos_token": self.source.eos_token,
        }
        if tools:
            context["tools"] = [dict(t) for t in tools]
        try:
            return str(self._template.render(**context))
        except jinja2.TemplateError as exc:
            raise InvalidArgumentError(
                f"the model's chat template refused these messages: {exc}"[:300]
            ) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise InvalidArgumentError(
                f"the model's chat template failed on these messages ({type(exc).__name__}: {exc})"[
                    :300
                ]
            ) from None


def _call_style(text: str) -> CallStyle | None:
    if "<tool_call>" in text:
        return "tagged"
    if '"parameters"' in text and ("ipython" in text or "<|python_tag|>" in text):
        return "json"
    return None


def read_template_file(path: str, *, bos_token: str, eos_token: str) -> TemplateSource:
    """A chat template from a file (``engine.chat_template``): its Jinja text, or the
    ``chat_template`` field of a ``tokenizer_config.json``."""
    file = Path(path)
    try:
        if not file.is_file():
            raise ConfigError(f"engine.chat_template: {path!r} is not a file")
        if file.stat().st_size > _MAX_TEMPLATE_BYTES:
            raise ConfigError(f"engine.chat_template: {path!r} is larger than 1 MiB")
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"engine.chat_template: cannot read {path!r}: {exc}") from None
    if file.suffix == ".json":
        try:
            found = json.loads(text).get("chat_template")
        except (ValueError, AttributeError):
            found = None
        if not isinstance(found, str):
            raise ConfigError(f"engine.chat_template: {path!r} has no 'chat_template' string")
        text = found
    return TemplateSource(text=text, bos_token=bos_token, eos_token=eos_token)
