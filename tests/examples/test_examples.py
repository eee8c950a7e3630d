"""The examples and the main demo run as they are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import pytest

import kvrt
from benchmarks.blend import run_blend_bench
from benchmarks.fidelity import CASES, CONDITIONS, plot_fidelity, print_fidelity, run_fidelity_bench
from benchmarks.ruler import TASKS
from tests.support.models import zoo_path

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.subprocess, pytest.mark.model]


def run(*args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=None if env is None else {**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def example(name: str, *args: str, env: dict[str, str] | None = None) -> str:
    return run(str(ROOT / "examples" / name), *args, env=env)


def on_the_zoo() -> dict[str, str]:
    """The environment that runs an example, unchanged, on the zoo's tiny llama (its
    tokenizer and chat template, ~100x faster): for the examples whose checks are about
    the runtime's paths, not the model's text."""
    return {"KVRT_MODEL": zoo_path("llama")}


def test_evict_and_restore_example() -> None:
    out = example("evict_and_restore.py")
    assert "logits while evicted equal the reference: False" in out
    assert "logits after restore equal the reference bit for bit: True" in out


def test_describe_example() -> None:
    assert "KV bytes per token: 23,040" in example("describe_model.py")


@pytest.mark.slow
def test_concurrent_sessions_example() -> None:
    out = example("concurrent_sessions.py", "llama", env=on_the_zoo())
    assert out.count("consistent: True") == 3
    assert "exact hits" in out


def test_trio_sessions_example() -> None:
    # The examples take the engine as an argument; OpenVINO runs through `kvrt bench` below.
    assert example("trio_sessions.py", "llama", env=on_the_zoo()).count("consistent True") == 2


@pytest.mark.parametrize("backend", ["llama"])  # OpenVINO: its session tests, and the bench
def test_kvrt_run_restores_the_resent_file(backend: str) -> None:
    argv = [
        "-m",
        "kvrt",
        "run",
        "--sessions",
        "2",
        "--max-tokens",
        "4",
        "--json",
        "--backend",
        backend,
    ]
    proc = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    # Not a terminal: a line a turn; and a disk tier of its own (a first turn is a first).
    assert "disk tier: a fresh folder for this run" in proc.stderr
    assert proc.stderr.count(" done (") == 6 and "(6/6," in proc.stderr, proc.stderr
    assert report["combined_logical_tokens"] > 2 * report["hot_tokens"]
    for session in report["sessions"]:
        first, _, third = session["turns"]
        assert first["file"] == third["file"]
        assert third["status"]["restored_tokens"] > 0
        # Only the question (and the one token recomputed for logits) is computed again.
        assert third["status"]["prefilled_tokens"] < 40
        assert all(t["status"]["hot_tokens"] <= session["hot_budget"] for t in session["turns"])
        assert all(t["text"] for t in session["turns"])


def test_kvrt_ask_reads_a_document_past_the_trained_context(tmp_path: Path) -> None:
    """On the zoo's llama trained on 256 tokens: a document many times that is read a
    window at a time (a line on stderr, not a terminal) and answered, labelled
    approximate; files it cannot read are one line and exit status 2."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The grass is green. The sky is blue. " * 300)
    model = zoo_path("llama", context=256)
    flags = ["--model", model, "--hot-tokens", "256", "--block-tokens", "32", "--disk-budget", "0"]
    argv = [*flags, "--max-tokens", "4", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvrt", "ask", str(doc), "-q", "What colour is the sky?", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    status = report["status"]
    assert status["logical_tokens"] > 8 * 256 and not status["exact"]
    assert status["long"]["shown_tokens"] <= 256
    assert status["long"]["computed_tokens"] > 8 * 256
    assert "tokens read" in proc.stderr
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe not text")
    for bad in ("bad.txt", "missing.txt"):
        proc = subprocess.run(
            [sys.executable, "-m", "kvrt", "ask", str(tmp_path / bad), "-q", "?", *flags],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )
        assert proc.returncode == 2 and proc.stderr.startswith("kvrt: error: ")
        assert len(proc.stderr.strip().splitlines()) == 1 and bad in proc.stderr


def test_kvrt_run_on_a_recurrent_model_holds_the_context_and_restores_the_prefix() -> None:
    """Mamba-2 pages nothing out of its window: the demo's window holds each whole
    context, and the file sent again comes back as the state after it."""
    argv = ["-m", "kvrt", "run", "--model", zoo_path("mamba2"), "--sessions", "1"]
    report = json.loads(run(*argv, "--max-tokens", "2", "--disk-budget", "0", "--json"))
    (session,) = report["sessions"]
    first, _, third = session["turns"]
    assert first["file"] == third["file"]
    assert session["hot_budget"] >= max(t["status"]["logical_tokens"] for t in session["turns"])
    assert third["status"]["exact"] and third["status"]["restored_tokens"] > 0
    assert third["status"]["prefilled_tokens"] < 40


@pytest.mark.parametrize(
    ("backend", "turns", "sessions"),
    [
        pytest.param("llama", 3, [1, 2], id="llama"),
        pytest.param("openvino", 2, [1], id="openvino"),
    ],
)
def test_kvrt_bench_reports_every_section_and_plots(
    backend: str, turns: int, sessions: list[int], tmp_path: Path
) -> None:
    """Every section on both engines, on the zoo's tiny llama: the path, not the figures
    (OpenVINO with fewer turns and sessions: suite time)."""
    png = tmp_path / "bench.png"
    argv = ["-m", "kvrt", "bench", "--model", zoo_path("llama")]
    argv += ["--sizes", "16,64", "--turns", str(turns)]
    argv += ["--sessions", ",".join(map(str, sessions))]
    argv += ["--tokens", "256", "--decode", "8", "--json", "--plot", str(png)]
    report = json.loads(run(*argv, "--backend", backend))
    crossover = report["crossover"]
    assert [p["tokens"] for p in crossover["points"]] == [16, 64]
    assert all(p["restore_ms"] > 0 and p["recompute_ms"] > 0 for p in crossover["points"])
    assert crossover["calibrated_restores"] > 0 and crossover["calibrated_prefills"] > 0
    trace = report["trace"]
    names = [s["name"] for s in trace["systems"]]
    assert names[:2] == ["kvrt", "kvrt, approximate hits allowed"]
    if backend == "llama":
        assert names[2:] == ["llama_cpp.Llama", "llama_cpp.Llama + LlamaRAMCache"]
    assert all(len(s["ttft_ms"]) == turns for s in trace["systems"])
    assert set(trace["prefill_ratios"]) == set(names[2:])
    assert [p["sessions"] for p in report["sessions"]] == sessions
    assert all(p["cold_peak_bytes"] <= p["cold_budget_bytes"] for p in report["sessions"])
    assert report["quick"]["segment_tokens"] > 200
    # Each goal is read from the figures reported beside it.
    goals = {g["figure"]: g for g in report["goals"]}
    quick = report["quick"]
    decode = goals[f"decode through a session vs {quick['reference']}"]
    assert decode["met"] is (quick["decode_ratio"] >= 0.95)
    ttft = goals[f"time to first token, re-sent {quick['segment_tokens']}-token segment"]
    assert ttft["met"] is (quick["ttft_speedup"] >= 100)
    assert len(goals) == 4 + 2 * len(trace["prefill_ratios"])
    assert report["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_agent_example_reuses_each_turn() -> None:
    out = example("chat_agent.py", "llama")
    cached = [
        int(line.split(" cached")[0].split()[-1]) for line in out.splitlines() if " cached," in line
    ]
    assert len(cached) == 3 and cached[0] == 0 and all(c > 0 for c in cached[1:])


def test_openai_client_example_against_kvrt_serve() -> None:
    out = example("openai_client.py")
    cached = [
        int(line.split(":")[-1].rstrip("]")) for line in out.splitlines() if "cached prompt" in line
    ]
    assert len(cached) == 3 and cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]


def test_pytest_trio_suite_example() -> None:
    # -n 0: the example is a user's own suite, run as theirs (not with this project's workers)
    argv = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0"]
    out = run(*argv, str(ROOT / "examples" / "pytest_trio_suite"))
    assert "3 passed" in out


def test_the_tiers_benchmark_measures_every_tier() -> None:
    argv = ["-m", "benchmarks.tiers", "--model", zoo_path("llama"), "--sizes", "64"]
    argv += ["--tokens", "128", "--decode", "4"]
    report = json.loads(run(*argv, "--json"))
    (row,) = report["rows"]
    assert row["tokens"] == 64 and row["bytes"] > 0
    for figure in ("ram_ms", "disk_ms", "disk_read_ms", "plain_read_ms", "recompute_ms"):
        assert row[figure] > 0, figure
    assert (row["remote_ms"] is not None) == report["remote"].startswith("a local redis-server")
    assert (row["remote_signed_ms"] is not None) == (row["remote_ms"] is not None)
    assert row["sign_ms"] > 0
    assert report["restart_restored_tokens"] >= 128  # the restarted process read the disk
    assert report["ttft_restarted_disk_ms"] > 0 and report["ttft_restarted_recomputed_ms"] > 0
    assert report["spilled_blocks"] > 0 and report["decode_tps_quiet"] > 0


def test_the_long_context_benchmark_reports_every_cell() -> None:
    """On the zoo's llama trained on 256 tokens: prompts four times that (and a short
    one, which the larger window holds whole; multi-key at the long length only), two
    windows."""
    argv = ["-m", "benchmarks.long_context", "--model", zoo_path("llama", context=256)]
    argv += ["--tasks", "passkey,multi_key@1024", "--lengths", "120,1024"]
    argv += ["--windows", "128,256", "--prompts", "2", "--no-full", "--json"]
    env = {"KVRT_BLOCK_TOKENS": "32", "KVRT_RECENT_TOKENS": "32"}
    cells = json.loads(run(*argv, env=env))
    assert [(c["task"], c["length"], c["condition"]) for c in cells] == [
        (task, n, f"kvrt@{w}")
        for task, lengths in (("passkey", (120, 1024)), ("multi_key", (1024,)))
        for n in lengths
        for w in (128, 256)
    ]
    for cell in cells:
        assert cell["prompts"] == 2
        assert cell["shown"] in (0.0, 0.5, 1.0)  # the needles' blocks, looked up per prompt
        if cell["length"] == 120 and cell["condition"] == "kvrt@256":
            assert cell["shown"] == 1.0  # the whole context is in the window
        assert cell["ingest_tps"] > 0 and cell["follow_up_s"] > 0
        # Blocks are chosen (and the choice timed) past the trained context only.
        assert (cell["scoring_ms"] is not None) == (cell["length"] == 1024)
        assert cell["scoring_ms"] is None or cell["scoring_ms"] > 0
        assert cell["disk_mib"] is not None and 0 < cell["peak_rss_mib"] < cell["bound_mib"]


def test_the_flash_benchmark_compares_both_settings_with_llama_cpp() -> None:
    """Under either setting kvrt's logits equal ``llama_cpp.Llama``'s with the same one;
    without flash attention they do not depend on how the prompt was cut into batches."""
    argv = ["-m", "benchmarks.flash", "--model", zoo_path("llama"), "--tokens", "512"]
    report = json.loads(run(*argv, "--json"))
    off, on = report["points"]
    assert (off["flash_attention"], on["flash_attention"]) == (False, True)
    for point in (off, on):
        assert point["reference_logits_identical"] and point["reference_greedy_equal"]
        assert point["restore_gbps"] > 0 and point["prefill_tps"] > 0
    assert off["chunked_logits_identical"]
    assert report["off_vs_on_max_delta"] > 0  # flash attention computes differently


def test_the_fidelity_benchmark_reports_every_condition(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Every case and condition of a task in process on the zoo's tiny llama (its command's
    own path is checked by its refusal below; the passkey test on the real model is its
    own, test_relevance; every task's prompts, test_ruler). Nothing leaks: a session of a
    context that never fitted computed all of it itself; in the body-computed-whole case
    every windowed session computed the question itself."""
    config = kvrt.load_config(flags={"model": zoo_path("llama")})
    tasks = TASKS
    report = anyio.run(
        lambda: run_fidelity_bench(config, sizes=(1536,), tasks=tasks, prompts=1, blend=False)
    )
    assert report.blend == []
    names = {(c.task, c.case, c.condition) for c in report.cells}
    windowed = [n for n, hot, _ in CONDITIONS if hot is not None]
    assert names == {(t, "full", "full") for t in tasks} | {
        (t, case, n) for t in tasks for case in CASES for n in windowed
    }
    for c in report.cells:
        assert 0.0 <= c.accuracy <= 1.0 and c.gold_logprob <= 0.0 and c.seconds > 0
        assert c.question_computed == 1.0  # no session found the question computed
        if c.case == "never":
            assert c.computed == 1.0  # it computed the whole context itself
        if c.case == "whole":
            assert c.computed < 0.5  # the body came back from its whole computation
        if c.condition == "full":
            assert c.needles_hot == 1.0
    print_fidelity(report)
    assert "relevance@512" in capsys.readouterr().out
    blend = anyio.run(
        lambda: run_blend_bench(config, size=512, keys=1, ratios=(0.0, 0.5), trace_turns=2)
    )
    assert [r.condition for r in blend] == ["blend:0", "blend:0.5", "full"]
    assert blend[-1].top1_agreement == 1.0 and blend[-1].trace_seconds is None
    for r in blend[:2]:
        assert r.trace_seconds is not None and r.trace_seconds > 0
        assert r.trace_approximate_tokens is not None and r.trace_prefilled_tokens
    plotted = plot_fidelity(msgspec.structs.replace(report, blend=blend), tmp_path / "fidelity.png")
    assert plotted.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    refused = subprocess.run(
        [sys.executable, "-m", "benchmarks.fidelity", "--sizes", "100"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert refused.returncode == 2 and "between 1536 and 8064" in refused.stderr


def test_the_architectures_benchmark_measures_each_variant() -> None:
    argv = [
        "-m",
        "benchmarks.architectures",
        "--variants",
        "llama,qwen2-yarn-1l,granitehybrid,mamba2",
    ]
    rows = {r["variant"]: r for r in json.loads(run(*argv, "--json"))}
    assert rows["llama"]["in_place_delta"] == 0 and rows["llama"]["key_shift"] == "engine"
    yarn = rows["qwen2-yarn-1l"]
    assert yarn["key_shift"] == "kvrt" and yarn["in_place_delta"] == 0
    assert yarn["moved_delta"] < 0.06 < 0.6 < float(yarn["engine_shift"])
    hybrid = rows["granitehybrid"]
    assert hybrid["refused"] is None and hybrid["in_place_delta"] == 0
    assert hybrid["layers"] == "recurrent, global, recurrent" and hybrid["key_shift"] == "none"
    mamba = rows["mamba2"]  # restored with its checkpoint into a new context
    assert mamba["refused"] is None and mamba["in_place_delta"] == 0
    assert mamba["layers"] == "recurrent, recurrent" and mamba["key_shift"] == "none"


def test_the_hybrid_benchmark_measures_checkpoints_restores_and_the_agent_trace() -> None:
    argv = ["-m", "benchmarks.hybrid", "--variants", "granitehybrid,mamba2", "--turns", "1"]
    out = run(*argv, "--tokens", "256", "--block", "64", "--json")
    rows = {r["variant"]: r for r in json.loads(out)}
    hybrid, mamba = rows["granitehybrid"], rows["mamba2"]
    # a hybrid's block carries its attention KV and the checkpoint after it; Mamba-2's is
    # the checkpoint alone
    assert hybrid["block_cold_bytes"] > hybrid["block_kv_bytes"] + hybrid["checkpoint_bytes"] - 8
    assert mamba["block_kv_bytes"] == 0 and mamba["block_cold_bytes"] == mamba["checkpoint_bytes"]
    for row in rows.values():
        assert row["restore_ms"] > 0 and row["compute_ms"] > 0
        assert 0 < row["one_session"]["computed"] == row["new_sessions"]["computed"]
        assert row["llama_ram_cache"]["computed"] > 0


def test_the_shared_server_benchmark_compares_engine_turn_policies() -> None:
    argv = ["-m", "benchmarks.shared_server", "--model", zoo_path("llama"), "--rounds", "1"]
    argv += ["--settle", "0.5"]
    out = run(*argv, "--policies", "least_served,fifo")
    assert out.count("engine turns:") == 2
    assert "statuses [200]" in out and "statuses [400]" in out  # one load accepted, one refused
    assert out.count("x its time alone") == 4


def test_the_peer_benchmark_runs_kvrt_serve_beside_llama_server() -> None:
    # llama-server is built once from the llama.cpp llama-cpp-python vendors, outside the
    # test command (about six minutes on two cores): .ci/run builds it before the suite;
    # elsewhere `python -m benchmarks._peer` does, and this test waits for it.
    from benchmarks._peer import PeerUnavailable, llama_server

    try:
        llama_server(build=False)
    except PeerUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{exc}: .ci/run builds it before the suite")
        pytest.skip(f"{exc}: build it with `python -m benchmarks._peer` (about six minutes)")
    argv = ["-m", "benchmarks.peer", "--model", zoo_path("llama"), "--agents", "2"]
    out = run(*argv, "--turns", "2", "--chats", "2", "--rounds", "2")
    agents, chats = out.split("concurrent chat:")

    def rows(table: str) -> dict[str, list[str]]:
        return {
            line[:40].strip(): line[40:].split()
            for line in table.splitlines()
            if line.startswith(("kvrt serve", "llama-server")) and "the peer's best" not in line
        }

    served = rows(agents)
    assert len(served) == 6, agents
    fresh = {"kvrt": served["kvrt serve, nothing reused (reference)"]}
    fresh["llama"] = served["llama-server -np 1 --cache-ram 0"]
    for label, cells in served.items():
        assert float(cells[-3]) > 0, agents  # peak RSS, MiB
        if label.startswith("kvrt"):
            assert cells[-1] == "4/4", agents  # kvrt's replies equal computing them anew
        if cells not in fresh.values():
            computed, kind = int(cells[1]), "kvrt" if label.startswith("kvrt") else "llama"
            assert computed < int(fresh[kind][1]), agents  # reuse computes less
    assert "kvrt serve: wall" in agents and "peak RSS" in agents
    chatted = rows(chats)
    assert len(chatted) == 5, chats
    assert chatted["kvrt serve"][-1] == chatted["kvrt serve --idle-sessions 0"][-1] == "4/4"
    assert "tok/s" in chats
