"""The tiers below the cold store's RAM that a configuration names, opened: the disk tier
and the remote tier, each when it is on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from ._cold import ColdTier, DiskTier, RemoteTier, Signer, load_secret
from ._config import Config
from ._describe import ModelInfo
from ._engine.contract import ModelFacts
from ._errors import ConfigError

__all__ = ["max_block_bytes", "open_tiers"]


async def open_tiers(info: ModelInfo, cfg: Config, victim: Any) -> list[ColdTier]:
    """The disk and remote tiers ``cfg`` turns on, nearest first."""
    disk, remote = await open_disk(info, cfg, victim), open_remote(info, cfg)
    return [t for t in (disk, remote) if t is not None]


async def open_disk(info: ModelInfo, cfg: Config, victim: Any) -> DiskTier | None:
    """The disk tier the capacity names, opened (its index read from the files), or None
    when its budget is 0. A folder that cannot be used is a :class:`ConfigError`."""
    cap = info.capacity
    if not cap.disk_budget_bytes or cap.disk_path is None:
        return None
    disk = DiskTier(cap.disk_path, cap.disk_budget_bytes, info.model.fingerprint, victim.order)
    try:
        await anyio.to_thread.run_sync(disk.open)
    except OSError as exc:
        raise ConfigError(
            f"disk.path {cap.disk_path} cannot hold cold blocks: {exc.strerror or exc} "
            "(set disk.path, KVRT_DISK_PATH or --disk-path elsewhere, or disk.budget 0 to "
            "turn the disk tier off)"
        ) from None
    return disk


def open_remote(info: ModelInfo, cfg: Config) -> RemoteTier | None:
    """The remote tier ``remote.url`` names (no call is made until a session needs it),
    signing with the shared secret when one is given."""
    url = cfg.remote.url
    if not url:
        return None
    if not url.startswith(("redis://", "rediss://", "unix://", "valkey://", "valkeys://")):
        raise ConfigError(
            f"remote.url must be a redis://, rediss:// or unix:// address, got {url!r}"
        )
    url = url.replace("valkey", "redis", 1) if url.startswith("valkey") else url
    ca_file = cfg.remote.ca_file
    if ca_file is not None and not Path(ca_file).expanduser().is_file():
        raise ConfigError(f"remote.ca_file {ca_file} is not a readable file")
    signer = Signer(load_secret(cfg.remote.secret_file))
    try:
        return RemoteTier(
            url,
            timeout=cfg.remote.timeout,
            signer=signer,
            max_value_bytes=max_block_bytes(info.model, cfg.session.block_tokens)
            + signer.tag_bytes,
            ca_file=None if ca_file is None else str(Path(ca_file).expanduser()),
        )
    except ValueError as exc:
        raise ConfigError(f"invalid remote.url {url!r}: {exc}") from None


def max_block_bytes(facts: ModelFacts, block_tokens: int) -> int:
    """The most bytes a stored block of this model can take (its KV, a checkpoint of a
    recurrent state, the logits after it and its header), with room to spare: a larger
    value under a block's name is refused before it is read."""
    per_token = max(facts.kv_bytes_per_token, facts.cold_bytes_per_token or 0)
    exact = block_tokens * (per_token + 16) + facts.checkpoint_bytes + 4 * facts.n_vocab
    return 2 * exact + (1 << 20)
