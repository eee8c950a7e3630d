"""The rooms and the arrows between them, read from the imports of every module.

- every room imports only rooms after it in :data:`ROOMS` (the import direction, written
  once here and on the architecture page of the README);
- ``policies/`` imports nothing of kvrt but the public ``kvrt.policy``;
- ``adapters/`` imports only ``kvrt`` (public names), ``kvrt.backend`` and the bridge;
- ``native_bridge/`` imports nothing of kvrt;
- ``kvrt serve`` imports only kvrt's public names;
- nothing imports the generic top-level names ``adapters``, ``policies``, ``native_bridge``;
- inside every package dependencies run one way, in the order its ``LAYERS`` states,
  and its docstring names its modules in that order;
- the placement planner (``kvrt/_paging/planner.py``) is pure: it imports no I/O, no
  engine and no other part of the session;
- the session's parts are composed, never inherited.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERIC = {"adapters", "policies", "native_bridge"}


def modules(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def package_of(path: Path) -> str:
    """The dotted package ``path`` belongs to, as installed (``adapters/x`` is in
    ``kvrt.adapters``)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in GENERIC:
        parts.insert(0, "kvrt")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts[:-1]) if path.name != "__init__.py" else ".".join(parts)


def imports(path: Path) -> Iterator[str]:
    """Every module ``path`` imports, absolute, including imports inside functions."""
    tree = ast.parse(path.read_text(), str(path))
    package = package_of(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            subs = [f"{target}.{alias.name}" for alias in node.names]
            if not all(is_module(sub) for sub in subs):  # names of it, not only its modules
                yield target
            yield from subs


def is_module(dotted: str) -> bool:
    """Whether ``dotted`` names one of the repository's modules or packages."""
    parts = dotted.split(".")
    if parts[0] != "kvrt":
        return False
    if len(parts) > 1 and parts[1] in GENERIC:
        parts = parts[1:]
    else:
        parts[0] = "kvrt"
    where = ROOT.joinpath(*parts)
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def kvrt_imports(path: Path) -> set[str]:
    return {m for m in imports(path) if m == "kvrt" or m.startswith("kvrt.")}


def stated_rooms() -> list[set[str]]:
    """kvrt's rooms as ``kvrt/__init__.py`` states them (``_ROOMS``, read, not imported)."""
    tree = ast.parse((ROOT / "kvrt" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            "_ROOMS"
        ]:
            return [set(rank) for rank in ast.literal_eval(node.value)]
    raise AssertionError("kvrt/__init__.py states no _ROOMS")


ROOMS = stated_rooms()
"""Each room, from the top down: a module imports only its own room's and rooms below."""


def room_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def rank_of(module: str) -> int | None:
    room = room_of(module)
    return next((i for i, rooms in enumerate(ROOMS) if room in rooms), None)


def test_every_room_imports_only_rooms_below_it() -> None:
    paths = modules("kvrt") + modules("adapters") + modules("native_bridge") + modules("policies")
    unknown, wrong = set(), set()
    for path in paths:
        me = package_of(path) if path.name == "__init__.py" else f"{package_of(path)}.{path.stem}"
        mine = rank_of(me)
        if mine is None:
            unknown.add(me)
            continue
        for m in kvrt_imports(path):
            theirs = rank_of(m)
            if theirs is not None and theirs < mine and room_of(m) != room_of(me):
                wrong.add(f"{me} -> {m}")
    assert not unknown  # every module is in a room
    assert not wrong


def test_the_server_uses_only_public_kvrt() -> None:
    """``kvrt serve`` is built on what any user has: ``kvrt``'s public names."""
    server = modules("kvrt/serve")
    assert len(server) >= 3
    wrong = {
        f"{p.relative_to(ROOT)} -> {m}"
        for p in server
        for m in kvrt_imports(p)
        if not (m.startswith("kvrt.serve") or (m.count(".") <= 1 and "._" not in m))
    }
    assert not wrong


def test_the_server_names_no_api_surface() -> None:
    """The server lends sessions and streams for every surface alike: what a surface's
    request means is its exchange's (``kvrt/serve/exchanges``) and translator's; the
    routing table (``app``) is the one place that names them."""
    lines = (ROOT / "kvrt" / "serve" / "server.py").read_text().splitlines()
    code = "\n".join(line for line in lines if not line.startswith(("from ", "import ")))
    named = re.findall(r"(?i)\b(chat|completions|responses|conversations?|/v1/\w+)\b", code)
    assert named == []
    assert len(lines) <= 300


def test_the_server_speaks_in_types() -> None:
    """Bodies, events and calls are msgspec Structs: ``Any`` is left where a library's
    own types end (redis-py's client, an httpx request, an ASGI app)."""
    found = sum(len(re.findall(r"\bAny\b", p.read_text())) for p in modules("kvrt/serve"))
    assert found <= 40


def _private_names(path: Path) -> set[str]:
    """Each private module of kvrt ``path`` imports, and each private name it imports from
    any module of kvrt."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvrt"):
            if "._" in node.module:
                found.add(node.module)
            found |= {
                f"{node.module}.{a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.endswith("__")
            }
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kvrt") and "._" in a.name}
    return found


def _privately_used(paths: list[Path], own: tuple[str, ...]) -> set[str]:
    """Each private module or name of kvrt ``paths`` import, and each private attribute
    they reach (``rt._cold``), but on objects of their own (``own`` prefixes)."""
    wrong = {f"{p.relative_to(ROOT)}: {name}" for p in paths for name in _private_names(p)}
    return wrong | {
        f"{p.relative_to(ROOT)}: {m}"
        for p in paths
        for m in re.findall(r"\b\w+\._[a-z]\w*\b(?!\.py)", p.read_text())
        if not m.startswith(own)
    }


@pytest.mark.parametrize("folder", ["kvrt/cli", "kvrt/bench"])
def test_the_command_line_and_bench_use_only_public_kvrt(folder: str) -> None:
    """``kvrt``'s command line and ``kvrt bench`` are built on what any user has: kvrt's
    public names and faces (``kvrt.backend``, ``kvrt.cold``), no private module or
    attribute of kvrt."""
    paths = modules(folder)
    assert len(paths) > 3
    assert not _privately_used(paths, ("self.", "sys.", "os._"))


def test_the_research_benchmarks_use_only_public_kvrt() -> None:
    """``benchmarks/`` (outside the package) imports kvrt's public names only, ``kvrt.bench``
    included, where kvrt keeps what they time part by part; and reaches no private attribute
    of kvrt's objects. ``kvrt/cli`` and ``kvrt/bench`` are rooms of kvrt, held by the order
    of rooms like any other."""
    paths = sorted((ROOT / "benchmarks").glob("*.py"))
    assert len(paths) > 10
    assert not _privately_used(paths, ("self.", "benchmarks.", "sys."))


def test_policies_see_only_the_policy_contract() -> None:
    wrong = {
        f"{p.relative_to(ROOT)} -> {m}"
        for p in modules("policies")
        for m in kvrt_imports(p)
        if not (m.startswith("kvrt.policy") or m.startswith("kvrt.policies"))
    }
    assert not wrong


def test_adapters_see_only_public_kvrt_and_the_bridge() -> None:
    def allowed(m: str) -> bool:
        top = m.split(".")
        return (len(top) <= 2 and not top[-1].startswith("_")) or m.startswith(
            ("kvrt.backend", "kvrt.native_bridge", "kvrt.adapters")
        )

    wrong = {
        f"{p.relative_to(ROOT)} -> {m}"
        for p in modules("adapters")
        for m in kvrt_imports(p)
        if not allowed(m)
    }
    assert not wrong


def test_the_bridge_imports_nothing_of_kvrt() -> None:
    wrong = {
        f"{p.relative_to(ROOT)} -> {m}"
        for p in modules("native_bridge")
        for m in kvrt_imports(p)
        if not m.startswith("kvrt.native_bridge")
    }
    assert not wrong


@pytest.mark.parametrize(
    "folder", ["kvrt", "adapters", "policies", "native_bridge", "tests", "examples"]
)
def test_nothing_imports_generic_top_level_names(folder: str) -> None:
    wrong = {
        f"{p.relative_to(ROOT)} -> {m}"
        for p in modules(folder)
        for m in imports(p)
        if m.split(".")[0] in GENERIC
    }
    assert not wrong


PACKAGES = [
    "kvrt/_session",
    "kvrt/_paging",
    "kvrt/_chat",
    "kvrt/_cold",
    "kvrt/_engine",
    "kvrt/cli",
    "kvrt/bench",
    "kvrt/serve",
    "kvrt/serve/exchanges",
    "kvrt/serve/protocol",
    "kvrt/serve/state",
    "kvrt/testing",
    "adapters",
    "adapters/llama",
    "adapters/openvino",
    "native_bridge",
    "policies",
]
"""Every package of modules: each states its modules' order in its ``LAYERS``."""


def stated_layers(folder: str) -> tuple[list[str], str]:
    """The ``LAYERS`` a package's ``__init__.py`` states (read, not imported), and its
    docstring."""
    tree = ast.parse((ROOT / folder / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            "LAYERS"
        ]:
            return list(ast.literal_eval(node.value)), ast.get_docstring(tree) or ""
    raise AssertionError(f"{folder}/__init__.py states no LAYERS")


def one_way(folder: str, layers: list[str]) -> set[str]:
    """The arrows inside ``folder`` that run up ``layers``."""
    init = ROOT / folder / "__init__.py"
    package = package_of(init)
    wrong = set()
    for layer in layers:
        rank = layers.index(layer)
        for m in kvrt_imports(ROOT / folder / f"{layer}.py"):
            if m.startswith(package + "."):
                other = m[len(package) + 1 :].split(".")[0]
                if other in layers and layers.index(other) < rank:
                    wrong.add(f"{layer} -> {other}")
    return wrong


@pytest.mark.parametrize("folder", PACKAGES)
def test_each_package_states_its_order_and_keeps_it(folder: str) -> None:
    """A package's modules are its ``LAYERS``, each importing only those after it, and
    its docstring names them (``:mod:`.name```) in that order."""
    layers, doc = stated_layers(folder)
    found = sorted(p.stem for p in (ROOT / folder).glob("*.py") if p.stem != "__init__")
    assert sorted(layers) == found
    assert not one_way(folder, layers)
    named = list(dict.fromkeys(re.findall(r":mod:`\.(\w+)`", doc)))
    assert named == layers


def test_every_package_is_held() -> None:
    packages = {
        str(p.parent.relative_to(ROOT))
        for folder in ("kvrt", "adapters", "native_bridge", "policies")
        for p in (ROOT / folder).rglob("__init__.py")
        if "__pycache__" not in p.parts and len(list(p.parent.glob("*.py"))) > 1
    }
    assert packages - {"kvrt"} == set(PACKAGES)


def test_every_module_stays_small() -> None:
    """No module of the package (its adapters, bridge and policies too) is over 500
    lines."""
    paths = [
        p for folder in ("kvrt", "adapters", "native_bridge", "policies") for p in modules(folder)
    ]
    assert len(paths) > 150
    large = {
        str(p.relative_to(ROOT)): n for p in paths if (n := len(p.read_text().splitlines())) >= 500
    }
    assert large == {}


def test_the_placement_planner_is_pure() -> None:
    """The planner decides from a snapshot: nothing it imports can await, call an engine
    or reach the session's state (its tests need no model)."""
    planner = ROOT / "kvrt" / "_paging" / "planner.py"
    allowed = {"__future__", "collections.abc", "dataclasses", "kvrt._types"}
    wrong = {
        m for m in imports(planner) if not any(m == a or m.startswith(f"{a}.") for a in allowed)
    }
    assert not wrong
    tree = ast.parse(planner.read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.AsyncFunctionDef, ast.Await))]


def test_the_session_parts_are_composed_not_inherited() -> None:
    """The actor holds its gate, paging, scoring, placement and generation; none of them
    is a base class of another (an inheritance tower hides who calls whom)."""
    trees = {
        p: ast.parse(p.read_text()) for p in modules("kvrt/_session") + modules("kvrt/_paging")
    }
    classes = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    assert {"Actor", "EngineGate", "Paging", "Placement", "Generation"} <= classes
    wrong = {
        f"{p.stem}.{n.name}({ast.unparse(base)})"
        for p, t in trees.items()
        for n in ast.walk(t)
        if isinstance(n, ast.ClassDef)
        for base in n.bases
        if ast.unparse(base).split(".")[-1] in classes
    }
    assert not wrong


def test_tallies_are_returned_never_shared() -> None:
    """What a command did is the sum of what its moves return: no part of a session holds
    a tally for others to write into, and every move of the executor returns its own."""
    trees = {
        p: ast.parse(p.read_text()) for p in modules("kvrt/_session") + modules("kvrt/_paging")
    }
    shared = [
        f"{p.stem}:{n.lineno}"
        for p, t in trees.items()
        for n in ast.walk(t)
        if isinstance(n, ast.Attribute) and n.attr == "tally"
    ]
    assert not shared
    paging = next(
        n
        for n in trees[ROOT / "kvrt" / "_paging" / "moves.py"].body
        if isinstance(n, ast.ClassDef) and n.name == "Paging"
    )
    moves = {
        n.name: ast.unparse(n.returns) if n.returns else ""
        for n in paging.body
        if isinstance(n, ast.AsyncFunctionDef)
    }
    assert len(moves) >= 8
    copies = {name for name, returns in moves.items() if "Tally" not in returns}
    assert copies == {"write_back", "share"}  # copies (tokens copied), not moves


def test_the_cold_store_stands_below_the_sessions() -> None:
    """``kvrt/_cold`` (the store and its tiers) knows nothing of sessions or the runtime,
    and the store knows the tiers below RAM only through the ``ColdTier`` protocol (an
    ordered list), never by kind; its modules' order is its own ``LAYERS``."""
    store = (ROOT / "kvrt" / "_cold" / "store.py").read_text()
    assert not re.findall(r"\b(?:DiskTier|RemoteTier)\b|self\.(?:disk|remote)\b", store)
    wrong = set()
    for path in modules("kvrt/_cold"):
        for m in kvrt_imports(path):
            if m.startswith(
                ("kvrt._session", "kvrt._paging", "kvrt._runtime", "kvrt.cli", "kvrt.serve")
            ):
                wrong.add(f"{path.name} -> {m}")
    assert not wrong


def test_the_reader_sees_a_wrong_arrow() -> None:
    """The checks can fail: the reader sees imports, relative ones resolved."""
    source = ROOT / "adapters" / "_window.py"
    assert any(m.startswith("kvrt.backend") for m in kvrt_imports(source))
    handle = ROOT / "kvrt" / "_session" / "handle.py"
    assert "kvrt._session.actor" in kvrt_imports(handle)
    gate = ROOT / "kvrt" / "_paging" / "gate.py"
    assert "kvrt._paging.window" in kvrt_imports(gate)
    layers, _ = stated_layers("kvrt/_session")
    assert "handle -> actor" in one_way("kvrt/_session", layers[::-1])


def test_every_public_struct_documents_itself_and_its_fields() -> None:
    """``help()`` on a public Struct shows its docstring and every field's."""
    import pydoc

    import msgspec

    import kvrt

    structs = [
        getattr(kvrt, name)
        for name in kvrt.__all__
        if isinstance(getattr(kvrt, name), type) and issubclass(getattr(kvrt, name), msgspec.Struct)
    ]
    assert len(structs) > 20
    for struct in structs:
        shown = pydoc.render_doc(struct, renderer=pydoc.plaintext)  # type: ignore[attr-defined]
        intro = (struct.__doc__ or "").split("Fields:")[0].strip()
        assert intro, f"{struct.__name__} has no docstring"
        fields = (struct.__doc__ or "").split("Fields:")[-1]
        for field in struct.__struct_fields__:
            entry = fields.split(f"\n{field} (", 1)
            assert len(entry) == 2, f"{struct.__name__}.{field} is not listed"
            described = entry[1].split("\n")[1] if "\n" in entry[1] else ""
            assert described.startswith("    ") and described.strip(), (
                f"{struct.__name__}.{field} has no description"
            )
        assert "Fields:" in shown


def test_the_public_names_are_listed() -> None:
    from types import ModuleType

    import kvrt

    names = {n for n in dir(kvrt) if not n.startswith("_")}
    public = {n for n in names if not isinstance(getattr(kvrt, n), ModuleType)}
    assert set(kvrt.__all__) == public | {"backend", "cold", "models", "policy"}
    assert {"backend", "policy", "Session", "Segment", "open_runtime"} <= set(kvrt.__all__)


def test_the_api_translators_are_pure() -> None:
    """``kvrt/serve/protocol`` turns bodies into calls and results into bodies: no web
    framework, no event loop, no threads or locks, nothing of the server around it; the
    state store reads it, never the reverse."""
    impure = {"starlette", "anyio", "asyncio", "trio", "threading", "hypercorn", "httpx"}
    paths = modules("kvrt/serve/protocol")
    assert len(paths) >= 5
    wrong = {
        f"{p.relative_to(ROOT)} -> {m}"
        for p in paths
        for m in imports(p)
        if m.split(".")[0] in impure
        or (m.startswith("kvrt.serve") and not m.startswith("kvrt.serve.protocol"))
    }
    assert not wrong
    assert not [p for p in paths if "Lock(" in p.read_text()]
    state = modules("kvrt/serve/state")
    reach = {
        f"{p.relative_to(ROOT)} -> {m}"
        for p in state
        for m in kvrt_imports(p)
        if m.startswith("kvrt.serve")
        and not m.startswith(("kvrt.serve.state", "kvrt.serve.protocol"))
    }
    assert not reach


ROLES = {
    "KIND": "the kind of policy a policy module registers",
    "add": "a command of the command line registering its parser",
    "main": "a command's (or a figure script's) entry point",
    "T": "a type variable",
    "Ts": "a type variable",
    "log": "a module's logger",
    "write": "a model writer of kvrt.testing",
    "kernel_verdict": "an engine's kernel probe",
    "measure": "an engine's kernel probe",
    "TEXT": "an engine's kernel probe",
    "SEED": "an engine's kernel probe",
    "CUT": "an engine's kernel probe",
    "LONE": "an engine's kernel probe",
    "SEQUENCES": "an engine's kernel probe",
    "STEPS": "an engine's kernel probe",
    "REFERENCE_NAME": "an engine's reference without kvrt",
    "TRACE_NAMES": "an engine's reference without kvrt",
    "reference_greedy_tps": "an engine's reference (and kvrt.bench's way to it)",
    "reference_trace": "an engine's reference (and kvrt.bench's way to it)",
    "MAX_SALT": "the cache_salt bound, restated by the server (it imports public kvrt only)",
}
"""Names several modules define on purpose, each in the same role."""


def test_no_two_modules_define_the_same_public_name() -> None:
    """One word, one meaning: a public name is defined by one module, unless it names
    the same role in each (:data:`ROLES`)."""
    where: dict[str, list[str]] = {}
    for folder in ("kvrt", "adapters", "native_bridge", "policies"):
        for path in modules(folder):
            if path.name == "__init__.py" or (
                folder == "kvrt" and path.relative_to(ROOT / "kvrt").parts[0] in GENERIC
            ):
                continue
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    names = [node.name]
                elif isinstance(node, ast.Assign):
                    names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names = [node.target.id]
                else:
                    names = []
                for name in names:
                    if not name.startswith("_") and name not in ROLES:
                        where.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}
