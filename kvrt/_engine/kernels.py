"""The kernel probe's record and verdict: which kernel configuration an engine runs here.

Whether a kernel gives the same logits however the work is cut into batches, and whether
it is faster, depends on the CPU, the engine's build, the model, the KV type and the
thread count. An adapter measures each configuration it could use once on a machine
(:class:`KernelProbe`); the record is kept under the cache folder's ``kernels/``, keyed
by all of those (:func:`kernel_key`), and every later open reads it. :func:`settle_kernels` turns
it into the :class:`KernelVerdict` an engine opens with: the configuration a setting
forces, or the one the kernel policy chooses; exact only where the probe found it so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec

from .._errors import ConfigError
from .._types import KernelSetting
from .._util import cache_home
from ..policy import create

__all__ = [
    "PROBE_VERSION",
    "KernelProbe",
    "KernelVerdict",
    "cpu_name",
    "kernel_key",
    "load_probe",
    "probe_lock",
    "save_probe",
    "settle_kernels",
]

PROBE_VERSION = 3
"""Part of every key: a probe that measures more or otherwise is a new record."""

_log = logging.getLogger("kvrt")


class KernelProbe(msgspec.Struct, frozen=True, kw_only=True):
    """What the kernel probe measured for one CPU, build, model, KV type and thread count."""

    key: str
    cpu: str
    build: str
    threads: int
    kv_type: str
    settings: tuple[KernelSetting, ...]
    """The configurations measured, the engine's default first."""
    seconds: float
    """What the probe cost, once on this machine."""


class KernelVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """The kernel configuration an engine runs with, and why."""

    flash_attention: bool
    exact: bool
    """kvrt's exact labels hold under these kernels. False: nothing the engine computes
    is labelled exact."""
    cut_invariant: bool = True
    """The probe found every cut of the same work bit-identical (llama.cpp: what
    ``exact`` requires, restores equal computing again). False where ``exact`` holds
    (OpenVINO): an exact label compares with the same work computed in the same pieces."""
    batch_exact: bool
    """Sequences decoded together give each one's logits decoded alone, bit for bit."""
    reason: str
    """In words, with the measured figures."""
    setting: KernelSetting | None
    """What the probe measured for it (None where nothing was probed)."""
    probe: KernelProbe | None = None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def kernel_key(**parts: object) -> str:
    """The record's key: a digest of everything the probe's results depend on."""
    text = json.dumps({"version": PROBE_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _path(key: str) -> Path:
    return cache_home() / "kernels" / f"{key}.json"


def load_probe(key: str) -> KernelProbe | None:
    """The record kept for ``key``, if any (an unreadable one counts as none)."""
    try:
        probe = msgspec.json.decode(_path(key).read_bytes(), type=KernelProbe)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        _log.warning(
            "kvrt: the kernel probe's record %s is unreadable (%s): probing again", key, exc
        )
        return None
    return probe if probe.key == key else None


@contextlib.contextmanager
def probe_lock(key: str) -> Iterator[None]:
    """Held while one process probes for ``key``: replicas opening at once on a fresh
    machine probe once, one after another (a probe timed beside another would time the
    contention), and the others read its record. Where the folder cannot be written, or
    the platform has no ``fcntl``, nothing is held."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        yield
        return
    path = _path(key).with_suffix(".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = path.open("a")
    except OSError:
        yield
        return
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def save_probe(probe: KernelProbe) -> None:
    """Keep ``probe`` for the next open (written whole, then renamed into place; a
    folder that cannot be written only costs the next open another probe)."""
    path = _path(probe.key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{os.getpid()}")
        part.write_bytes(msgspec.json.encode(probe))
        os.replace(part, path)
    except OSError as exc:
        _log.warning("kvrt: could not keep the kernel probe's record in %s: %s", path.parent, exc)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def _flaw(setting: KernelSetting) -> str:
    """The cut in pieces that differed most (what makes ``setting`` inexact)."""
    worst = max((t for t in setting.trials if not t.lone), key=lambda t: t.max_delta)
    return f"{worst.name} differ by {worst.max_delta:.3g}"


def _why(chosen: KernelSetting, others: Sequence[KernelSetting]) -> str:
    words = []
    for other in others:
        name = other.label
        if not other.exact:
            words.append(f"{name} is inexact ({_flaw(other)})")
        else:
            words.append(
                f"{name} is exact, at {other.depth:,} cells "
                f"{_ratio(other.prefill_tps, chosen.prefill_tps)} the prefill speed and "
                f"{_ratio(other.decode_tps, chosen.decode_tps)} the decode speed"
            )
    return "; ".join(words)


def settle_kernels(
    probe: KernelProbe,
    forced: bool | None,
    *,
    why: str = "as set",
    policy: str = "fastest_exact",
) -> KernelVerdict:
    """The verdict an engine opens with: flash attention as ``forced`` (``why``: what
    forced it), or where None as the kernel policy ``policy`` chooses among
    ``probe.settings``."""
    settings = probe.settings
    if not settings:
        raise ValueError("a kernel probe measures at least one configuration")
    if forced is not None:
        index = next((i for i, s in enumerate(settings) if s.flash_attention == forced), None)
        how = why
        if index is None:
            return KernelVerdict(
                flash_attention=forced,
                exact=False,
                cut_invariant=False,
                batch_exact=False,
                reason=f"flash attention {'on' if forced else 'off'} {why}, which the probe "
                "could not run here: labelled approximate",
                setting=None,
                probe=probe,
            )
    else:
        index = create("kernels", policy).choose(settings)
        how = f"chosen by the {policy} kernel policy"
        if index is None:
            how, index = "no configuration is exact here", 0
        elif not 0 <= index < len(settings):
            raise ConfigError(
                f"the kernels policy {policy!r} chose configuration {index} of {len(settings)}"
            )
    chosen = settings[index]
    others = [s for s in settings if s is not chosen]
    state = "exact" if chosen.exact else f"inexact ({_flaw(chosen)}): labelled approximate"
    reason = f"{chosen.label}, {state}; {how}"
    if others:
        reason += f" ({_why(chosen, others)})"
    return KernelVerdict(
        flash_attention=chosen.flash_attention,
        exact=chosen.exact,
        cut_invariant=chosen.exact,
        batch_exact=chosen.batch_exact,
        reason=reason,
        setting=chosen,
        probe=probe,
    )
