"""A shared store trusts nothing it reads: on a real ``redis-server``, a block re-encoded
with another prompt's KV, moved under another name or planted without the replicas'
secret is a miss (the answer equals a fresh computation, the forgery is counted and
deleted); bytes the engine rejects cost a recompute, never a failed call; a value larger
than any block is refused before it is fetched. The engine is llama.cpp running the zoo's
tiny llama: what is checked is the bytes' path, not the model's text."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import msgspec
import numpy as np
import pytest
import redis

import kvrt
import kvrt.serve
from kvrt import Segment, policies
from kvrt._cold import ColdStore, RemoteTier, Signer, blockfile
from kvrt._cold.trust import TAG_BYTES
from tests.support.disk_writer import SIZE, block, serving
from tests.support.models import next_logits, tiny
from tests.support.redis import RedisServer, start_redis
from tests.support.tiers import settled

SECRET = "correct horse battery staple, twice over"
ROOT = "http://kvrt.in-process"
X = [Segment("doc", "The vault code is 4417. " * 30), Segment("q", "What is the vault code?")]
Y = [Segment("doc", "The garden gate is painted green. " * 20), Segment("q", "What colour?")]


@pytest.fixture
def engine() -> kvrt.backend.Engine:
    """This module's engine, in place of the suite's SmolLM2: the zoo's tiny llama."""
    return tiny()


def shared(url: str, tmp_path: Path, secret: str | None = SECRET) -> kvrt.Config:
    flags: dict[str, str] = {"remote.url": url, "disk.budget": "0"}
    if secret is not None:
        path = tmp_path / "secret"
        path.write_text(secret + "\n")
        flags["remote.secret_file"] = str(path)
    return kvrt.load_config(flags=flags)


async def fill(engine: kvrt.backend.Engine, cfg: kvrt.Config) -> None:
    """One replica computes X and then Y: both go to the shared tier."""
    async with kvrt.open_runtime(engine=engine, config=cfg) as rt:
        async with rt.open_session(hot_tokens=512) as s:
            await s.ensure_context(X)
            await s.ensure_context(Y)
            await s.ensure_context(X)
        await settled_runtime(rt)


async def settled_runtime(rt: kvrt.Runtime) -> None:
    import anyio

    with anyio.fail_after(30):
        while rt.cold_stats().pending_writes:
            await anyio.sleep(0.05)


async def fresh_logits(engine: kvrt.backend.Engine, context: list[Segment]) -> np.ndarray:
    off = kvrt.Config(disk=kvrt.DiskConfig(budget=0))
    async with (
        kvrt.open_runtime(engine=engine, config=off) as rt,
        rt.open_session(hot_tokens=512) as s,
    ):
        await s.ensure_context(context)
        return await next_logits(s)


def values(url: str) -> dict[bytes, bytes]:
    client = redis.Redis.from_url(url)
    return {name: client.get(name) for name in client.keys("kvrt:v2:blk:*")}  # type: ignore[misc]


def unsealed(raw: bytes, signed: bool) -> blockfile.Header:
    """What anyone reading the server learns of a value: its header is plain msgpack."""
    body = raw[:-TAG_BYTES] if signed else raw
    header_len, _ = blockfile.read_prefix(body)
    start = blockfile.PREFIX.size
    return blockfile.read_block_header(body[start : start + header_len])


def reencoded(raw: bytes, signed: bool, data: np.ndarray) -> bytes:
    """``raw``'s block (its key, tokens, class) holding ``data`` as its KV bytes, in
    kvrt's own encoding with a valid checksum, and no valid tag (no secret)."""
    body = raw[:-TAG_BYTES] if signed else raw
    entry = blockfile.decode(np.frombuffer(body, dtype=np.uint8).copy())
    meta = msgspec.structs.replace(entry.meta, n_bytes=int(data.size))
    forged = kvrt._cold.ColdEntry(
        entry.key, entry.cache_class, kvrt.ColdBlock(meta=meta, data=data), entry.logits
    )
    head, payload = blockfile.encode(forged)
    return head + bytes(payload)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_another_prompts_kv_under_a_blocks_name_is_a_miss(
    redis_server: RedisServer, engine: kvrt.backend.Engine, tmp_path: Path, anyio_backend: str
) -> None:
    """The attack that worked on an unsigned store: Y's blocks re-encoded with X's KV
    bytes (checksums recomputed) and written over Y's values. With a secret they fail
    their tags: counted, deleted, computed again; Y's answer is Y's."""
    cfg = shared(redis_server.url, tmp_path)
    await fill(engine, cfg)
    stored = values(redis_server.url)
    by_start: dict[int, list[bytes]] = {}
    for name, raw in stored.items():
        by_start.setdefault(unsealed(raw, True).start, []).append(name)
    client = redis.Redis.from_url(redis_server.url)
    swapped = 0
    for names in by_start.values():
        if len(names) == 2:  # X's and Y's blocks at one start: each gets the other's KV
            a, b = names
            for target, source in ((a, b), (b, a)):
                kv = blockfile.decode(
                    np.frombuffer(stored[source][:-TAG_BYTES], dtype=np.uint8).copy()
                ).data
                client.set(target, reencoded(stored[target], True, kv))
                swapped += 1
    assert swapped >= 2

    want = await fresh_logits(engine, Y)
    async with kvrt.open_runtime(engine=engine, config=cfg) as rt:
        async with rt.open_session(hot_tokens=512) as s:
            status = await s.ensure_context(Y)
            got = await next_logits(s)
        remote = rt.cold_stats().remote
    assert remote is not None and remote.signed and remote.forged >= 1
    assert status.exact and np.array_equal(got, want)
    signer, left = Signer(SECRET.encode()), 0
    for name, raw in values(redis_server.url).items():  # the forgeries read are gone (X's, which
        try:  # Y never asked for, are still there)
            signer.open(name.decode(), raw)
        except kvrt._cold.ForgedValueError:
            left += 1
    assert left == swapped - remote.forged


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_value_moved_under_another_name_or_planted_is_a_miss(
    redis_server: RedisServer, engine: kvrt.backend.Engine, tmp_path: Path, anyio_backend: str
) -> None:
    """Values swapped between names keep valid tags for their own names only; a value
    written by someone without the secret carries none."""
    cfg = shared(redis_server.url, tmp_path)
    await fill(engine, cfg)
    stored = values(redis_server.url)
    names = sorted(stored)
    client = redis.Redis.from_url(redis_server.url)
    for name, source in zip(names, names[1:] + names[:1], strict=True):
        client.set(name, stored[source])  # every value moved one name along
    want = await fresh_logits(engine, X)
    async with kvrt.open_runtime(engine=engine, config=cfg) as rt:
        async with rt.open_session(hot_tokens=512) as s:
            status = await s.ensure_context(X)
            got = await next_logits(s)
        remote = rt.cold_stats().remote
        async with kvrt.serve.openai_client(rt) as client:  # what an operator reads
            metrics = str(await client.get(f"{ROOT}/metrics", cast_to=str))
    assert remote is not None and remote.forged >= 1 and remote.hits == 0
    assert status.restored_tokens == 0 and np.array_equal(got, want)
    assert f'kvrt_cold_blocks_refused_total{{why="forged"}} {remote.forged}' in metrics

    # Without the secret a replica reads no name the signed ones wrote, and says that it
    # trusts every writer.
    async with kvrt.open_runtime(
        engine=engine, config=shared(redis_server.url, tmp_path, None)
    ) as rt:
        async with rt.open_session(hot_tokens=512) as s:
            status = await s.ensure_context(X)
        remote = rt.cold_stats().remote
    assert remote is not None and not remote.signed and remote.hits == 0
    assert remote.warning is not None and "trusts every writer" in remote.warning


def damaged(kv: np.ndarray, kind: int) -> np.ndarray:
    """``kv`` made malformed four ways: cut in half, zeros, 0xFF, a huge first word."""
    match kind % 4:
        case 0:
            return kv[: kv.size // 2].copy()
        case 1:
            return np.zeros_like(kv)
        case 2:
            return np.full_like(kv, 0xFF)
        case _:
            bad = kv.copy()
            bad[:8] = np.frombuffer((1 << 62).to_bytes(8, "little"), dtype=np.uint8)
            return bad


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_state_bytes_the_engine_rejects_cost_a_recompute(
    redis_server: RedisServer, engine: kvrt.backend.Engine, tmp_path: Path, anyio_backend: str
) -> None:
    """Malformed state bytes under a valid checksum (an unsigned store; each block damaged
    one of four ways): the call succeeds with a fresh computation's logits, the blocks
    leave the server, counted; the next call finds nothing bad."""
    cfg = shared(redis_server.url, tmp_path, None)
    await fill(engine, cfg)
    client = redis.Redis.from_url(redis_server.url)
    for n, (name, raw) in enumerate(sorted(values(redis_server.url).items())):
        kv = blockfile.decode(np.frombuffer(raw, dtype=np.uint8).copy()).data
        client.set(name, reencoded(raw, False, damaged(kv, n)))
    want = await fresh_logits(engine, Y)
    rejected = []
    for _ in range(2):  # and again: nothing bad is left to fail on
        async with kvrt.open_runtime(engine=engine, config=cfg) as rt:
            async with rt.open_session(hot_tokens=512) as s:
                status = await s.ensure_context(Y)
                got = await next_logits(s)
            cold = rt.cold_stats()
        assert np.array_equal(got, want) and status.exact
        assert cold.remote is not None
        rejected.append((cold.rejected, cold.remote.discarded))
    assert rejected[0][0] >= 1 and rejected[0][1] == rejected[0][0]
    assert rejected[1] == (0, 0)


@pytest.mark.anyio
async def test_a_value_larger_than_a_block_is_refused_before_it_is_read(
    redis_server: RedisServer,
) -> None:
    victim = policies.get("cold_victim", "class_lru")
    limit = 2 * SIZE
    store = ColdStore(4 * SIZE, victim, tiers=[RemoteTier(redis_server.url, max_value_bytes=limit)])
    async with serving(store):
        await store.put(block(0))
        await settled(store)
    tier = RemoteTier(redis_server.url, max_value_bytes=limit)
    client = redis.Redis.from_url(redis_server.url)
    name = tier.key_name(block(0).key)
    client.set(name, b"\0" * (64 << 20))
    sent = int(client.info("stats")["total_net_output_bytes"])
    fresh = ColdStore(4 * SIZE, victim, tiers=[tier])
    async with serving(fresh):
        await fresh.discover([block(0).key])
        assert await fresh.fetch(block(0).key) is None
    read = int(client.info("stats")["total_net_output_bytes"]) - sent
    stats = fresh.stats().remote
    assert stats is not None and stats.oversized == 1 and stats.up
    assert read < 2 * limit  # at most the bounded range, never the 64 MiB value
    assert client.exists(name) == 0  # deleted: a replica computes and writes it again


def test_names_and_tags_need_the_secret() -> None:
    signer, other = Signer(SECRET.encode()), Signer(b"another secret of enough bytes")
    assert signer.name("blk", b"k") != other.name("blk", b"k") != Signer(None).name("blk", b"k")
    sealed = signer.seal("n", b"value")
    assert bytes(signer.open("n", sealed)) == b"value"
    for who, name, value in ((other, "n", sealed), (signer, "m", sealed), (signer, "n", b"value")):
        with pytest.raises(kvrt._cold.ForgedValueError):
            who.open(name, value)


def certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate for 127.0.0.1 it signed (with its key), made by openssl."""
    ca_key, ca, key, csr, cert = (folder / n for n in ("ca.key", "ca.pem", "k", "csr", "c"))
    ext = folder / "ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for args in (
        f"req -x509 -newkey rsa:2048 -nodes -keyout {ca_key} -out {ca} -days 1 -subj /CN=ca",
        f"req -newkey rsa:2048 -nodes -keyout {key} -out {csr} -subj /CN=127.0.0.1",
        f"x509 -req -in {csr} -CA {ca} -CAkey {ca_key} -CAcreateserial -out {cert} -days 1 "
        f"-extfile {ext}",
    ):
        subprocess.run(["openssl", *args.split()], check=True, capture_output=True)
    return ca, cert, key


@pytest.mark.anyio
@pytest.mark.parametrize(("transport", "anyio_backend"), [("acl", "asyncio"), ("tls", "trio")])
async def test_an_acl_user_and_tls_carry_the_shared_tier(
    engine: kvrt.backend.Engine, tmp_path: Path, transport: str, anyio_backend: str
) -> None:
    """The transport's half of the trust boundary: a server that admits only a kvrt ACL
    user (to ``kvrt:*`` names), or only TLS; replicas that can reach it share blocks,
    one that cannot (a wrong password, an unknown CA) answers all the same from its
    own tiers, the failure counted."""
    if shutil.which("openssl") is None and transport == "tls":
        pytest.skip("openssl is not installed")
    extra: dict[str, str] = {}
    if transport == "acl":
        args = ["--user", "default", "off", "--user", "kvrt", "on", ">pw-of-kvrt"]
        args += ["~kvrt:*", "+@all", "-@dangerous"]
        url, bad = (
            "redis://kvrt:pw-of-kvrt@127.0.0.1:{port}/0",
            "redis://kvrt:nope@127.0.0.1:{port}/0",
        )
        server = start_redis(tmp_path, *args, url=url)
    else:
        ca, cert, key = certificates(tmp_path)
        args = ["--port", "0", "--tls-port", "{port}", "--tls-cert-file", str(cert)]
        args += ["--tls-key-file", str(key), "--tls-ca-cert-file", str(ca)]
        args += ["--tls-auth-clients", "no"]
        url = bad = "rediss://127.0.0.1:{port}/0"
        server = start_redis(tmp_path, *args, url=url, ssl_ca_certs=str(ca))
        extra["remote.ca_file"] = str(ca)
    try:
        cfg = shared(server.url, tmp_path)
        cfg = kvrt.load_config(flags={**flags_of(cfg), **extra})
        await fill(engine, cfg)
        want = await fresh_logits(engine, Y)
        async with kvrt.open_runtime(engine=engine, config=cfg) as rt:
            async with rt.open_session(hot_tokens=512) as s:
                status = await s.ensure_context(Y)
                got = await next_logits(s)
            remote = rt.cold_stats().remote
        assert remote is not None and remote.hits > 0 and remote.errors == 0
        assert status.restored_tokens > 0 and np.array_equal(got, want)

        denied = {**flags_of(cfg), "remote.url": bad.format(port=server.port)}
        denied.pop("remote.ca_file", None)
        async with kvrt.open_runtime(engine=engine, config=kvrt.load_config(flags=denied)) as rt:
            async with rt.open_session(hot_tokens=512) as s:
                status = await s.ensure_context(Y)
                got = await next_logits(s)
            remote = rt.cold_stats().remote
        assert remote is not None and remote.errors > 0 and remote.hits == 0
        assert np.array_equal(got, want)
    finally:
        server.stop()


def flags_of(cfg: kvrt.Config) -> dict[str, str]:
    remote = cfg.remote
    out = {"remote.url": str(remote.url), "disk.budget": "0"}
    if remote.secret_file is not None:
        out["remote.secret_file"] = remote.secret_file
    if remote.ca_file is not None:
        out["remote.ca_file"] = remote.ca_file
    return out
