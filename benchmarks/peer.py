"""``kvrt serve`` beside ``llama-server``, llama.cpp's own server with its host-memory
prompt cache, on the peer's own workloads, side by side in one run.

Every server runs pinned to one core (one engine thread, 4096 tokens a session or slot),
greedy, streamed; this process sends from the other cores. Two workloads:

- **agents taking turns**: four agents, each with its own system prompt of 600 to 900
  tokens, take turns on one server, six turns each, every request sending the whole
  conversation and asking for 16 tokens;
- **concurrent chat**: eight chats at once (prompts of about 335 tokens, 64 tokens each),
  two rounds, the second sending back the first's reply with a new question.

Servers: ``kvrt serve`` at its defaults and with ``--idle-sessions 0`` (an idle session
goes to the cold store when another conversation is served alone), a kvrt reference that
restores nothing, ``llama-server -np 1`` (one slot, its host cache on, the default),
``-np N`` (a slot per agent or chat) and ``-np 1 --cache-ram 0`` (no host cache: it
computes every switch anew). Each reference serves one request at a time and computes it
whole: its replies are a fresh server's, which the others' replies are compared with.

For each: wall time, tokens computed (kvrt's ``prefilled_tokens``, llama-server's
``timings.prompt_n``), time to the first token (p50 and p90 over requests), the server
process's peak RSS (``VmHWM``), and how many replies equal the reference's; then kvrt's
ratios against the peer's best.

Every reply is its full length on every server (``--equal-work``, the default: a logit
bias of -100 on the model's end tokens, which both servers honour), so tokens/s compares
the same work. ``--model sized`` serves a random-weight 1B llama (Llama 3.2 1B's shape,
q4_0, written once by :mod:`kvrt.testing.sized`): decoding there reads the weights, not
the arithmetic, which is where serving sessions together pays.

    python -m benchmarks.peer [--agents 4] [--turns 6] [--chats 8] [--rounds 2]
        [--model PATH|sized] [--no-equal-work]

``llama-server`` is found or built once (:mod:`benchmarks._peer`, about five minutes on
two cores). Figures to read, not assertions; every figure is measured in this run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks._peer import PeerUnavailable, llama_server
from benchmarks.tool_loop import free_port

SLOT_TOKENS = 4096

TOPICS = [
    "lighthouses", "tide tables", "river barges", "glacier travel", "orchard pests",
    "railway signals", "beekeeping", "bridge inspection", "harbour pilots", "mountain huts",
]  # fmt: skip

SENTENCES = [
    "Keep every answer short and concrete, and name the step the user should take next.",
    "When a question is unclear, ask one question back before giving advice.",
    "Quote figures with their units and say where a figure is an estimate.",
    "Never invent a regulation; say which authority would know instead.",
    "Prefer the safe option when two options cost about the same.",
    "Write dates as day, month and year, and times on a 24-hour clock.",
    "List at most three options, the most common one first.",
    "Say plainly when something is outside the subject you know.",
]


def system_prompt(agent: int, words: int) -> str:
    """An agent's own system prompt: its topic, then rules, about ``words`` words."""
    topic = TOPICS[agent % len(TOPICS)]
    parts = [f"You are assistant number {agent + 1}, an expert on {topic}."]
    n = 0
    while sum(len(p.split()) for p in parts) < words:
        sentence = SENTENCES[(agent * 3 + n) % len(SENTENCES)]
        parts.append(f"Rule {n + 1} on {topic}: {sentence}")
        n += 1
    return " ".join(parts)


def question(agent: int, turn: int) -> str:
    topic = TOPICS[agent % len(TOPICS)]
    return f"Question {turn + 1} about {topic}: what should a beginner check first, and why?"


# -- servers --


@dataclass
class Server:
    """One server to measure: its label and how to start it on a port."""

    label: str
    command: Callable[[int], list[str]]
    kind: str  # "kvrt" or "llama-server"


def kvrt_server(label: str, model: Path, *extra: str) -> Server:
    def command(port: int) -> list[str]:
        return [
            sys.executable, "-m", "kvrt", "serve", "--port", str(port), "--model", str(model),
            "--model-name", "model", "--session-tokens", str(SLOT_TOKENS),
            "--disk-budget", "0", *extra,
        ]  # fmt: skip

    return Server(label, command, "kvrt")


def peer_server(label: str, binary: Path, model: Path, slots: int, *extra: str) -> Server:
    def command(port: int) -> list[str]:
        return [
            str(binary), "-m", str(model), "--port", str(port), "--host", "127.0.0.1",
            "-t", "1", "-tb", "1", "-c", str(SLOT_TOKENS * slots), "-np", str(slots),
            "--alias", "model", "--no-webui", *extra,
        ]  # fmt: skip

    return Server(label, command, "llama-server")


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    port: int

    def peak_rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return float("nan")


def start(server: Server, core: int, log: Any) -> Running:
    port = free_port()
    proc = subprocess.Popen(
        server.command(port),
        stdout=log,
        stderr=log,
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-600:]
            raise RuntimeError(f"{server.label} did not start: {tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return Running(proc, port)
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{server.label} did not answer within 300 s")
        time.sleep(0.25)


# -- one request --


@dataclass
class Reply:
    text: str
    first_token_s: float
    seconds: float
    computed: int
    generated: int


NO_END: dict[str, float] = {}
"""A logit bias that keeps a model from ending its reply (``--equal-work``): every reply
is ``max_tokens`` long on every server, so tokens/s compares the same work."""


def chat(port: int, messages: Sequence[dict[str, str]], max_tokens: int) -> Reply:
    """One streamed, greedy chat request; its reply and what the server reports."""
    request: dict[str, Any] = {
        "model": "model",
        "messages": list(messages),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if NO_END:
        request["logit_bias"] = NO_END
    body = json.dumps(request)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    began = time.perf_counter()
    first = None
    text, computed, generated = "", 0, 0
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - began
                text += piece
            usage = chunk.get("usage") or {}
            if usage:
                generated = usage.get("completion_tokens", generated)
                computed = (usage.get("kvrt") or {}).get("prefilled_tokens", computed)
            if "timings" in chunk:  # llama-server's own count
                computed = chunk["timings"].get("prompt_n", computed)
    finally:
        conn.close()
    seconds = time.perf_counter() - began
    return Reply(text, first if first is not None else seconds, seconds, computed, generated)


# -- workloads --


@dataclass
class Outcome:
    wall: float = 0.0
    replies: list[str] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    later_first_token: list[float] = field(default_factory=list)
    computed: int = 0
    generated: int = 0
    rss_mib: float = 0.0


def agents_taking_turns(port: int, agents: int, turns: int) -> Outcome:
    conversations = [
        [{"role": "system", "content": system_prompt(a, 450 + 150 * (a % 3))}]
        for a in range(agents)
    ]
    out = Outcome()
    began = time.perf_counter()
    for turn in range(turns):
        for a, messages in enumerate(conversations):
            messages.append({"role": "user", "content": question(a, turn)})
            reply = chat(port, messages, 16)
            messages.append({"role": "assistant", "content": reply.text})
            out.replies.append(reply.text)
            out.first_token.append(reply.first_token_s)
            out.computed += reply.computed
            out.generated += reply.generated
    out.wall = time.perf_counter() - began
    return out


def concurrent_chat(port: int, chats: int, rounds: int, *, at_once: bool = True) -> Outcome:
    conversations = [
        [
            {"role": "system", "content": system_prompt(c, 230)},
            {"role": "user", "content": question(c, 0)},
        ]
        for c in range(chats)
    ]
    out = Outcome()
    replies: list[list[Reply]] = [[] for _ in range(chats)]
    lock = threading.Lock()

    def one(c: int, round_: int) -> None:
        messages = conversations[c]
        if round_:
            messages.append({"role": "assistant", "content": replies[c][-1].text})
            messages.append({"role": "user", "content": question(c, round_)})
        reply = chat(port, messages, 64)
        with lock:
            replies[c].append(reply)

    began = time.perf_counter()
    for round_ in range(rounds):
        if not at_once:
            for c in range(chats):
                one(c, round_)
            continue
        threads = [threading.Thread(target=one, args=(c, round_)) for c in range(chats)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    out.wall = time.perf_counter() - began
    for c in range(chats):
        for round_, reply in enumerate(replies[c]):
            out.replies.append(reply.text)
            out.first_token.append(reply.first_token_s)
            if round_:
                out.later_first_token.append(reply.first_token_s)
            out.computed += reply.computed
            out.generated += reply.generated
    return out


def measure(server: Server, work: Callable[[int], Outcome], core: int) -> Outcome | str:
    """``work`` against a fresh ``server``: its outcome with the server's peak RSS, or
    why it could not run."""
    with tempfile.TemporaryFile() as log:
        try:
            running = start(server, core, log)
        except RuntimeError as exc:
            return str(exc)
        try:
            out = work(running.port)
            out.rss_mib = running.peak_rss_mib()
            return out
        finally:
            running.proc.terminate()
            try:
                running.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                running.proc.kill()


# -- report --


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def table(
    title: str, rows: dict[str, Outcome | str], kinds: dict[str, str], tokens_per_s: bool
) -> None:
    """The rows; ``= fresh`` compares each server's replies with the reference of its
    kind (the row named ``kinds[kind]``, which computed every request anew)."""
    print(f"\n{title}")
    head = f"{'server':<40} {'wall':>7} {'computed':>9} {'1st tok p50':>11} {'p90':>7}"
    head += f" {'tokens':>6} {'tok/s':>6} {'later p50':>9}" if tokens_per_s else ""
    head += f" {'peak RSS':>9} {'= fresh':>8}"
    print(head)
    for label, out in rows.items():
        if isinstance(out, str):
            print(f"{label:<40} did not run: {out[:200]}")
            continue
        ref = rows.get(kinds["kvrt" if label.startswith("kvrt") else "llama-server"])
        same = "-"
        if isinstance(ref, Outcome):
            equal = sum(a == b for a, b in zip(out.replies, ref.replies, strict=True))
            same = f"{equal}/{len(ref.replies)}"
        line = f"{label:<40} {out.wall:>6.1f}s {out.computed:>9} "
        line += f"{quantile(out.first_token, 0.5):>10.2f}s {quantile(out.first_token, 0.9):>6.2f}s"
        if tokens_per_s:
            line += f" {out.generated:>6} {out.generated / out.wall:>6.1f}"
            line += f" {quantile(out.later_first_token, 0.5):>8.2f}s"
        line += f" {out.rss_mib:>5.0f} MiB {same:>8}"
        print(line)


def ratios(
    rows: dict[str, Outcome | str],
    ours: str,
    peers: Sequence[str],
    one_slot: str,
    *,
    tokens_per_s: bool,
) -> None:
    mine = rows.get(ours)
    theirs = [rows[p] for p in peers if isinstance(rows.get(p), Outcome)]
    single = rows.get(one_slot)
    if not isinstance(mine, Outcome) or not theirs:
        return
    best_wall = min(o.wall for o in theirs if isinstance(o, Outcome))
    best_p50 = min(quantile(o.first_token, 0.5) for o in theirs if isinstance(o, Outcome))
    best_p90 = min(quantile(o.first_token, 0.9) for o in theirs if isinstance(o, Outcome))
    best_tps = max(o.generated / o.wall for o in theirs if isinstance(o, Outcome))
    print(
        f"{ours}: wall {mine.wall / best_wall:.2f}x the peer's best, first token p50 "
        f"{quantile(mine.first_token, 0.5) / best_p50:.2f}x, p90 "
        f"{quantile(mine.first_token, 0.9) / best_p90:.2f}x"
        + (f", tokens/s {mine.generated / mine.wall / best_tps:.2f}x" if tokens_per_s else "")
        + (
            f", peak RSS {mine.rss_mib / single.rss_mib:.2f}x {one_slot}'s"
            if isinstance(single, Outcome)
            else ""
        )
    )


def model_path(name: str) -> Path:
    """The GGUF to serve: ``name``, the embedded model, or (``sized``) a random-weight 1B
    llama written once into kvrt's cache folder."""
    import kvrt

    if not name:
        return kvrt.embedded_model_path()
    if name == "sized":
        from kvrt.testing import sized

        home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        cache = os.environ.get("KVRT_CACHE_DIR") or Path(home) / "kvrt"
        return sized.write(Path(cache) / "bench")
    return Path(name)


def end_bias(model: Path) -> dict[str, float]:
    """A logit bias of -100 on every token that ends generation on ``model``."""
    import kvrt

    engine = kvrt.load_engine("llama", config=kvrt.load_config(flags={"model": str(model)}))
    try:
        n = engine.facts.n_vocab
        return {str(t): -100.0 for t in range(n) if engine.is_end_of_generation(t)}
    finally:
        engine.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--model",
        default="",
        help="a GGUF file, or 'sized' for a random-weight 1B llama written once "
        "(kvrt.testing.sized; default: the embedded model)",
    )
    parser.add_argument(
        "--equal-work",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep every reply at its full length (a logit bias against the end tokens)",
    )
    parser.add_argument(
        "--only", default="", help="comma-separated server labels to run (default: all)"
    )
    parser.add_argument(
        "--workloads", default="agents,chats", help="which to run: agents, chats or both"
    )
    parser.add_argument(
        "--no-build", action="store_true", help="measure kvrt alone when llama-server is not built"
    )
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # tables as they come

    model = model_path(args.model)
    if args.equal_work:
        NO_END.update(end_bias(model))
    cores = sorted(os.sched_getaffinity(0))
    core = cores[0]
    if len(cores) > 1:
        os.sched_setaffinity(0, set(cores[1:]))  # the clients stay off the server's core
    try:
        binary: Path | None = llama_server(build=not args.no_build)
    except PeerUnavailable as exc:
        print(f"llama-server: {exc}")
        binary = None

    # References: every request computed anew (kvrt restoring nothing and paging at every
    # switch; llama-server with no host cache), one request at a time.
    fresh = {"kvrt": "kvrt serve, nothing reused (reference)"}
    fresh_kvrt = kvrt_server(
        fresh["kvrt"], model, "--max-sessions", "1", "--restore-policy", "never"
    )

    def servers(slots: int) -> list[Server]:
        out = [
            kvrt_server("kvrt serve", model),
            kvrt_server("kvrt serve --idle-sessions 0", model, "--idle-sessions", "0"),
            fresh_kvrt,
        ]
        if binary is not None:
            fresh["llama-server"] = "llama-server -np 1 --cache-ram 0"
            out += [
                peer_server("llama-server -np 1", binary, model, 1),
                peer_server(f"llama-server -np {slots}", binary, model, slots),
                peer_server(fresh["llama-server"], binary, model, 1, "--cache-ram", "0"),
            ]
        only = {label.strip() for label in args.only.split(",") if label.strip()}
        return [s for s in out if not only or s.label in only]

    # The kernel probe runs once per machine, model and thread count (its record is kept):
    # run it here, on the servers' core, so no server's start or peak RSS counts it.
    subprocess.run(
        [sys.executable, "-m", "kvrt", "describe", "--model", str(model)],
        check=True,
        stdout=subprocess.DEVNULL,
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )
    print(
        f"model {Path(model).name}; servers on core {core}, one thread, {SLOT_TOKENS} tokens a slot"
        + ("; every reply at its full length" if NO_END else "")
    )

    workloads = {w.strip() for w in args.workloads.split(",")}
    if "agents" in workloads:
        run_agents(args, servers(args.agents), fresh, core)
    if "chats" in workloads:
        run_chats(args, servers(args.chats), fresh, core)
    print("\n= fresh: replies equal to those of the reference of the server's kind, which")
    print("computes every request anew (kvrt: restoring nothing; llama-server: no host cache)")


def run_agents(
    args: argparse.Namespace, servers: Sequence[Server], fresh: dict[str, str], core: int
) -> None:
    agents: dict[str, Outcome | str] = {}
    for server in servers:
        work = partial(agents_taking_turns, agents=args.agents, turns=args.turns)
        agents[server.label] = measure(server, work, core)
    table(
        f"agents taking turns: {args.agents} agents x {args.turns} turns, 16 tokens a reply",
        agents, fresh, tokens_per_s=False,
    )  # fmt: skip
    peers = ["llama-server -np 1", f"llama-server -np {args.agents}"]
    for ours in ("kvrt serve", "kvrt serve --idle-sessions 0"):
        ratios(agents, ours, peers, "llama-server -np 1", tokens_per_s=False)


def run_chats(
    args: argparse.Namespace, servers: Sequence[Server], fresh: dict[str, str], core: int
) -> None:
    chats: dict[str, Outcome | str] = {}
    for server in servers:
        if server.label == "llama-server -np 1":
            continue  # one slot serves the chats one at a time
        alone = server.label in fresh.values()  # the references: one chat at a time
        work = partial(concurrent_chat, chats=args.chats, rounds=args.rounds, at_once=not alone)
        chats[server.label] = measure(server, work, core)
    table(
        f"concurrent chat: {args.chats} chats x {args.rounds} rounds, 64 tokens a reply "
        "(the references one chat at a time)",
        chats, fresh, tokens_per_s=True,
    )  # fmt: skip
    one_each = f"llama-server -np {args.chats}"
    for ours in ("kvrt serve", "kvrt serve --idle-sessions 0"):
        ratios(chats, ours, [one_each], one_each, tokens_per_s=True)


if __name__ == "__main__":
    main()
