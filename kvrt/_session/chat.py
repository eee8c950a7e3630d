"""Chat messages to segments, in the model's own chat template.

One rendering of the whole conversation is cut into one segment per message: each holds
the template's markup before its content (the end of the message before it, its own
header) and then the content, read as plain text. The markup after the last message and
the assistant header make the reply's segment, which generation extends. Next turn the
reply comes back as an assistant message with the same markup in front of it, so its
segment starts with the same tokens and everything up to the new message is reused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from .._chat.call_formats import CallFormat
from .._chat.replies import ReplyMemory
from .._chat.templates import JinjaTemplate
from .._chat.tools import Tool, canonical_arguments, tools_prompt
from .._checks import check_choice, check_text
from .._engine.contract import Engine
from .._errors import ArgumentTypeError, EngineError, InvalidArgumentError
from .._paging.segments import Segment
from .._paging.tokens import ReplyTokens
from .._types import CacheClass

__all__ = ["ChatTemplate", "Conversation", "Message", "messages_of", "with_tools"]

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
ROLES |= {"tool": "tool", "function": "tool"}


def _stand_in(i: int) -> str:
    """A stand-in content (private-use characters) to find the template's markup."""
    return f"\ue000kvrt-content-{i}\ue001"


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """One chat message as kvrt places it (built from an OpenAI-style message)."""

    role: str
    """``system``, ``user``, ``assistant`` or ``tool`` (``developer`` is read as
    ``system``, ``function`` as ``tool``)."""
    content: str
    """The text (for an assistant message that called tools, often empty)."""
    tool_calls: tuple[tuple[str, str, str], ...] = ()
    """An assistant message's tool calls: ``(id, name, arguments JSON)``."""
    tool_call_id: str | None = None
    """A ``tool`` message's answer to this call id."""
    name: str | None = None
    """The segment's name; ``"{index}:{role}"`` when not given."""
    cache_class: CacheClass | None = None
    """The segment's class; ``task_pinned`` for system messages, else ``volatile``, when
    not given."""


class Conversation(msgspec.Struct, frozen=True, kw_only=True):
    """A conversation laid out as segments, and the segment the reply extends."""

    segments: tuple[Segment, ...]
    reply: str
    """The name of the reply's segment (the last one)."""


def messages_of(messages: Any, *, param: str = "messages") -> list[Message]:
    """OpenAI-style messages (mappings, or objects with ``role`` and ``content``) checked
    and read as :class:`Message` (what ``Session.chat`` does with them first): content may
    be a string, ``None`` or a list of text parts; the extension keys ``segment`` and
    ``cache_class`` name and class a message's segment. Raises
    :class:`kvrt.InvalidArgumentError` (or :class:`kvrt.ArgumentTypeError`) naming the
    first thing wrong, in its message and its ``param`` (``messages[2].content``;
    ``param`` names the list itself, as an API calls it: ``input``)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
        raise ArgumentTypeError(
            f"{param} must be a list of chat messages, got {type(messages).__name__}", param=param
        )
    out = [_message(f"{param}[{i}]", m) for i, m in enumerate(messages)]
    if not out:
        raise InvalidArgumentError(f"{param} is empty: give at least one message", param=param)
    return out


def _field(message: Any, key: str) -> Any:
    if isinstance(message, Mapping):
        return message.get(key)
    return getattr(message, key, None)


def _message(where: str, message: Any) -> Message:
    if isinstance(message, Message):
        return message
    if not isinstance(message, Mapping) and not hasattr(message, "role"):
        raise ArgumentTypeError(
            f"{where} must be a chat message (a mapping with 'role' and 'content'), got "
            f"{type(message).__name__}",
            param=f"{where}",
        )
    role = _field(message, "role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidArgumentError(
            f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}"[:300],
            param=f"{where}.role",
        )
    content = _content(where, _field(message, "content"))
    calls = (
        _tool_calls(where, _field(message, "tool_calls")) if _field(message, "tool_calls") else ()
    )
    answers = _field(message, "tool_call_id")
    if answers is not None:
        answers = check_text(f"{where}.tool_call_id", answers, empty=False)
    name = _field(message, "segment")
    if name is not None:
        name = check_text(f"{where}.segment", name, empty=False)
    cache_class = _field(message, "cache_class")
    if cache_class is not None:
        cache_class = check_choice(f"{where}.cache_class", cache_class, CacheClass)
    return Message(
        role=ROLES[role],
        content=content,
        tool_calls=calls,
        tool_call_id=answers,
        name=name,
        cache_class=cache_class,
    )


def _content(where: str, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return check_text(f"{where}.content", content)
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        texts = []
        for j, part in enumerate(content):
            kind = _field(part, "type")
            text = _field(part, "text")
            if kind not in ("text", "input_text", "output_text") or not isinstance(text, str):
                raise InvalidArgumentError(
                    f"{where}.content[{j}] must be a text part ({{'type': 'text', 'text': ...}}); "
                    f"this model reads text only, got type {kind!r}"[:300],
                    param=f"{where}.content[{j}]",
                )
            texts.append(check_text(f"{where}.content[{j}].text", text))
        return "".join(texts)
    raise ArgumentTypeError(
        f"{where}.content must be a string, a list of text parts or None, got "
        f"{type(content).__name__}",
        param=f"{where}.content",
    )


def _tool_calls(where: str, calls: Any) -> tuple[tuple[str, str, str], ...]:
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
        raise ArgumentTypeError(
            f"{where}.tool_calls must be a list of tool calls", param=f"{where}.tool_calls"
        )
    out = []
    for j, call in enumerate(calls):
        function = _field(call, "function")
        name = _field(function, "name") if function is not None else None
        arguments = _field(function, "arguments") if function is not None else None
        if not isinstance(name, str) or not isinstance(arguments, (str, type(None))):
            raise InvalidArgumentError(
                f"{where}.tool_calls[{j}] must have a function with a name and arguments",
                param=f"{where}.tool_calls[{j}]",
            )
        call_id = _field(call, "id")
        arguments = canonical_arguments(arguments or "")
        out.append((call_id if isinstance(call_id, str) else "", name, arguments))
    return tuple(out)


class ChatTemplate:
    """The model's chat template, split into markup and content.

    The engine renders it (roles and contents), unless a template was configured
    (``engine.chat_template``) or the conversation needs what only a full rendering gives
    (tools, tool results): then kvrt renders the Jinja source itself (:mod:`kvrt._chat.templates`).
    """

    def __init__(self, engine: Engine, configured: JinjaTemplate | None = None) -> None:
        self._engine = engine
        self._configured = configured
        self._adds_bos = bool(engine.tokenize("", add_special=True))
        self._own: JinjaTemplate | None = None
        self._own_read = False
        self._frames: dict[tuple[str, bool], tuple[str, str]] = {}

    @property
    def has_template(self) -> bool:
        """Whether the model has a chat template (a base model has none)."""
        return self._configured is not None or bool(self._engine.facts.chat_template)

    def tool_template(self) -> JinjaTemplate | None:
        """The template that shows the model its tools in a call format kvrt knows: the
        configured one, else the model's own; None when neither does (kvrt then uses
        its envelope, :mod:`kvrt._chat.tools`)."""
        template = self._configured or self._model_template()
        if template is None or not template.knows_tools or template.call_style is None:
            return None
        return template

    def _model_template(self) -> JinjaTemplate | None:
        if not self._own_read:
            self._own_read = True
            source = self._engine.chat_template_source()
            if source is not None:
                try:
                    self._own = JinjaTemplate(source)
                except EngineError:
                    self._own = None  # Jinja cannot compile it: the engine renders it
        return self._own

    def check_plain(self, what: str, text: str) -> None:
        """Refuse ``text`` (rendered as template markup, as a tool definition is) when it
        holds the text of a control token: markup is read with control tokens parsed, so
        it would become one."""
        tokenize = self._engine.tokenize
        if tokenize(text, add_special=False, parse_special=True) != tokenize(
            text, add_special=False, parse_special=False
        ):
            raise InvalidArgumentError(
                f"{what} holds the text of one of the model's control tokens, which the chat "
                "template would turn into markup"
            )

    # -- a whole conversation --

    def conversation(
        self,
        messages: Sequence[Message],
        *,
        template: JinjaTemplate | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        classify: Callable[[str], CacheClass] | None = None,
    ) -> Conversation:
        """The conversation as one segment per message, then the reply's segment;
        rendered by ``template`` with ``tools`` when given (else the configured template,
        else the engine). ``classify`` gives a message's class by its role where the
        message sets none (the session's ``message_class`` policy; by default system
        messages ``task_pinned``, the rest ``volatile``)."""
        jinja = template or self._configured
        if jinja is None:  # llama.cpp renders C strings: a NUL would end the content there
            for i, message in enumerate(messages):
                if "\0" in message.content:
                    raise InvalidArgumentError(
                        f"messages[{i}].content holds a NUL character, which the model's "
                        "chat template (llama.cpp's own) cannot render",
                        param=f"messages[{i}].content",
                    )

        def render(contents: Sequence[str]) -> str:
            if jinja is None:
                pairs = [(m.role, c) for m, c in zip(messages, contents, strict=True)]
                return self._engine.apply_chat_template(pairs)
            shown = [_shown(m, c) for m, c in zip(messages, contents, strict=True)]
            return self._jinja(jinja, shown, tools=tools)

        roles = [m.role for m in messages]
        framed = render([_stand_in(i) for i in range(len(messages))])
        frames: list[str] = []
        at = 0
        for i in range(len(roles)):
            found = framed.find(_stand_in(i), at)
            if found < 0:
                raise EngineError(
                    f"the model's chat template drops the content of a {roles[i]!r} message"
                )
            frames.append(framed[at:found])
            at = found + len(_stand_in(i))
        frames.append(framed[at:])
        contents = _rendered(
            frames, [m.content for m in messages], render([m.content for m in messages])
        )
        segments = []
        for i, (message, frame, content) in enumerate(
            zip(messages, frames, contents, strict=False)
        ):
            default = (classify or _system_pinned)(message.role)
            segments.append(
                Segment(
                    message.name or f"{i}:{message.role}",
                    frame + content,
                    cache_class=message.cache_class or default,
                    markup=((0, len(frame)),) if frame else (),
                )
            )
        reply = f"{len(messages)}:assistant"
        header = frames[-1]  # the last message's closing markup and the assistant header
        segments.append(Segment(reply, header, markup=((0, len(header)),) if header else ()))
        return Conversation(segments=tuple(segments), reply=reply)

    # -- one message --

    def message_segment(
        self,
        name: str,
        role: str,
        content: str,
        cache_class: CacheClass,
        generation_prompt: bool,
    ) -> Segment:
        """One message, framed by its own markup before and after its content."""
        head, tail = self._frame(role, generation_prompt)
        # The template may trim the content: take what it actually rendered between the frame.
        text = self._render(role, content, generation_prompt)
        if not (text.startswith(head) and text.endswith(tail)) or len(text) < len(head + tail):
            raise EngineError(
                f"the model's chat template renders a {role!r} message in a way kvrt cannot "
                "split into markup and content"
            )
        markup = [(0, len(head))] if head else []
        if tail:
            markup.append((len(text) - len(tail), len(text)))
        if len(markup) == 2 and markup[0][1] == markup[1][0]:
            markup = [(0, len(text))]
        return Segment(name, text, cache_class=cache_class, markup=tuple(markup))

    def _render(self, role: str, content: str, generation_prompt: bool) -> str:
        render = self._pairs
        text = render([(role, content)], add_generation_prompt=generation_prompt)
        if role != "system":
            # Some templates insert a default system prompt before a lone user message:
            # render after a stand-in system message and keep only this message's part.
            base = render([("system", "-")], add_generation_prompt=False)
            full = render(
                [("system", "-"), (role, content)], add_generation_prompt=generation_prompt
            )
            if full.startswith(base):
                text = full[len(base) :]
        return str(text)

    def _pairs(
        self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        if self._configured is None:
            return self._engine.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt
            )
        shown = [{"role": r, "content": c} for r, c in messages]
        return self._jinja(self._configured, shown, add_generation_prompt=add_generation_prompt)

    def _jinja(
        self,
        template: JinjaTemplate,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """``template``'s rendering, less a leading BOS text where the tokenizer adds the
        BOS token itself (else the context would open with two)."""
        text = template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        bos = template.source.bos_token
        if self._adds_bos and bos and text.startswith(bos):
            text = text[len(bos) :]
        return text

    def _frame(self, role: str, generation_prompt: bool) -> tuple[str, str]:
        """The template's markup before and after a message's content."""
        found = self._frames.get((role, generation_prompt))
        if found is None:
            text = self._render(role, _stand_in(0), generation_prompt)
            head, sep, tail = text.partition(_stand_in(0))
            if not sep:
                raise EngineError(
                    f"the model's chat template drops the content of a {role!r} message"
                )
            found = self._frames[(role, generation_prompt)] = (head, tail)
        return found


def _system_pinned(role: str) -> CacheClass:
    return CacheClass.TASK_PINNED if role == "system" else CacheClass.VOLATILE


def _shown(message: Message, content: str) -> dict[str, Any]:
    """A message as a Jinja template reads it."""
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _rendered(frames: Sequence[str], contents: Sequence[str], real: str) -> list[str]:
    """Each content as the template rendered it between its frames: as given, trimmed, or
    escaped as a JSON string (a template that writes a tool result with ``tojson``).
    Anything else cannot be split into markup and content: an error, never a guess (a
    guess could read content as markup)."""
    out: list[str] = []
    at = 0
    for i, content in enumerate(contents):
        if not real.startswith(frames[i], at):
            break
        at += len(frames[i])
        escaped = json.dumps(content, ensure_ascii=False)[1:-1]
        for shown in dict.fromkeys((content, content.strip(), escaped)):
            if real.startswith(shown, at) and real.startswith(frames[i + 1], at + len(shown)):
                out.append(shown)
                at += len(shown)
                break
        else:
            break
    if len(out) != len(contents) or at + len(frames[-1]) != len(real):
        raise EngineError(
            "the model's chat template renders these messages in a way kvrt cannot split "
            "into markup and content"
        )
    return out


def with_tools(
    messages: Sequence[Message],
    tools: Sequence[Tool],
    replies: ReplyMemory,
    calls: CallFormat,
) -> tuple[list[Message], dict[int, ReplyTokens]]:
    """``messages`` as the model sees them in a conversation with tools, whose calls are
    written in the format ``calls``: assistant messages as the text that was generated for
    them (remembered by their content or their calls' ids; else rendered as the format
    would have written them), so a tool loop reuses every earlier turn. A template that
    shows its tools reads tool results in its own way; otherwise (kvrt's envelope) the
    tools get a system section after the conversation's own system message and tool
    results come back in the user's turn, named by their tool. With the messages, the
    tokens each remembered reply was generated as, by its place among them (each
    generation its own, where two generated the same text)."""
    out: list[Message] = []
    generated: dict[int, ReplyTokens] = {}
    names: dict[str, str] = {}
    # A turn without tools (an agent handed off to, which has none) sees earlier calls
    # and answers as text: the envelope they were generated in would teach it to answer
    # in the envelope.
    plain = not tools and not calls.tools_in_template
    for i, message in enumerate(messages):
        # Segments keep the names the messages' own places and roles give them.
        message = msgspec.structs.replace(message, name=message.name or f"{i}:{message.role}")
        if message.role == "assistant":
            found = None if plain else _remembered(message, replies)
            if found is not None:
                generated[len(out)] = found
                content = found[0]
            elif plain:
                content = _plain_text(message)
            else:
                content = calls.render(
                    message.content, [(name, args) for _, name, args in message.tool_calls]
                )
            for call_id, name, _ in message.tool_calls:
                names[call_id] = name
            message = msgspec.structs.replace(message, content=content, tool_calls=())
        elif message.role == "tool" and not calls.tools_in_template:
            # A template that knows no tools knows no tool role: the result comes back in
            # the user's turn, named by its tool (measured: SmolLM2 then answers with it,
            # where after a "tool" turn it called the tool again and again).
            tool = names.get(message.tool_call_id or "")
            head = f"Result of {tool}" if tool else "Tool result"
            message = msgspec.structs.replace(
                message, role="user", content=f"{head}: {message.content}"
            )
        out.append(message)
    # The section does not depend on tool_choice (the grammar enforces it), so a step of
    # tool_choice "none" reuses the context of the steps that called tools.
    if tools and not calls.tools_in_template:
        section = Message(
            role="system",
            content=tools_prompt(tools),
            name="tools",
            cache_class=CacheClass.TASK_PINNED,
        )
        at = 1 if out and out[0].role == "system" else 0
        out.insert(at, section)
        generated = {i + (i >= at): found for i, found in generated.items()}
    return out, generated


def _plain_text(message: Message) -> str:
    """An assistant message as text: its content, then its calls, one a line."""
    lines = [message.content] if message.content else []
    lines += [
        f"(called {name} with {arguments or '{}'})" for _, name, arguments in message.tool_calls
    ]
    return "\n".join(lines)


def _remembered(message: Message, replies: ReplyMemory) -> ReplyTokens | None:
    """The reply this runtime generated that the caller sent back as ``message``: found
    by its calls' ids, names and arguments (one sent back edited is rendered as the
    caller sent it, never placed with what was generated), or by its content."""
    calls_sent = message.tool_calls
    if calls_sent and all(call_id for call_id, _, _ in calls_sent):
        return replies.generated(calls=calls_sent)
    if not calls_sent and message.content:
        return replies.generated(content=message.content)
    return None
