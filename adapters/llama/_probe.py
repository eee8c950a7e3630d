"""The kernel probe on llama.cpp: does this CPU, this build, this model, KV type and thread
count give the same logits however kvrt cuts the work, with flash attention off and on,
and what does each cost?

For each configuration llama.cpp offers for the KV type (flash attention off and on for
a float cache, on alone for a quantized one), the probe computes a short seed once, and
fills probe contexts with copies of its KV bytes moved by the engine's own shift (no
computation: a context of thousands of cells costs milliseconds; where that shift is
unsafe, or the model keeps a recurrent state, the filler is computed), then:

- computes the same 72 tokens in one batch and in pieces (64 + 8 after 192 cells; 64 +
  8 and nine of 8 after 576): the largest difference from one batch. kvrt prefills in
  pieces of two tokens or more, so these decide whether a configuration is exact;
- computes 8 tokens in one batch and one at a time after 192 and after 576 cells
  (llama.cpp takes other paths for a lone token, and for attention over more than 512
  cells): reported, and what decides whether sequences may decode together;
- times a 32-token batch and four lone tokens after as many cells as the model's trained
  context (at most 4,096): where flash attention pays, and where it costs;
- decodes 1, 2, 4 and 8 sequences a token at a time, each alone and all in one call (a
  KV stream each): the largest difference and the step's cost.

The record is kept (:func:`kvrt.backend.save_probe`) and every later open reads it; on
SmolLM2 the probe takes a few seconds, on the zoo's tiny models milliseconds.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvrt import policy
from kvrt.backend import (
    EngineConfig,
    KernelProbe,
    KernelSetting,
    KernelTrial,
    KernelVerdict,
    SequenceStep,
    cpu_name,
    file_digest,
    kernel_key,
    load_probe,
    physical_cores,
    probe_lock,
    save_probe,
    settle_kernels,
)
from kvrt.native_bridge import BridgeError
from kvrt.native_bridge.llama import FLOAT_KV_TYPES, LlamaModel, build_info
from kvrt.native_bridge.llama_batch import LlamaSequences
from kvrt.native_bridge.llama_context import MAIN_SEQ, SCRATCH_SEQ, LlamaContext

from .._errors import translate_errors

__all__ = ["kernel_verdict", "measure"]

_log = logging.getLogger("kvrt")

TEXT = "The harbour master logs every ship that comes in at dawn, and the clerk copies it. "
SEED = 64
"""Tokens computed once per configuration; copies of their KV bytes fill the contexts."""
CUT = 72
"""Tokens of the cut trials. More than 64 matters: with flash attention on SmolLM2, 40
tokens in pieces of 8 and 32 equalled one batch where 72 in pieces of 8 and 64 did not."""
LONE = 8
SHALLOW = 192
DEEP = 576
"""Over 512 cells: llama.cpp's lone-token attention may take another path there."""
TIMED_MAX = 4096
TIMED_BATCH = 32
TIMED_STEPS = 4
SEQUENCES = (1, 2, 4, 8)
STEPS = 2
PROBE_BATCH = 128
"""The probe's contexts' batch: its trials cut the work themselves, whatever batch the
engine prefills in."""


def _forced(config: EngineConfig) -> tuple[bool | None, str]:
    """Flash attention as the configuration forces it (None: the kernel policy's
    choice), and what forces it."""
    if config.flash_attention != "auto":
        return config.flash_attention == "on", "as set"
    if config.kv_type not in FLOAT_KV_TYPES:
        return True, f"the only configuration for a {config.kv_type} cache"
    return None, ""


def _key(config: EngineConfig, path: str) -> str:
    from pathlib import Path

    return kernel_key(
        model=file_digest(Path(path)),
        kv_type=config.kv_type,
        threads=config.threads or physical_cores(),
        cpu=cpu_name(),
        build=build_info(),
    )


def cached_verdict(config: EngineConfig, path: str) -> KernelVerdict | None:
    """The verdict an engine on ``path`` opens with under ``config``, where the probe's
    record is kept already (None where it is not: the first open probes)."""
    probe = load_probe(_key(config, path))
    if probe is None:
        return None
    forced, why = _forced(config)
    return settle_kernels(probe, forced, why=why, policy=config.kernel_policy)


def kernel_verdict(
    model: LlamaModel, config: EngineConfig, path: str, *, copies: bool
) -> KernelVerdict:
    """The verdict of the kept record for this machine, or of a probe run now and kept
    (``copies``: the engine's own key shift is safe on this model, so the probe may fill
    its contexts with moved copies instead of computing them)."""
    policy.create("kernels", config.kernel_policy)  # an unknown name: refused before probing
    key = _key(config, path)
    probe = load_probe(key)
    if probe is None:
        with probe_lock(key):
            probe = load_probe(key) or _probe(model, config, key, copies=copies)
    forced, why = _forced(config)
    return settle_kernels(probe, forced, why=why, policy=config.kernel_policy)


def _probe(model: LlamaModel, config: EngineConfig, key: str, *, copies: bool) -> KernelProbe:
    threads = config.threads or physical_cores()
    flash = (False, True) if config.kv_type in FLOAT_KV_TYPES else (True,)
    _log.info("kvrt: probing llama.cpp's kernels on this machine (once): %s", model.path)
    if sys.stderr.isatty():  # a first run pauses here: say why
        print(
            "kvrt: measuring llama.cpp's kernels on this machine, once for this model "
            f"(KV {config.kv_type}, {threads} threads)...",
            file=sys.stderr,
            flush=True,
        )
    began = time.perf_counter()
    with translate_errors("probing the kernels"):
        settings = tuple(
            measure(
                model,
                kv_type=config.kv_type,
                threads=threads,
                flash=f,
                copies=copies,
            )
            for f in flash
        )
    probe = KernelProbe(
        key=key,
        cpu=cpu_name(),
        build=build_info(),
        threads=threads,
        kv_type=config.kv_type,
        settings=settings,
        seconds=round(time.perf_counter() - began, 3),
    )
    save_probe(probe)
    return probe


def _delta(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> float:
    return float(np.max(np.abs(a - b)))


class _Probe:
    """One configuration's probe context, filled from the seed's KV bytes."""

    def __init__(
        self, model: LlamaModel, ctx: LlamaContext, tokens: list[int], *, copies: bool
    ) -> None:
        self.model = model
        self.ctx = ctx
        self.tokens = tokens
        self.seed = tokens[:SEED]
        self.work = tokens[SEED:]
        self.copies = copies and ctx.can_shift
        ctx.decode(self.seed, 0)
        self.seed_bytes = ctx.state_get(MAIN_SEQ)

    def fill(self, cells: int) -> None:
        """The context emptied, then ``cells`` (a multiple of the seed) of filler."""
        ctx = self.ctx
        ctx.clear()
        if not self.copies:
            for at in range(0, cells, SEED):
                ctx.decode(self.seed, at)
            return
        ctx.state_set(MAIN_SEQ, self.seed_bytes)
        for at in range(SEED, cells, SEED):
            ctx.state_set(SCRATCH_SEQ, self.seed_bytes)
            ctx.seq_add(SCRATCH_SEQ, 0, SEED, at)
            ctx.seq_cp(SCRATCH_SEQ, MAIN_SEQ, at, at + SEED)
            ctx.seq_clear(SCRATCH_SEQ)

    def cut(self, cells: int, pieces: Sequence[int]) -> npt.NDArray[np.float32]:
        """The next-token logits after ``sum(pieces)`` work tokens computed in ``pieces``
        after ``cells`` of filler."""
        self.fill(cells)
        self._compute(cells, pieces)
        return self.ctx.logits()

    def timed(self, cells: int, pieces: Sequence[int]) -> float:
        """Seconds computing ``pieces`` after ``cells`` of filler (the fill not counted)."""
        self.fill(cells)
        began = time.perf_counter()
        self._compute(cells, pieces)
        return time.perf_counter() - began

    def _compute(self, cells: int, pieces: Sequence[int]) -> None:
        at = cells
        for n in pieces:
            self.ctx.decode(self.work[at - cells : at - cells + n], at)
            at += n


PIECES = ((SHALLOW, (64, CUT - 64)), (DEEP, (8,) * 9), (DEEP, (64, CUT - 64)))
"""Cuts kvrt makes (batches of two tokens or more: it never prefills one alone), each
against the same tokens in one batch."""


def _trials(p: _Probe) -> tuple[KernelTrial, ...]:
    one = {cells: p.cut(cells, [CUT]) for cells in (SHALLOW, DEEP)}
    out = [
        KernelTrial(
            name=f"{CUT} tokens in pieces of {'+'.join(map(str, sorted(set(cuts))))} "
            f"after {cells} cells",
            max_delta=_delta(p.cut(cells, cuts), one[cells]),
        )
        for cells, cuts in PIECES
    ]
    # Lone tokens: kvrt decodes one at a time as llama.cpp's own loop does, and compares
    # such tokens only with tokens decoded so; whether they equal a batch's rows says
    # whether sequences may be decoded together.
    for cells in (SHALLOW, DEEP):
        out.append(
            KernelTrial(
                name=f"{LONE} tokens one at a time after {cells} cells",
                max_delta=_delta(p.cut(cells, [1] * LONE), p.cut(cells, [LONE])),
                lone=True,
            )
        )
    return tuple(out)


def _speeds(p: _Probe, depth: int) -> tuple[float, float]:
    """Best of two: tokens a second for a batch, and one token at a time, after ``depth``."""
    batch = min(p.timed(depth, [TIMED_BATCH]) for _ in range(2))
    lone = min(p.timed(depth, [1] * TIMED_STEPS) for _ in range(2))
    return TIMED_BATCH / batch, TIMED_STEPS / lone


def _steps(
    model: LlamaModel, p: _Probe, *, kv_type: str, threads: int, flash: bool
) -> tuple[SequenceStep, ...]:
    most = max(SEQUENCES)
    seqs = LlamaSequences(
        model,
        n_seq=most,
        cells=SEED + STEPS + 1,
        n_threads=threads,
        kv_type=kv_type,
        flash_attn=flash,
    )
    try:
        seqs.decode(p.seed, [0] * SEED)
        seed = seqs.state_get(0)

        def reset(n: int) -> None:
            for s in range(n):
                seqs.clear(s)
                seqs.state_set(s, seed)

        def token(s: int, k: int) -> int:
            return p.work[(3 * s + k) % len(p.work)]

        def run(n: int, together: bool) -> tuple[list[npt.NDArray[np.float32]], float]:
            reset(n)
            rows: list[npt.NDArray[np.float32]] = []
            began = time.perf_counter()
            for k in range(STEPS):
                if together:
                    rows.extend(seqs.decode([token(s, k) for s in range(n)], list(range(n))))
                else:
                    for s in range(n):
                        rows.extend(seqs.decode([token(s, k)], [s]))
            return rows, (time.perf_counter() - began) / STEPS

        home = _at_home(model, seqs.window(0), [token(0, k) for k in range(STEPS)], threads, p)
        out = []
        for n in SEQUENCES:
            alone, serial = run(n, together=False)
            both, batched = run(n, together=True)
            delta = max(_delta(a, b) for a, b in zip(alone, both, strict=True))
            if n == 1:  # and the sequence against a context of its own
                delta = max(delta, *(_delta(a, b) for a, b in zip(alone, home, strict=True)))
            out.append(
                SequenceStep(
                    sequences=n,
                    serial_ms=round(serial * 1000, 3),
                    batched_ms=round(batched * 1000, 3),
                    max_delta=delta,
                )
            )
        return tuple(out)
    finally:
        seqs.close()


def _at_home(
    model: LlamaModel,
    seed: npt.NDArray[np.uint8],
    tokens: list[int],
    threads: int,
    p: _Probe,
) -> list[npt.NDArray[np.float32]]:
    """The logits of ``tokens`` decoded one at a time after ``seed`` (one stream's
    bytes) in a context of its own, as a session's window steps alone."""
    ctx = LlamaContext(
        model,
        n_ctx=SEED + STEPS + 1,
        n_batch=PROBE_BATCH,
        n_threads=threads,
        kv_type=p.ctx.kv_type,
        flash_attn=p.ctx.flash_attn,
    )
    try:
        ctx.state_set(MAIN_SEQ, seed)
        rows = []
        for k, t in enumerate(tokens):
            ctx.decode([t], SEED + k)
            rows.append(ctx.logits())
        return rows
    finally:
        ctx.close()


def measure(
    model: LlamaModel,
    *,
    kv_type: str,
    threads: int,
    flash: bool,
    copies: bool = False,
) -> KernelSetting:
    """What one configuration gives and costs on this machine (see the module)."""
    tokens = model.tokenize(TEXT * 64, add_special=False, parse_special=False)
    tokens = (tokens * (1 + (SEED + CUT + 8) // max(len(tokens), 1)))[: SEED + CUT + 8]
    # Copies move by the engine's own shift; where a cache cannot shift, or keeps a
    # recurrent state, the filler is computed instead, and speeds are timed after DEEP.
    copies = copies and not (model.is_recurrent or model.is_hybrid)
    depth = max(SEED, min(model.n_ctx_train or TIMED_MAX, TIMED_MAX) // SEED * SEED)
    depth = depth if copies else DEEP
    ctx = LlamaContext(
        model,
        n_ctx=max(DEEP, depth) + CUT + 16,
        n_batch=PROBE_BATCH,
        n_threads=threads,
        kv_type=kv_type,
        flash_attn=flash,
    )
    try:
        p = _Probe(model, ctx, tokens, copies=copies)
        trials = _trials(p)
        prefill, decode = _speeds(p, depth)
        try:
            steps = _steps(model, p, kv_type=kv_type, threads=threads, flash=flash)
        except BridgeError as exc:  # sequences decoding together are not offered here
            _log.info("kvrt: the kernel probe could not decode sequences together: %s", exc)
            steps = ()
    finally:
        ctx.close()
    return KernelSetting(
        flash_attention=flash,
        trials=trials,
        depth=depth,
        prefill_tps=round(prefill, 2),
        decode_tps=round(decode, 2),
        steps=steps,
    )
