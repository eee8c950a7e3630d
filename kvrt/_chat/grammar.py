"""Constrained decoding: a grammar the generated tokens must follow, enforced by a token
mask in kvrt's own sampler, so it works the same on every engine.

The grammar engine is llguidance (what llama.cpp and vLLM use; Rust, no torch). It was
chosen over xgrammar, which needs torch, transformers and triton to install. kvrt builds
llguidance's view of the vocabulary from the engine's own token bytes once per engine, and
each generation gets a matcher: before each token the sampler sees only the tokens the
grammar allows (the rest masked to ``-inf``), and the chosen token advances the matcher.
The model's end-of-generation token is allowed exactly when the grammar may end.

A :class:`Grammar` is checked when it is built: a JSON Schema keyword llguidance does not
implement, a regex that does not parse or a Lark rule that names nothing is a
:class:`kvrt.InvalidArgumentError` naming it, never a silent fallback to free text.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Literal

import llguidance
import msgspec
import numpy as np
import numpy.typing as npt

from .._engine.contract import Engine
from .._errors import ArgumentTypeError, InvalidArgumentError
from .schemas import bounded_numbers, closed_objects, number

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["JSON_SEPARATORS", "MAX_OPTIONAL_PROPERTIES", "Constraint", "ConstraintError", "Grammar"]

JSON_SEPARATORS = (", ", ": ")
"""How constrained JSON is written: ``json.dumps``'s own separators and no other
whitespace outside strings, so the text parses and streams predictably, and the same
object renders back to the same text."""

_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": JSON_SEPARATORS[0],
    "key_separator": JSON_SEPARATORS[1],
}

Kind = Literal["json_schema", "regex", "lark", "gbnf"]


class Grammar(msgspec.Struct, frozen=True, kw_only=True):
    """What generated text must match: a JSON Schema, a regular expression, or a Lark or
    GBNF grammar. Build one with the class methods; it is checked when built.

    >>> kvrt.Grammar.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}}})
    >>> kvrt.Grammar.regex(r"[0-9]{3}-[0-9]{4}")
    """

    kind: Kind
    """``json_schema``, ``regex``, ``lark`` or ``gbnf``."""
    source: str
    """The schema (as JSON text) or the grammar's text."""
    compiled: str = ""
    """llguidance's grammar (filled in when built)."""

    def __post_init__(self) -> None:
        if not isinstance(self.source, str):
            raise ArgumentTypeError(f"a {self.kind} grammar's source must be a str")
        msgspec.structs.force_setattr(self, "compiled", _compile(self.kind, self.source))

    @classmethod
    def json_schema(cls, schema: Any) -> Grammar:
        """JSON matching ``schema`` (a mapping, or its JSON text): ``$defs``/``$ref``,
        ``anyOf``, ``enum``, ``const``, nested objects and arrays, ``required``,
        ``additionalProperties`` and the rest llguidance implements. An object that
        declares ``properties`` and does not set ``additionalProperties`` holds only
        those (:func:`closed_objects`)."""
        if isinstance(schema, (str, bytes)):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidArgumentError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ArgumentTypeError(
                f"a JSON schema must be a mapping (an object), got {type(schema).__name__}"
            )
        try:
            text = json.dumps(closed_objects(bounded_numbers(schema)))
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"the JSON schema cannot be written as JSON: {exc}"
            ) from None
        return cls(kind="json_schema", source=text)

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's ``json_object`` response format)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text matching the regular expression ``pattern`` (Rust regex syntax)."""
        return cls(kind="regex", source=pattern)

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """Text of a Lark grammar (llguidance's dialect: ``start`` is the top rule,
        ``%json {...}`` embeds a JSON Schema)."""
        return cls(kind="lark", source=grammar)

    @classmethod
    def gbnf(cls, grammar: str) -> Grammar:
        """Text of a GBNF grammar (llama.cpp's format; ``root`` is the top rule)."""
        return cls(kind="gbnf", source=grammar)


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")

MAX_OPTIONAL_PROPERTIES = 498
"""The most optional properties one object of a JSON Schema may have. Any subset of them may
come next after each key, and the grammar engine follows at most 2,000 ways at once (its
``max_items_in_row``; an object of ``n`` optional keys takes ``4n + 7``, measured): past
this, decoding stops partway through the object. Refused when the grammar is built."""


_INT_RANGE = (-(10**17 - 1), 10**17 - 1)
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _too_wide(node: Any, path: str = "") -> str | None:
    """Where a JSON Schema asks for what decoding cannot honour, as a message: an object
    with more optional properties than decoding can follow, an integer bound of more than
    17 digits (the grammar engine clamps or refuses those); None
    where it asks for neither."""
    if isinstance(node, dict):
        kinds = node.get("type")
        integer = kinds == "integer" or (isinstance(kinds, list) and "integer" in kinds)
        for bound in _BOUNDS if integer else ():
            value = number(node.get(bound))
            if value is not None and not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
                return (
                    f"the JSON schema's {bound!r} at '{path or '/'}' is {value}: "
                    "constrained decoding honours integer bounds of up to 17 digits "
                    f"({_INT_RANGE[0]:,} to {_INT_RANGE[1]:,})"
                )
        props = node.get("properties")
        if isinstance(props, dict):
            required = node.get("required")
            needed = set(required) if isinstance(required, list) else set()
            optional = sum(1 for k in props if k not in needed)
            if optional > MAX_OPTIONAL_PROPERTIES:
                return (
                    f"the JSON schema's object at '{path or '/'}' has {optional} optional "
                    f"properties; constrained decoding follows at most "
                    f"{MAX_OPTIONAL_PROPERTIES} in one object (list the rest in 'required', "
                    "or split the object)"
                )
        for key, value in node.items():
            found = _too_wide(value, f"{path}/{key}")
            if found:
                return found
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found = _too_wide(value, f"{path}/{i}")
            if found:
                return found
    return None


_COMPILED: OrderedDict[tuple[str, str], str | InvalidArgumentError] = OrderedDict()
_COMPILED_BYTES = 0
_COMPILED_MAX_BYTES = 32 * 2**20
"""Compiled grammars kept, by their kind and source (their sources' bytes at most): a
schema sent again (every tool loop sends its tools each step) compiles once."""
_compiled_lock = threading.Lock()


def _compile(kind: Kind, source: str) -> str:
    """llguidance's grammar for ``source``, from the cache where it was compiled before
    (a refusal too: the same bad schema is refused without compiling it again)."""
    global _COMPILED_BYTES
    key = (kind, source)
    with _compiled_lock:
        found = _COMPILED.get(key)
        if found is not None:
            _COMPILED.move_to_end(key)
    if found is None:
        try:
            found = _compile_now(kind, source)
        except InvalidArgumentError as exc:
            found = exc
        with _compiled_lock:
            if key not in _COMPILED and len(source) <= _COMPILED_MAX_BYTES:
                _COMPILED[key] = found
                _COMPILED_BYTES += len(source)
                while _COMPILED_BYTES > _COMPILED_MAX_BYTES or len(_COMPILED) > 1024:
                    (_, old), _ = _COMPILED.popitem(last=False)
                    _COMPILED_BYTES -= len(old)
    if isinstance(found, InvalidArgumentError):
        raise InvalidArgumentError(str(found))
    return found


def _compile_now(kind: Kind, source: str) -> str:
    if kind == "json_schema":
        wide = _too_wide(json.loads(source))
        if wide:
            raise InvalidArgumentError(wide)
    try:
        if kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=_JSON_OPTIONS)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(source)
        elif kind == "lark":
            grammar = llguidance.LLMatcher.grammar_from_lark(source)
        elif kind == "gbnf":
            grammar = llguidance.grammar_from("gbnf", source)
        else:
            raise InvalidArgumentError(f"unknown grammar kind {kind!r}")
    except ValueError as exc:
        raise InvalidArgumentError(f"the {kind} grammar does not read: {exc}") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        message = messages[0].strip() if messages else "invalid"
        found = _UNIMPLEMENTED.search(message)
        if found:
            keys = found.group(1).replace('"', "")
            raise InvalidArgumentError(
                f"the JSON schema uses {keys}, which constrained decoding does not support"
            )
        raise InvalidArgumentError(f"the {kind} grammar is not valid: {message}"[:600])
    return grammar


class _Vocabulary:
    """llguidance's tokenizer for one engine: every token's bytes (markup tokens, which
    have none, are special), the end-of-generation tokens, and the engine's tokenizer."""

    def __init__(self, engine: Engine) -> None:
        n = engine.facts.n_vocab
        self.tokens = [engine.token_bytes(t) for t in range(n)]
        ends = [t for t in range(n) if engine.is_end_of_generation(t)]
        self.eos_token_id = ends[0] if ends else n - 1
        self.bos_token_id = None
        self.special_token_ids = [t for t, b in enumerate(self.tokens) if not b]
        self._engine = engine
        self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(self), eos_token=ends or None)
        self.n_vocab = n

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._engine.tokenize(text, add_special=False, parse_special=False)


_vocabularies: weakref.WeakKeyDictionary[Any, _Vocabulary] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _vocabulary(engine: Engine) -> _Vocabulary:
    with _lock:
        found = _vocabularies.get(engine)
        if found is None:
            found = _vocabularies[engine] = _Vocabulary(engine)
        return found


class ConstraintError(InvalidArgumentError):
    """Decoding under a grammar could not go on (the grammar engine hit a limit)."""


class Constraint:
    """One generation's matcher: the mask of allowed tokens, advanced token by token.
    Built in a worker thread (the first one per engine reads the whole vocabulary)."""

    def __init__(self, engine: Engine, grammar: Grammar) -> None:
        self._vocab = _vocabulary(engine)
        self._matcher = llguidance.LLMatcher(self._vocab.ll, grammar.compiled, log_level=0)
        if self._matcher.is_error():
            raise InvalidArgumentError(f"the grammar does not build: {self._matcher.get_error()}")
        self.allowed()  # the first mask: a grammar that admits nothing shows here
        if self._matcher.is_error() or (
            self._matcher.is_stopped() and not self._matcher.is_accepting()
        ):
            # A rule that only refers to itself, an empty character class: nothing can be
            # written, which a generation must not answer with an empty "success".
            raise InvalidArgumentError(
                f"the {grammar.kind} grammar accepts no text at all (a rule with no way to "
                "end, or an empty character class)"
            )

    def allowed(self) -> npt.NDArray[np.bool_]:
        """Which tokens may come next."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self._vocab.n_vocab].astype(bool)

    def mask(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """``logits`` with every token the grammar forbids at ``-inf``."""
        return np.where(self.allowed(), logits, np.float32(-np.inf)).astype(np.float32)

    def consume(self, token: int) -> None:
        """The sampler chose ``token`` (one the mask allowed)."""
        if not self._matcher.consume_token(token):
            # The engine's own message holds its parser state: not for a caller's eyes.
            raise ConstraintError(
                "constrained decoding stopped partway: the grammar branches more widely here "
                "than the grammar engine follows (simplify the schema)"
            )

    @property
    def done(self) -> bool:
        """The grammar admits nothing more: generation ends here."""
        return bool(self._matcher.is_stopped())

    @property
    def complete(self) -> bool:
        """What was generated matches the whole grammar (it may still go on)."""
        return bool(self._matcher.is_accepting())


def read_response_format(
    value: Any, *, param: str = "response_format"
) -> tuple[Grammar | None, dict[str, Any] | None]:
    """An OpenAI-style ``response_format`` (or a :class:`Grammar`): the grammar it asks
    for, and its JSON Schema when it is one (``None`` for plain text).

    ``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema",
    "json_schema": {"schema": {...}, ...}}`` (or, as the Responses API's ``text.format``
    writes it, ``{"type": "json_schema", "schema": {...}, ...}``); kvrt's extensions
    ``{"type": "regex", "regex": ...}`` and ``{"type": "grammar", "grammar": ...,
    "syntax": "lark" | "gbnf"}``. Errors name what is wrong under ``param``, as the caller
    calls it (``text.format.schema``), in the message and in their ``param``.
    """
    if value is None:
        return None, None
    if isinstance(value, Grammar):
        schema = json.loads(value.source) if value.kind == "json_schema" else None
        return value, schema
    if not isinstance(value, dict):
        raise ArgumentTypeError(
            f"{param} must be a mapping or a kvrt.Grammar, got {type(value).__name__}",
            param=param,
        )
    kind = value.get("type")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return Grammar.json_object(), {"type": "object"}
    if kind == "json_schema":
        flat = "json_schema" not in value and "schema" in value
        spec = value if flat else value.get("json_schema")
        at = f"{param}.schema" if flat else f"{param}.json_schema.schema"
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidArgumentError(f"{at} must be a JSON Schema object", param=at)
        try:
            return Grammar.json_schema(schema), schema
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{at}: {exc}", param=at) from None
    if kind == "regex":
        pattern = value.get("regex")
        if not isinstance(pattern, str):
            raise InvalidArgumentError(f"{param}.regex must be a string", param=f"{param}.regex")
        return Grammar.regex(pattern), None
    if kind == "grammar":
        text, syntax = value.get("grammar"), value.get("syntax", "lark")
        if not isinstance(text, str) or syntax not in ("lark", "gbnf"):
            raise InvalidArgumentError(
                f"{param}.grammar must be a string and syntax 'lark' or 'gbnf'",
                param=f"{param}.grammar",
            )
        return (Grammar.lark(text) if syntax == "lark" else Grammar.gbnf(text)), None
    raise InvalidArgumentError(
        f"{param}.type must be 'text', 'json_object', 'json_schema', 'regex' or "
        f"'grammar', got {kind!r}"[:200],
        param=f"{param}.type",
    )
