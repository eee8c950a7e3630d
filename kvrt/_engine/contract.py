"""The engine backend protocol kvrt's runtime drives, and the values that cross it.

Published for adapter authors as :mod:`kvrt.backend`, which documents the contract.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import msgspec
import numpy as np
import numpy.typing as npt

from .._checks import check_int, check_number
from .._config import EngineConfig
from .._errors import InvalidArgumentError
from .facts import ModelFacts

__all__ = [
    "AdmitMode",
    "Capabilities",
    "Checkpoint",
    "ColdBlock",
    "ColdBlockMeta",
    "Counters",
    "Engine",
    "EngineContext",
    "EvictMode",
    "KeySketching",
    "ModelFacts",
    "Recompute",
    "SamplingParams",
    "StepsTogether",
]

Logits = npt.NDArray[np.float32]
Checkpoint = Callable[[], None]
"""Called between chunks of long engine work; raising from it stops the work cleanly."""


class EvictMode(enum.StrEnum):
    GAP = "gap"
    """Remove the range; every other token keeps its position."""
    SLIDE = "slide"
    """Remove the range and shift the tail down to close the hole."""


class AdmitMode(enum.StrEnum):
    IN_PLACE = "in_place"
    """Back at the block's original positions (bit-exact)."""
    TAIL = "tail"
    """After the last resident token, keys re-rotated by the position delta."""


class TemplateSource(msgspec.Struct, frozen=True, kw_only=True):
    """A model's chat template as its Jinja source, with the token texts it names."""

    text: str
    """The Jinja source (as transformers and ``llama-server --jinja`` render it)."""
    bos_token: str = ""
    """The text of the beginning-of-sequence token (``bos_token`` in the template)."""
    eos_token: str = ""
    """The text of the end-of-sequence token (``eos_token`` in the template)."""


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine context can do with its KV cache, stated honestly."""

    remove_middle: bool
    """A range can leave the middle of the window with every other position kept (gap eviction)."""
    position_shift: bool
    """Positions can be shifted (slide eviction, tail admission with re-rotated keys)."""
    exact_in_place: bool
    """An in-place admit gives logits bit-identical to never evicting."""
    exact_compute: bool = True
    """The engine's kernels give the same logits however the work is cut into batches
    (the kernel probe's verdict): false, and nothing it computes is labelled exact."""
    exact_tail: bool
    """A tail admit after a shift is bit-identical (false where keys are re-rotated)."""
    sliding_window: int | None
    """The sliding window of windowed layers, if the model has any."""
    kv_type: str
    """The KV cache precision restores work at."""
    notes: tuple[str, ...] = ()
    """What else to know, in words."""
    recurrent: bool = False
    """The model has recurrent layers: removing the window's tail puts the recurrent
    state back to the nearest checkpoint before it and computes the tokens from there
    again."""


class Counters(msgspec.Struct, kw_only=True):
    """Cumulative work done by one engine context."""

    prefill_tokens: int = 0
    """Tokens the engine computed KV for from scratch (prompt processing)."""
    decode_tokens: int = 0
    """Tokens generated and fed back one at a time."""
    evicted_tokens: int = 0
    """Tokens removed from the window."""
    exported_tokens: int = 0
    """Tokens whose KV was exported as cold bytes."""
    exported_bytes: int = 0
    """Bytes exported."""
    admitted_tokens: int = 0
    """Tokens whose KV came back from cold bytes."""
    admitted_bytes: int = 0
    """Bytes admitted."""
    relayouts: int = 0
    """Times the engine's cells were laid out again in position order before computing
    on a whole context (llama.cpp), so the result equals a fresh context's."""
    relayout_tokens: int = 0
    """Tokens those relayouts moved."""


MAX_LOGIT_BIAS = 1024
"""The most tokens one request may bias."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Token choice; ``temperature == 0`` is greedy (argmax).

    Checked when built: ``SamplingParams(top_p=2)`` raises :class:`kvrt.InvalidArgumentError`
    at once, never later inside a session.
    """

    temperature: float = 0.0
    """0 or more; 0 is greedy."""
    top_k: int = 0
    """0 keeps every token; at most 2**31 - 1."""
    top_p: float = 1.0
    """In (0, 1]: keep the smallest set of likeliest tokens whose mass reaches it."""
    seed: int | None = None
    """0 to 2**63 - 1 (a signed 64-bit integer, as OpenAI's); None draws from fresh
    entropy."""
    logit_bias: dict[int, float] | None = None
    """Token id -> a bias from -100 to 100 added to its logit before the token is chosen
    (OpenAI's ``logit_bias``: -100 in effect bans a token, 100 all but forces it); at most
    1,024 tokens. Reported log-probabilities are the model's, before the bias."""

    def __post_init__(self) -> None:
        check_number("sampling.temperature", self.temperature, low=0.0)
        check_int("sampling.top_k", self.top_k, low=0, high=2**31 - 1)
        check_number("sampling.top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if self.seed is not None:
            check_int("sampling.seed", self.seed, low=0, high=2**63 - 1)
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidArgumentError(
                    f"sampling.logit_bias holds at most {MAX_LOGIT_BIAS:,} tokens, "
                    f"got {len(self.logit_bias):,}",
                    param="sampling.logit_bias",
                )
            for token, bias in self.logit_bias.items():
                check_int("a sampling.logit_bias token id", token, low=0, high=2**31 - 1)
                check_number(f"sampling.logit_bias[{token}]", bias, low=-100.0, high=100.0)


class Recompute(NamedTuple):
    """What removing the window's tail does on an engine with recurrent layers: the
    state goes back to a checkpoint and the resident tokens in [first, end) are computed
    again from it. Tokens are removed from ``removed_from`` on: the range's start, or an
    earlier position where resident tokens follow a gap before the range, which cannot
    be computed again (the recurrent state would skip the gap's tokens)."""

    first: int
    end: int
    removed_from: int


class ColdBlockMeta(msgspec.Struct, frozen=True, kw_only=True):
    """Everything needed to check cold KV bytes before they go back into an engine."""

    fingerprint: str
    """Model digest plus KV layout: bytes only fit an engine with the same one."""
    kv_type: str
    """The KV precision of the bytes."""
    start: int
    """Position of the first token when the block was exported."""
    tokens: tuple[int, ...]
    """The block's tokens."""
    n_bytes: int
    """Size of the KV bytes."""
    resumable: bool = True
    """The bytes hold all the engine needs to go on after the block's last token. False
    for a block of a model with recurrent layers exported without the checkpoint taken
    after its last token: it comes back only before resident tokens, never as the end of
    a context."""

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True, slots=True)
class ColdBlock:
    """Immutable KV bytes of a token range, with their metadata."""

    meta: ColdBlockMeta
    """What the bytes are: checked before they go back into an engine."""
    data: npt.NDArray[np.uint8]
    """The KV bytes, as the engine exported them."""


class EngineContext(Protocol):
    """One KV window of one model, driven synchronously by one owner at a time."""

    @property
    def n_ctx(self) -> int:
        """How many tokens the window holds at most (its KV cells)."""

    @property
    def positions(self) -> Sequence[int]:
        """The position of each resident token, increasing (gaps where a range was
        gap-evicted)."""
        ...

    @property
    def tokens(self) -> Sequence[int]:
        """The resident tokens, in position order (one per entry of :attr:`positions`)."""

    @property
    def next_position(self) -> int:
        """The position the next prefilled or decoded token gets: one past the last
        resident token (0 when empty)."""
        ...

    @property
    def logits_position(self) -> int | None:
        """The position whose following-token logits :meth:`logits` returns, or None when
        the window holds none (nothing computed yet, or the last token was evicted)."""
        ...

    @property
    def n_resident(self) -> int:
        """How many tokens are resident (``len(tokens)``)."""

    @property
    def counters(self) -> Counters:
        """What this context has done so far (tokens prefilled, decoded, evicted,
        exported, admitted; relayouts), for reports."""
        ...

    @property
    def capabilities(self) -> Capabilities:
        """What this context can do and what is exact (gap eviction, key shifts, exact
        in-place and tail restores, its KV type): kvrt plans by it and reports it."""
        ...

    @property
    def facts(self) -> ModelFacts:
        """What the engine knows of the model this context runs."""
        ...

    @property
    def fingerprint(self) -> str:
        """The identity of the KV this context computes (what its cold blocks carry and
        what a block must carry to come back): the model's fingerprint, plus any setting
        of this context that changes what the engine computes for a token at a position."""
        ...

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        start: int | None = None,
        checkpoint: Checkpoint | None = None,
        keep_state_at: Sequence[int] = (),
    ) -> Logits:
        """``keep_state_at``: positions (block ends) after which an engine with recurrent
        layers keeps a checkpoint of the recurrent state, so blocks ending there export
        whole and the context can go back there; others ignore it."""
        ...

    def step(self, token: int) -> Logits:
        """Decode one token at :attr:`next_position` (a batch of one, as generation
        computes it) and return the logits after it."""
        ...

    def logits(self) -> Logits:
        """The logits after the token at :attr:`logits_position`, again, computing
        nothing; an :class:`~kvrt.EngineError` when there are none."""
        ...

    def evict(self, start: int, end: int, mode: EvictMode = EvictMode.GAP) -> int:
        """Remove the resident tokens at positions ``[start, end)`` and return how many
        left. ``GAP`` leaves every other token at its position (bit-exact);
        ``SLIDE`` moves the tokens after ``end`` down by the range's length, turning
        their keys (not exact)."""
        ...

    def recomputed_by_evict(self, start: int, end: int) -> Recompute | None:
        """What a gap eviction of [start, end) computes again (an engine with recurrent
        layers, removing the window's tail), and from where it removes tokens; None
        where it only removes the range."""
        ...

    def export(self, start: int, end: int) -> ColdBlock:
        """The KV bytes of the resident range ``[start, end)`` as an immutable
        :class:`ColdBlock`, with the metadata that checks them later; the window is
        unchanged."""
        ...

    def export_run(self, ranges: Sequence[tuple[int, int]]) -> list[ColdBlock]:
        """:meth:`export` of several ranges in one call (one state read where the engine
        allows), in the order given."""
        ...

    def admit(
        self, block: ColdBlock, mode: AdmitMode = AdmitMode.IN_PLACE, *, skip: int = 0
    ) -> int:
        """Put ``block`` back and return the position its first token got: ``IN_PLACE`` at
        its own positions (bit-exact; they must be free), ``TAIL`` after the last
        resident token with its keys turned; ``skip=m`` (``TAIL`` only) leaves out its
        first ``m`` tokens, which must be the last resident ones, just computed afresh.
        Whole or not at all: bytes of another model,
        layout or position raise :class:`~kvrt.ColdBlockMismatchError` before native
        code sees them."""
        ...

    def admit_run(self, blocks: Sequence[ColdBlock]) -> None:
        """:meth:`admit` in place of adjacent blocks in one call, whole or not at all."""
        ...

    def clear(self) -> None:
        """Remove every token: the window is empty and usable."""

    def close(self) -> None:
        """Free the window's native memory; no call may follow (twice is a no-op)."""
        ...


@runtime_checkable
class KeySketching(Protocol):
    """Optional for a context: sketches of its keys, for relevance scoring by key vectors.

    A sketch is an object the ``relevance`` policy understands: a block's is a
    :class:`~kvrt.backend.KeySketch` (or an array of its vectors), a query's
    ``float32[layer, kv_head, token, head_dim]``, keys rotated back to position 0. Any method may return None where the engine cannot say; scoring then falls back to
    the policy's lexical score.
    """

    def key_sketches(self, ranges: Sequence[tuple[int, int]]) -> list[object | None]:
        """One sketch per resident range ``[start, end)``; the window is unchanged."""
        ...

    def cold_key_sketch(self, block: ColdBlock) -> object | None:
        """The sketch of a cold block's bytes."""
        ...

    def query_sketch(self, tokens: Sequence[int]) -> object | None:
        """Every key of ``tokens`` computed on their own (not attending to the window)."""
        ...


class Engine(Protocol):
    """One loaded model, shared by every context opened on it."""

    config: EngineConfig
    """The settings it was opened with."""

    @property
    def facts(self) -> ModelFacts:
        """What the engine knows of the model: architecture, layers, KV layout and
        bytes, fingerprint."""
        ...

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        """Token ids of ``text``: ``add_special`` adds the model's begin-of-text token;
        ``parse_special`` reads control tokens' text as those tokens (markup kvrt wrote),
        else as plain characters (what a user sent)."""
        ...

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``."""

    def token_bytes(self, token: int) -> bytes:
        """One token's bytes (a character may span tokens: kvrt decodes streams from
        these)."""
        ...

    def is_end_of_generation(self, token: int) -> bool:
        """Whether ``token`` ends a reply (end of text, end of turn)."""

    def apply_chat_template(
        self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """``messages`` (role, content) rendered with the model's own chat template, by
        the engine (kvrt renders tool-aware templates itself)."""
        ...

    def chat_template_source(self) -> TemplateSource | None:
        """The chat template's Jinja source (None for a base model), which kvrt renders
        itself where the engine's own rendering cannot (tools, tool calls)."""
        ...

    def open_context(self, n_ctx: int) -> EngineContext:
        """A new, empty window of ``n_ctx`` tokens on this model, for one owner."""

    def close(self) -> None:
        """Free the model; contexts opened on it must be closed first."""
        ...


@runtime_checkable
class StepsTogether(Protocol):
    """Optional for an engine: several sessions' windows advance a token each in one
    engine call, each getting the logits it would get alone (offered only where that
    holds, as measured on this machine)."""

    @property
    def streams(self) -> int:
        """Windows that may step in one call."""
        ...

    def joins(self, ctx: EngineContext) -> bool:
        """Whether ``ctx``'s steps may run beside other windows'."""
        ...

    def away(self, ctx: EngineContext) -> bool:
        """Whether ``ctx``'s window is where windows step together (not in its own
        context)."""
        ...

    def settle(self, ctx: EngineContext) -> None:
        """Bring ``ctx``'s window back into its own context (a reply ended), freeing its
        place for other windows; a no-op where it is home."""
        ...

    def stream_bytes_at(self, window_tokens: int) -> int:
        """The most memory the engine holds for windows of up to ``window_tokens`` tokens
        stepping together, beside their own contexts (0 where it holds none)."""
        ...

    @property
    def gather_seconds(self) -> float | None:
        """How long the runtime waits for a joint step's sessions to come back before
        the next step runs without them (None: its default, a few milliseconds)."""
        ...

    def step_together(self, steps: Sequence[tuple[EngineContext, int]]) -> list[Logits | Exception]:
        """Advance each ``(context, token)``; each one's next logits, or the error its
        step raised (a step refused leaves its window as it was)."""
        ...
