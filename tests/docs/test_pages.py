"""The README and the pages under ``docs/`` as a user meets them: every Python block runs
as written, every command shown is one kvrt's command line takes, every option its
``--help`` shows is documented, every TOML block is a configuration kvrt loads."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvrt
from kvrt.cli import parser
from tests.support.environments import PINNING_IMPORTS
from tests.support.models import zoo_path
from tests.support.server import kvrt_serve

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(
    r"^(?P<indent> *)```(?P<lang>[\w-]*)\n(?P<body>.*?)^(?P=indent)```$", re.M | re.S
)


def blocks(lang: str) -> list[tuple[str, str]]:
    """``(where, text)`` of every fenced block of ``lang`` in the pages, dedented."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match["lang"] != lang:
                continue
            line = text.count("\n", 0, match.start()) + 1
            indent = len(match["indent"])
            body = "".join(row[indent:] for row in match["body"].splitlines(keepends=True))
            found.append((f"{page.relative_to(ROOT)}:{line}", body))
    return found


def test_the_pages_hold_blocks_of_each_kind() -> None:
    """The collector finds what it checks (a block it missed would pass unseen)."""
    assert len(blocks("python")) >= 10
    assert len(blocks("sh")) >= 8
    assert blocks("toml")
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``kvrt serve`` on a free port, for the blocks that talk to one over HTTP."""
    log = tmp_path_factory.mktemp("docs-serve") / "serve.log"
    with kvrt_serve(log, "--state", "none", env={"KVRT_DISK_BUDGET": "0"}) as url:
        yield f"{url}/v1"


def _pinning(text: str) -> bool:
    """Whether a program imports a framework that runs in an environment of its own."""
    return bool(re.search(rf"^(from|import) ({'|'.join(PINNING_IMPORTS)})\b", text, re.M))


def _uses_a_framework(text: str) -> bool:
    frameworks = r"agents|pydantic_ai|langchain_openai|smolagents|dspy|litellm|haystack|autogen_\w+"
    return _pinning(text) or bool(re.search(rf"^(from|import) ({frameworks})\b", text, re.M))


def _marks(text: str) -> list[pytest.MarkDecorator]:
    marks = [pytest.mark.subprocess, pytest.mark.model]
    if _uses_a_framework(text):
        marks.append(pytest.mark.frameworks)
    return marks


def _needs_real_text(text: str) -> bool:
    """Whether a block's program reads what the model wrote: a framework's loop, a tool
    call or a structured reply."""
    return _uses_a_framework(text) or bool(re.search(r"tools=|response_format=|tool_calls", text))


def _run(text: str, folder: Path, python: str, env: dict[str, str]) -> None:
    """Run a block as a user would (``python block.py``, in a folder of its own): it
    exits 0 and says something."""
    program = folder / "block.py"
    program.write_text(text)
    done = subprocess.run(
        [python, str(program)], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), done.stderr[-3000:]


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(text, id=where, marks=_marks(text))
        for where, text in blocks("python")
        if not _pinning(text)
    ],
)
def test_every_python_block_runs_as_written(
    text: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Each block is a whole program, run in the test environment. A block that uses no
    framework, tool or schema runs on the zoo's tiny llama (``KVRT_MODEL``, as a user picks
    a model; its tokenizer and template are the embedded model's): what it shows is kvrt's
    calls, not the model's text, which the other blocks and the rest of the suite check."""
    env = dict(os.environ)
    if "KVRT_BASE_URL" in text:
        env["KVRT_BASE_URL"] = request.getfixturevalue("server")
    elif not _needs_real_text(text):
        env["KVRT_MODEL"] = zoo_path("llama")
    _run(text, tmp_path, sys.executable, env)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(text, id=where, marks=_marks(text))
        for where, text in blocks("python")
        if _pinning(text)
    ],
)
def test_every_block_of_a_pinning_framework_runs_in_its_environment(
    text: str, tmp_path: Path, pinning_python: str
) -> None:
    """A block importing LlamaIndex or Instructor runs where they run: kvrt beside them in
    an environment of their own (its build starts with the run)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run(text, tmp_path, pinning_python, env)


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    top = parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _commands() -> list[tuple[str, list[str]]]:
    """Every command line the pages show, as ``(where, argv)``, comments and the shell's
    own lines left out."""
    found = []
    for where, text in blocks("sh"):
        for row in text.splitlines():
            row = row.split(" #")[0].strip()
            for part in re.split(r"\s*&&\s*", row):
                if part and not part.startswith(("export ", "#")):
                    found.append((where, shlex.split(part)))
    return found


def test_every_command_shown_is_one_kvrt_takes() -> None:
    """``kvrt ...`` lines parse with kvrt's own parser (every option exists, every value
    has its form); scripts and modules named exist; pip extras are the project's."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    checked, wrong = 0, []
    for where, argv in _commands():
        tool = Path(argv[0]).name
        if tool == "kvrt":
            try:
                parser().parse_args(argv[1:])
            except SystemExit:
                wrong.append(f"{where}: {shlex.join(argv)}")
        elif tool == "python" and argv[1:2] == ["-m"] and argv[2] != "pytest":
            where_module = ROOT.joinpath(*argv[2].split("."))
            if not (where_module.with_suffix(".py").is_file() or where_module.is_dir()):
                wrong.append(f"{where}: no module {argv[2]}")
        elif tool == "python" or (tool == "pytest" and len(argv) > 1):
            paths = [a for a in argv[1:] if not a.startswith("-") and "/" in a]
            wrong += [f"{where}: no file {p}" for p in paths if not (ROOT / p).exists()]
        elif tool == "pip":
            for arg in argv:
                extras = re.fullmatch(r"-e\s*\.?\[([\w,]+)\]|\.\[([\w,]+)\]", arg)
                if extras:
                    for extra in (extras[1] or extras[2]).split(","):
                        if f"\n{extra} = [" not in pyproject:
                            wrong.append(f"{where}: no extra {extra}")
        checked += 1
    assert checked >= 20
    assert not wrong


def _servers() -> list[tuple[str, list[str]]]:
    return [(w, a) for w, a in _commands() if Path(a[0]).name == "kvrt" and a[1:2] == ["serve"]]


@pytest.mark.subprocess
@pytest.mark.parametrize("where_argv", _servers(), ids=lambda w: w[0])
def test_every_server_shown_starts_answers_and_stops(
    where_argv: tuple[str, list[str]], tmp_path: Path
) -> None:
    """Each ``kvrt serve`` line the pages show, run as shown (on a free port; a key file
    it names holds a key; a Redis URL points at a real ``redis-server``): it answers
    ``/v1/models`` with its key and stops cleanly."""
    import openai

    from tests.support.redis import start_redis

    flags, key, redis_server = [], "unused", None
    args = iter(where_argv[1][2:])
    for flag in args:
        value = next(args) if flag in ("--port", "--host", "--api-key", "--remote-url") else None
        if flag in ("--port", "--host"):
            continue  # the test's own free port, on loopback
        if flag == "--api-key" and value is not None and value.startswith("@"):
            key = "sk-docs"
            (tmp_path / value[1:]).write_text(f"{key}\n")
            value = "@" + str(tmp_path / value[1:])
        if flag == "--remote-url":
            redis_server = start_redis(tmp_path)
            value = redis_server.url
        flags += [flag] if value is None else [flag, value]
    env = {"KVRT_DISK_BUDGET": "0", "KVRT_REMOTE_SECRET": "a-docs-test-secret-of-32-bytes!!"}
    try:
        with kvrt_serve(tmp_path / "serve.log", *flags, env=env) as url:
            assert openai.OpenAI(base_url=f"{url}/v1", api_key=key).models.list().data
    finally:
        if redis_server is not None:
            redis_server.stop()


def test_every_option_help_shows_is_documented() -> None:
    """Each command's own options have a line on the command-line page; every setting's
    flag a row in the configuration table."""
    cli = (ROOT / "docs" / "command-line.md").read_text()
    config = (ROOT / "docs" / "configuration.md").read_text()
    missing = []
    for name, sub in _subcommands().items():
        section = cli[cli.index(f"## kvrt {name}") :].split("\n## ")[0]
        for group in sub._action_groups:
            for action in group._group_actions:
                for option in action.option_strings:
                    if option in ("-h", "--help"):
                        continue
                    if group.title and group.title.startswith("settings"):
                        if f"`{option}`" not in config:
                            missing.append(f"configuration.md: {option}")
                    elif f"`{option}" not in section:
                        missing.append(f"command-line.md, kvrt {name}: {option}")
    assert not sorted(set(missing))


@pytest.mark.parametrize("where_text", blocks("toml"), ids=lambda wt: wt[0])
def test_every_toml_block_is_a_configuration(where_text: tuple[str, str], tmp_path: Path) -> None:
    path = tmp_path / "kvrt.toml"
    path.write_text(where_text[1])
    assert isinstance(kvrt.load_config(path, env={}), kvrt.Config)


def test_every_file_the_pages_name_exists() -> None:
    """Paths of tests, examples and benchmarks the pages cite are where they say."""
    cited = {
        (page.name, path)
        for page in PAGES
        for path in re.findall(
            r"\b((?:tests|examples|benchmarks)/[\w/.-]+\.py)\b", page.read_text()
        )
    }
    assert len(cited) >= 10
    assert not {c for c in cited if "NAME" not in c[1] and not (ROOT / c[1]).is_file()}
