"""The kernel probe on OpenVINO: does this CPU, this OpenVINO build, this IR, KV precision,
compile profile and thread count give the same logits however kvrt cuts the work, and
would sessions decoding together in one request keep each one's logits?

OpenVINO offers kvrt one configuration (the compile profile and KV precision are
settings, not choices), so the probe measures that one, and does not choose:

- computes a seed once and copies its state into fresh requests (the same bytes);
- computes the same 72 tokens after it in one batch and in pieces (64 + 8, nine of 8),
  and in an empty request (64 + 8), and 8 tokens one at a time against one batch of 8:
  the largest differences. Where cuts
  differ, kvrt's exact labels compare a context with the same work computed in the same
  pieces, never with one batch;
- decodes 1, 2, 4 and 8 sequences of other lengths a token at a time, each in a request
  of its own and all as rows of one request, padded (:class:`~kvrt.native_bridge.openvino.
  OvRows`): the largest difference and the step's cost. Sessions step together only
  where that is bit for bit.

The record is kept (:func:`kvrt.backend.save_probe`), keyed by everything it depends
on, and every later open reads it; on SmolLM2 the probe takes about a second.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvrt.backend import (
    EngineConfig,
    KernelProbe,
    KernelSetting,
    KernelTrial,
    KernelVerdict,
    SequenceStep,
    cpu_name,
    kernel_key,
    load_probe,
    physical_cores,
    probe_lock,
    save_probe,
)
from kvrt.native_bridge.openvino import OvModel, OvRequest, OvRows

from .._errors import translate_errors

__all__ = ["kernel_verdict", "settle", "stepping"]

_log = logging.getLogger("kvrt")

TEXT = "The harbour master logs every ship that comes in at dawn, and the clerk copies it. "
"""What the probe computes, repeated (the engine tokenizes it)."""
SEED = 192
"""Tokens computed once; fresh requests start from copies of their state."""
CUT = 72
LONE = 8
SEQUENCES = (1, 2, 4, 8)
STEPS = 2


def _build(model: OvModel, profile: str) -> str:
    import openvino as ov

    return f"OpenVINO {ov.get_version()}, {profile} profile, {model.inference_precision} inference"


def kernel_verdict(
    model: OvModel, config: EngineConfig, tokens: Sequence[int], *, model_key: str
) -> KernelVerdict:
    """The verdict of the kept record for this machine, or of a probe run now and kept
    (``tokens``: text to compute, at least ``SEED + CUT`` long; ``model_key``: what
    names the IR's weights)."""
    threads = config.threads or physical_cores()
    build = _build(model, config.openvino_profile)
    key = kernel_key(
        model=model_key,
        kv_type=config.kv_type,
        threads=threads,
        cpu=cpu_name(),
        build=build,
    )
    probe = load_probe(key)
    if probe is None:
        with probe_lock(key):
            probe = load_probe(key)
            if probe is None:
                _log.info("kvrt: probing OpenVINO's kernels on this machine (once): %s", model.path)
                began = time.perf_counter()
                with translate_errors("probing the kernels"):
                    setting = measure(model, tokens)
                probe = KernelProbe(
                    key=key,
                    cpu=cpu_name(),
                    build=build,
                    threads=threads,
                    kv_type=config.kv_type,
                    settings=(setting,),
                    seconds=round(time.perf_counter() - began, 3),
                )
                save_probe(probe)
    return settle(probe)


def settle(probe: KernelProbe) -> KernelVerdict:
    """What the record means for kvrt's labels (and, in ``batch_exact``, whether
    sessions generating at once could step together)."""
    s = probe.settings[0]
    if s.exact:
        cuts = "the same work cut otherwise gives one batch's logits, bit for bit"
    else:
        worst = max((t for t in s.trials if not t.lone), key=lambda t: t.max_delta)
        cuts = (
            f"the same work cut otherwise differs ({worst.name} differ by "
            f"{worst.max_delta:.3g} from one batch), so an exact label compares a context "
            "with the same work computed in the same pieces"
        )
    return KernelVerdict(
        flash_attention=False,
        exact=True,
        cut_invariant=s.exact,
        batch_exact=s.batch_exact,
        reason=f"{probe.build}: {cuts}",
        setting=s,
        probe=probe,
    )


def _delta(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> float:
    return float(np.max(np.abs(a - b)))


class _Seeded:
    """Fresh requests holding copies of one seed's state."""

    def __init__(self, model: OvModel, tokens: Sequence[int]) -> None:
        self.model = model
        self.work = list(tokens[SEED:])
        first = model.request()
        try:
            first.infer(tokens[:SEED], range(SEED))
            self.state = first.take(0, SEED)
        finally:
            first.close()

    def fresh(self, n: int = SEED) -> OvRequest:
        """A request holding the seed's first ``n`` entries."""
        req = self.model.request()
        req.insert(0, [self.state[:, :, :, :n]])
        return req

    def cut(
        self, pieces: Sequence[int], *, seeded: bool = True
    ) -> tuple[npt.NDArray[np.float32], float]:
        """The next-token logits after the work's first ``sum(pieces)`` tokens computed
        in ``pieces`` after the seed (or in an empty request), and the seconds it took."""
        req = self.fresh() if seeded else self.model.request()
        first = SEED if seeded else 0
        try:
            at = 0
            began = time.perf_counter()
            for n in pieces:
                logits = req.infer(self.work[at : at + n], range(first + at, first + at + n))
                at += n
            return logits, time.perf_counter() - began
        finally:
            req.close()


def _trials(p: _Seeded) -> tuple[tuple[KernelTrial, ...], float, float]:
    """The cuts against one batch, and the best batch and lone-token speeds seen."""
    one, batch_s = p.cut([CUT])
    out = []
    for pieces in ((64, CUT - 64), (8,) * (CUT // 8)):
        logits, _ = p.cut(pieces)
        sizes = "+".join(map(str, sorted(set(pieces))))
        out.append(
            KernelTrial(
                name=f"{CUT} tokens in pieces of {sizes} after {SEED} cells",
                max_delta=_delta(logits, one),
            )
        )
    # From an empty request: its first call takes another path than calls after it (on
    # SmolLM2 one batch against 64 + 8 differs there even where cuts after a seed agree).
    empty, _ = p.cut([CUT], seeded=False)
    logits, _ = p.cut((64, CUT - 64), seeded=False)
    out.append(
        KernelTrial(
            name=f"{CUT} tokens in pieces of 8+64 in an empty request",
            max_delta=_delta(logits, empty),
        )
    )
    lone, lone_s = p.cut([1] * LONE)
    batch, _ = p.cut([LONE])
    out.append(
        KernelTrial(
            name=f"{LONE} tokens one at a time after {SEED} cells",
            max_delta=_delta(lone, batch),
            lone=True,
        )
    )
    return tuple(out), CUT / batch_s, LONE / lone_s


def _steps(p: _Seeded) -> tuple[SequenceStep, ...]:
    def token(s: int, k: int) -> int:
        return p.work[(3 * s + k) % len(p.work)]

    out = []
    for n in SEQUENCES:
        # Rows of other lengths (a row padded on the left, as windows of other lengths
        # would be), each against its own request.
        held = [SEED - 8 * s for s in range(n)]
        requests = [p.fresh(h) for h in held]
        rows = OvRows(p.model)
        try:
            rows.load([req.take(0, req.length) for req in requests])
            alone: list[list[npt.NDArray[np.float32]]] = [[] for _ in range(n)]
            began = time.perf_counter()
            for k in range(STEPS):
                for s, req in enumerate(requests):
                    alone[s].append(req.infer([token(s, k)], [held[s] + k]))
            serial = (time.perf_counter() - began) / STEPS
            together = []
            began = time.perf_counter()
            for k in range(STEPS):
                together.append(rows.step([token(s, k) for s in range(n)], [h + k for h in held]))
            batched = (time.perf_counter() - began) / STEPS
        finally:
            rows.close()
            for req in requests:
                req.close()
        delta = max(_delta(alone[s][k], together[k][s]) for s in range(n) for k in range(STEPS))
        out.append(
            SequenceStep(
                sequences=n,
                serial_ms=round(serial * 1000, 3),
                batched_ms=round(batched * 1000, 3),
                max_delta=delta,
            )
        )
    return tuple(out)


def measure(model: OvModel, tokens: Sequence[int]) -> KernelSetting:
    """What OpenVINO's one configuration gives and costs on this machine (see the module)."""
    if len(tokens) < SEED + CUT:
        raise ValueError(f"the probe computes {SEED + CUT} tokens, got {len(tokens)}")
    p = _Seeded(model, tokens)
    trials, prefill, decode = _trials(p)
    return KernelSetting(
        flash_attention=False,
        name="OpenVINO's CPU plugin",
        trials=trials,
        depth=SEED,
        prefill_tps=round(prefill, 2),
        decode_tps=round(decode, 2),
        steps=_steps(p),
    )


def stepping(kernels: KernelVerdict, *, joins: bool) -> str:
    """How sessions on this engine step, and why, in words (``joins``: the engine
    offers steps beside others, see :mod:`._rows`)."""
    steps = kernels.setting.steps if kernels.setting is not None else ()
    if joins:
        return (
            "a reply's steps run beside other sessions' as rows of one request: bit-exact, "
            "as the kernel probe measured here"
        )
    if not steps:
        return "sessions step one at a time: the kernel probe did not decode rows together"
    if kernels.batch_exact:
        return (
            "sessions step one at a time: engine.together is 1, or the KV precision "
            "re-quantizes entries moved into a shared request"
        )
    worst = max(st.max_delta for st in steps)
    return (
        "sessions step one at a time: sequences decoded as rows of one request differ "
        f"from each alone (max |Δ| {worst:.3g}, measured by the kernel probe)"
    )
