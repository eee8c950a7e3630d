"""The command line, settings, model files and the OpenVINO model cache under hostile
input: one line on stderr and exit 2, or a clear kvrt error; never a traceback or an abort.
The tables of bad flags, settings and config files run ``kvrt``'s ``main(argv)`` in this
process (quick); a few of their cases, and everything touching model files, run in a child
process too, so an abort could not take the test run with it."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import kvrt
from kvrt.cli import main

pytestmark = [pytest.mark.subprocess, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]


def kvrt_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvrt", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def one_error_line(proc: subprocess.CompletedProcess[str], expected: str) -> None:
    _one_error_line(proc.returncode, proc.stderr, expected)


def _one_error_line(code: object, stderr: str, expected: str) -> None:
    lines = stderr.strip().splitlines()
    assert code == 2, stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("kvrt: error: "), stderr[-2000:]
    assert expected in lines[0], lines[0]


@pytest.fixture
def kvrt_main(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., None]:
    """``kvrt ARGS`` in this process, with ``env`` set: asserts one error line holding
    ``expected`` and exit status 2."""

    def call(*args: str, expected: str, env: dict[str, str] | None = None) -> None:
        monkeypatch.chdir(ROOT)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        try:
            code: object = main(list(args))
        except SystemExit as exc:  # argparse's exit
            code = exc.code
        _one_error_line(code, capsys.readouterr().err, expected)

    return call


BAD_FLAGS = [
    (["run", "--hot-tokens", "100"], "leave a hot window of 100 tokens"),
    (["run", "--max-tokens", "-1"], "argument --max-tokens: expected a number from 0"),
    (["run", "--mem-max", "1MiB"], "leave a hot window of 0 tokens"),
    (["run", "--mem-reserve", "1000GiB"], "leave a hot window of 0 tokens"),
    (["run", "--mem-cold", "100000TB"], "memory.cold of"),
    (["run", "--batch", "0"], "invalid engine.batch from flag --batch"),
    (["run", "--threads", "x"], "invalid engine.threads from flag --threads"),
    (["bench", "--decode", "-1"], "argument --decode: expected a number from 1"),
    (["bench", "--tokens", "-5"], "argument --tokens: expected a number from 16"),
    (["bench", "--tokens", "0"], "argument --tokens: expected a number from 16"),
    (["bench", "--tokens", "99999999999"], "argument --tokens: expected a number from 16"),
    (["bench", "--plot", "/proc/kvrt/x.png", "--turns", "1"], "cannot write the plot"),
    (["bench", "--sessions", "100"], "--sessions must stay at 16 or below"),
    (["describe", "--mem-headroom", "200%"], "invalid memory.headroom from flag"),
    (["describe", "~nosuchuser/x.gguf"], "cannot resolve the model path"),
    (["nonsense"], "invalid choice: 'nonsense'"),
]
BAD_SETTINGS = [
    ({"KVRT_HOT_TOKENS": "1"}, "leave a hot window of 1 tokens"),
    ({"KVRT_CONTEXT": "100"}, "limited by engine.context"),
    ({"KVRT_BATCH": "abc"}, "invalid engine.batch from environment variable KVRT_BATCH"),
    ({"KVRT_MEM_COLD": "-5"}, "invalid memory.cold from environment variable"),
    ({"KVRT_BACKEND": "tpu"}, "expected one of: llama, openvino"),
    ({"KVRT_COLD_WAIT": "inf"}, "invalid session.cold_wait"),
    ({"KVRT_HOT_EVICTION": "fifo"}, "no hot_eviction policy named 'fifo'"),
    ({"KVRT_CONFIG": "/proc"}, "cannot read config file /proc"),
    ({"KVRT_MODEL": "/dev/null"}, "model path is not a file: /dev/null"),
]


BAD_SERVE = [
    (["--session-tokens", "256"], "the sessions' hot window (--session-tokens"),
    (["--state", "/proc/kvrt/state.sqlite3"], "the state database /proc/kvrt/state.sqlite3"),
    (["--state", "/dev/null"], "is not a regular file"),
    (
        ["--remote-url", "redis://127.0.0.1:1/0", "--remote-secret-file", "/nonexistent"],
        "cannot read remote.secret_file /nonexistent",
    ),
    (
        ["--remote-url", "redis://127.0.0.1:1/0", "--remote-secret-file", "/dev/zero"],
        "cannot read remote.secret_file /dev/zero: not a regular file",
    ),
    (["--api-key", "@/dev/zero"], "cannot read the API keys' file /dev/zero: not a regular"),
    (["--config", "/dev/zero"], "cannot read config file /dev/zero: not a regular file"),
    (["--response-store", "0"], "--response-store (ServeConfig.response_store_bytes) is 0"),
    (["--conversation-store", "1KiB"], "--conversation-store (ServeConfig.conversation_store"),
]


@pytest.mark.parametrize(("args", "expected"), BAD_SERVE)
def test_settings_kvrt_serve_cannot_serve_with_are_refused_at_start(
    kvrt_main: Callable[..., None], args: list[str], expected: str
) -> None:
    """Refused before a request comes (exit 2, one line), not a 500 for each request."""
    kvrt_main("serve", "--port", "0", "--disk-budget", "0", *args, expected=expected)


def test_files_kvrt_serve_reads_are_bounded_and_never_waited_on(
    kvrt_main: Callable[..., None], tmp_path: Path
) -> None:
    """A FIFO nobody writes is refused at once (not waited on at start), a file past its
    bound refused before it is read whole, a key file that is not UTF-8 one line."""
    fifo = tmp_path / "keys"
    os.mkfifo(fifo)
    started = time.monotonic()
    kvrt_main("serve", "--port", "0", "--api-key", f"@{fifo}", expected="not a regular file")
    assert time.monotonic() - started < 10
    large = tmp_path / "secret"
    large.write_bytes(b"s" * 10_000)
    flags = ("--remote-url", "redis://127.0.0.1:1/0", "--remote-secret-file", str(large))
    kvrt_main("serve", "--port", "0", *flags, expected="larger than 4,096 bytes")
    latin = tmp_path / "latin"
    latin.write_bytes(b"cl\xe9 alice\n")
    kvrt_main("serve", "--port", "0", "--api-key", f"@{latin}", expected="is not UTF-8 text")


def test_a_secret_of_any_bytes_is_taken_as_bytes() -> None:
    """A secret from the environment that is not UTF-8 (Python holds its bytes as
    surrogates) is those bytes, not a UnicodeEncodeError."""
    from kvrt._cold.trust import load_secret

    raw = b"\xff\xfe" + b"0123456789abcdef"
    assert load_secret(None, env={"KVRT_REMOTE_SECRET": os.fsdecode(raw)}) == raw


@pytest.mark.parametrize(("args", "expected"), BAD_FLAGS)
def test_bad_flags(kvrt_main: Callable[..., None], args: list[str], expected: str) -> None:
    kvrt_main(*args, expected=expected)


@pytest.mark.parametrize(("env", "expected"), BAD_SETTINGS)
def test_bad_settings(kvrt_main: Callable[..., None], env: dict[str, str], expected: str) -> None:
    kvrt_main("run", "--sessions", "1", "--max-tokens", "1", expected=expected, env=env)


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (BAD_FLAGS[0][0], {}, BAD_FLAGS[0][1]),
        (BAD_FLAGS[-1][0], {}, BAD_FLAGS[-1][1]),
        (["run", "--sessions", "1"], *BAD_SETTINGS[2]),
    ],
)
def test_bad_input_in_a_child_process(args: list[str], env: dict[str, str], expected: str) -> None:
    one_error_line(kvrt_cli(*args, env=env), expected)


def test_malformed_config_files(kvrt_main: Callable[..., None], tmp_path: Path) -> None:
    for name, body, expected in (
        ("cut.json", b'{"engine": {"batch": 1', "is not valid json"),
        ("list.json", b"[1, 2]", "must hold a table of sections"),
        ("bytes.json", b"\xff\xfe", "is not valid json"),
        ("cut.toml", b"engine = [", "is not valid toml"),
        ("kind.json", b'{"engine": {"batch": "x"}}', "invalid engine.batch from config file"),
    ):
        path = tmp_path / name
        path.write_bytes(body)
        kvrt_main("describe", expected=expected, env={"KVRT_CONFIG": str(path)})


ONE_TOKEN_BATCHES = """
import anyio, kvrt

async def main():
    cfg = kvrt.load_config(flags={"batch": 1, "block_tokens": 16, "sink_tokens": 4,
                                  "recent_tokens": 16, "disk.budget": "0"})
    async with kvrt.open_runtime(config=cfg) as rt, rt.open_session(hot_tokens=128) as s:
        text = "The keeper climbed the tower with a lantern. " * 12
        await s.ensure_context([kvrt.Segment("a", text), kvrt.Segment("q", "Who climbed?")])
        await s.evict("a")  # two sequences in play: the export and the window
        status = await s.ensure_context([kvrt.Segment("a", text), kvrt.Segment("q", "Why?")])
        done = await s.generate(max_tokens=2)
        print("ok", status.restored_tokens, len(done.tokens))

anyio.run(main)
"""


def test_a_batch_of_one_token_works() -> None:
    """llama.cpp asserts on a one-token batch with two sequences; kvrt never lets it
    (a child process, so an abort could not take the suite down)."""
    proc = subprocess.run(
        [sys.executable, "-c", ONE_TOKEN_BATCHES], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[:1] == ["ok"] and int(proc.stdout.split()[1]) > 0


def _broken_models(folder: Path) -> dict[str, Path]:
    data = kvrt.embedded_model_path().read_bytes()

    def patched(offset: int, value: int) -> bytes:
        out = bytearray(data)
        struct.pack_into("<Q" if offset else "<I", out, offset or 4, value)
        return bytes(out)

    cases = {f"cut-{n}": data[:n] for n in (3, 10, 1000, 100_000, len(data) // 2, len(data) - 100)}
    cases["version-99"] = patched(0, 99)
    cases["tensors-huge"] = patched(8, 2**40)
    cases["keys-huge"] = patched(16, 2**40)
    cases["keys-zero"] = patched(16, 0)
    paths = {}
    for name, body in cases.items():
        paths[name] = folder / f"{name}.gguf"
        paths[name].write_bytes(body)
    paths["folder"] = folder
    paths["dev-null"] = Path("/dev/null")
    return paths


LOAD_ALL = textwrap.dedent(
    """
    import sys
    import kvrt
    backend, paths = sys.argv[1], sys.argv[2:]
    for path in paths:
        try:
            kvrt.open_engine(kvrt.EngineConfig(backend=backend, model=path)).close()
            print("LOADED", path)
        except kvrt.ModelLoadError as exc:
            print("ModelLoadError", path)
    """
)


@pytest.mark.parametrize("backend", ["llama", "openvino"])
def test_broken_model_files(backend: str, tmp_path: Path) -> None:
    paths = _broken_models(tmp_path)
    cache = tmp_path / "cache"
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_ALL, backend, *map(str, paths.values())],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "KVRT_CACHE_DIR": str(cache)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [
        word for p in paths.values() for word in ("ModelLoadError", str(p))
    ], proc.stdout + proc.stderr[-2000:]
    if (cache / "openvino").exists():
        assert list((cache / "openvino").iterdir()) == []  # no half builds left behind


BUILD = (
    "from kvrt.adapters.openvino._prepare import prepare_ir; "
    "folder, info = prepare_ir(None); print('BUILT', folder.name, info.architecture)"
)


def _build(cache: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", BUILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "KVRT_CACHE_DIR": str(cache)},
    )


@pytest.mark.slow
def test_openvino_builds_killed_or_racing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    killed = _build(cache)
    root = cache / "openvino"
    for _ in range(600):  # wait until the build has started writing
        if root.exists() and any(root.glob(".build-*/*")):
            break
        subprocess.run(["sleep", "0.05"], check=True)
    killed.kill()
    killed.communicate()
    assert [p.name.startswith(".build-") for p in root.iterdir()] == [True]
    one, two = _build(cache), _build(cache)
    outs = [p.communicate(timeout=600) for p in (one, two)]
    assert [p.returncode for p in (one, two)] == [0, 0], [err[-2000:] for _, err in outs]
    built = {out.split()[1] for out, _ in outs}
    assert len(built) == 1
    assert [p.name for p in root.iterdir()] == list(built)  # one build, no junk left


def test_openvino_cache_folder_problems(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("a file where a folder should be")
    for where, expected in (
        (blocked, "cannot keep built OpenVINO models in KVRT_CACHE_DIR="),
        (Path("/proc/kvrt"), "cannot keep built OpenVINO models in KVRT_CACHE_DIR=/proc/kvrt"),
    ):
        proc = kvrt_cli("describe", "--backend", "openvino", env={"KVRT_CACHE_DIR": str(where)})
        one_error_line(proc, expected)


def test_version_local_config_and_describe_policies(tmp_path: Path) -> None:
    proc = kvrt_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"kvrt {kvrt.__version__}"
    one_error_line(
        kvrt_cli("describe", "--hot-eviction", "fifo"), "no hot_eviction policy named 'fifo'"
    )
    (tmp_path / "kvrt.toml").write_text('[policies]\nrestore = "sometimes"\n')
    env = {k: v for k, v in os.environ.items() if k != "KVRT_CONFIG"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvrt", "describe", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # ./kvrt.toml is read when no --config or $KVRT_CONFIG names a file
        env=env,
    )
    one_error_line(proc, "no restore policy named 'sometimes'")
    (tmp_path / "kvrt.toml").write_text("[engine]\nhot_tokens = 1024\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvrt", "describe", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"hot_context_tokens": 1024' in proc.stdout


def test_ctrl_c_ends_the_test_run_at_once_with_its_summary() -> None:
    """A newcomer's Ctrl-C in the middle of a trio test whose task group runs engine
    work, in the README's test command (its workers included: a terminal signals every
    process of the run): the run stops there (exit status 2, pytest's KeyboardInterrupt
    summary), not one failed test and on to the next, and not after the workers' test."""
    args = [sys.executable, "-m", "pytest", "tests/session/test_trio_suite.py", "-v", "-p"]
    args += ["no:cacheprovider"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    child = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=env,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert child.stdout is not None
    seen = b""
    while b"test_trio_suite.py::" not in seen:  # a test has begun (its line not yet ended)
        piece = os.read(child.stdout.fileno(), 4096)
        assert piece, seen
        seen += piece
    time.sleep(1.0)
    os.killpg(child.pid, signal.SIGINT)  # what Ctrl-C does
    began = time.monotonic()
    rest, _ = child.communicate(timeout=60)
    took = time.monotonic() - began
    out = (seen + rest).decode()
    assert child.returncode == 2, out
    # No test ran to its end, on any worker: the run stopped inside them.
    assert "KeyboardInterrupt" in out and "no tests ran" in out, out
    assert " failed" not in out and " passed" not in out, out
    # The engine call in flight finishes (a restore lands whole or not at all), which on
    # two cores beside a loaded suite has taken up to 7 s; the interrupted tests run
    # 8-12 s alone and twice that loaded, and the whole file 25 s.
    assert took < 15, f"{took:.1f} s after Ctrl-C\n{out}"
