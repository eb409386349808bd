#!/usr/bin/env python3
"""Benchmark glm-serve: a 10-turn tool-using agent conversation with the prefill cache on and off, and a
short load test with concurrent clients. Every request goes through the official `openai` client.

    PYTHONPATH=. python tools/bench_serve.py                                  # tiny fixture, 8k context
    PYTHONPATH=. python tools/bench_serve.py --snapshot /tmp/glmkit-bench/out-bf16-q4 --load-seconds 60

Each configuration runs `python -m glmkit.cli.serve` as its own server process on a free loopback port,
with a fresh cache directory (or `--no-cache`). A snapshot without a tokenizer (tools/bench_convert.py's
synthetic ones) is served through a directory of hard links plus the tiny fixture's tokenizer files.

Agent conversation: a system prompt, three tool schemas and a task; every turn streams a reply (greedy,
`ignore_eos`, `--max-tokens` tokens), then the script appends that reply with a scripted tool call and a
tool result of ~`--tool-result-chars` characters, as a coding agent would. Recorded per turn: prompt
tokens, cached prompt tokens (`usage.prompt_tokens_details.cached_tokens`), prefill tokens actually
computed (prompt - cached), TTFT seen by the client (request sent -> first generated text) and by the
server (`timings.ttft_s`).

Load: `--load-clients` threads send requests back to back (alternating streaming and not, each its own
short conversation) for `--load-seconds`; a response is complete when it has `--load-max-tokens`
tokens, finish_reason "length" and (streaming) the final usage chunk.

Streams (`--streams 1,2,4`): one server per `--stream-modes` entry (default: continuous batching forced on with
`--max-batch 4`, and off with `--max-batch 1`), all up at once; each round sends N concurrent streaming requests
(distinct short prompts, greedy, or sampled at `--stream-temperature` with a seed per stream, `ignore_eos`,
`--stream-tokens` tokens) to each server in turn, for every N, so
the modes alternate under the same machine load. Aggregate decode tok/s = the tokens after each stream's first,
summed, over the time from the earliest first token to the last stream's end (a stream's first token: its end less
the server's `timings.decode_s`; the other streams' short prefills fall in that window); the table gives the median
over `--stream-rounds` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FIXTURE = ROOT / "tests" / "fixtures" / "tiny-bf16"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

SYSTEM = ("You are a coding agent working in a Python repository. Read files before changing them, run the "
          "tests after every change, and keep answers short. When you need information, call a tool; when the "
          "task is done, reply with a summary of what changed and why.")
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string"}, "start": {"type": "integer"},
                                          "end": {"type": "integer"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_shell", "description": "Run a shell command, return its output",
                                      "parameters": {"type": "object", "properties": {
                                          "command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the repository for a pattern",
                                      "parameters": {"type": "object", "properties": {
                                          "pattern": {"type": "string"}}, "required": ["pattern"]}}},
]
TASK = "The tests in tests/test_cache.py fail after the last refactor. Find out why and fix it."
WORDS = ("def", "return", "self", "cache", "key", "value", "None", "if", "for", "in", "import", "class", "len",
         "assert", "path", "open", "read", "write", "lock", "entry", "size", "bytes", "hash", "tokens")


def tool_call(turn: int) -> dict[str, Any]:
    name, args = [("read_file", {"path": f"glmkit/cache_{turn}.py", "start": 1, "end": 80}),
                  ("run_shell", {"command": f"pytest -q tests/test_cache.py -k case{turn}"}),
                  ("search", {"pattern": f"def lookup_{turn}"})][turn % 3]
    return {"id": f"call_{turn}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def tool_result(turn: int, chars: int) -> str:
    rng = random.Random(turn)
    lines, size = [], 0
    while size < chars:
        line = "    " * rng.randint(0, 2) + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


# ---- the server -----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servable(snapshot: Path, work: Path) -> Path:
    """`snapshot`, or a hard-linked (else copied) view of it with the fixture's tokenizer when it has none (a
    container refuses symlinks out of its directory)."""
    if (snapshot / "tokenizer.json").is_file():
        return snapshot
    view = work / "snapshot-with-tokenizer"
    view.mkdir(parents=True, exist_ok=True)
    for item in snapshot.iterdir():
        if not (view / item.name).exists():
            try:
                os.link(item.resolve(), view / item.name)
            except OSError:  # another file system
                shutil.copy(item, view / item.name)
    for name in TOKENIZER_FILES:
        shutil.copy(FIXTURE / name, view / name)
    return view


class Server:
    def __init__(self, snapshot: Path, cache_dir: Path | None, log: Path, extra: list[str]):
        self.port = free_port()
        cmd = [sys.executable, "-m", "glmkit.cli.serve", str(snapshot), "--port", str(self.port),
               "--log-level", "warning", *extra]
        cmd += ["--cache-dir", str(cache_dir)] if cache_dir else ["--no-cache"]
        self.command = " ".join(cmd[1:])
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                self.log.close()
                raise SystemExit(f"server exited: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("server did not come up")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/stats", timeout=30) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def client(server: Server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="bench", max_retries=0, timeout=3600)


# ---- the agent conversation ------------------------------------------------------------------------

def agent_conversation(server: Server, model: str, turns: int, max_tokens: int, result_chars: int) -> list[dict]:
    c = client(server)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    records = []
    for turn in range(1, turns + 1):
        start = time.perf_counter()
        first = None
        text, final = [], None
        for chunk in c.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens,
                                               temperature=0, stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}):
            if chunk.usage is not None:
                final = chunk
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if delta.content or delta.tool_calls or (delta.model_extra or {}).get("reasoning_content"):
                first = first or time.perf_counter()
                text.append(delta.content or "")
        end = time.perf_counter()
        usage, timings = final.usage, final.model_extra["timings"]
        cached = usage.prompt_tokens_details.cached_tokens
        records.append({"turn": turn, "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached,
                        "prefill_tokens": usage.prompt_tokens - cached, "completion_tokens": usage.completion_tokens,
                        "client_ttft_s": round((first or end) - start, 4), "server_ttft_s": timings["ttft_s"],
                        "restore_s": timings.get("restore_s"),
                        "total_s": round(end - start, 4)})
        call = tool_call(turn)
        messages += [{"role": "assistant", "content": "".join(text), "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": tool_result(turn, result_chars)}]
    return records


# ---- load ------------------------------------------------------------------------------------------

def load_test(server: Server, model: str, clients: int, seconds: float, max_tokens: int) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def worker(index: int) -> None:
        c = client(server)
        n = 0
        while time.monotonic() < stop_at:
            n += 1
            stream = (index + n) % 2 == 0
            messages = [{"role": "user", "content": f"Client {index} request {n}: explain step {n} of the plan."}]
            start = time.perf_counter()
            record: dict[str, Any] = {"stream": stream, "ok": False}
            try:
                if stream:
                    usage, finish = None, None
                    for chunk in c.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                           temperature=0, stream=True,
                                                           stream_options={"include_usage": True},
                                                           extra_body={"ignore_eos": True}):
                        if chunk.usage is not None:
                            usage = chunk.usage
                        if chunk.choices and chunk.choices[0].finish_reason:
                            finish = chunk.choices[0].finish_reason
                else:
                    reply = c.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                      temperature=0, extra_body={"ignore_eos": True})
                    usage, finish = reply.usage, reply.choices[0].finish_reason
                record["ok"] = usage is not None and usage.completion_tokens == max_tokens and finish == "length"
                record["tokens"] = usage.completion_tokens if usage else 0
            except Exception as e:  # counted as an error
                record["error"] = f"{type(e).__name__}: {e}"
            record["latency_s"] = time.perf_counter() - start
            with lock:
                results.append(record)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    latencies = sorted(r["latency_s"] for r in results)
    errors = [r["error"] for r in results if "error" in r]
    return {"clients": clients, "seconds": seconds, "wall_s": round(wall, 2), "requests": len(results),
            "errors": len(errors), "incomplete": sum(1 for r in results if not r["ok"] and "error" not in r),
            "first_errors": errors[:3], "tokens": sum(r.get("tokens", 0) for r in results),
            "tokens_per_s": round(sum(r.get("tokens", 0) for r in results) / wall, 2),
            "latency_p50_s": round(statistics.median(latencies), 3) if latencies else None,
            "latency_p95_s": round(latencies[int(0.95 * (len(latencies) - 1))], 3) if latencies else None,
            "latency_max_s": round(latencies[-1], 3) if latencies else None,
            "max_active_seen": server.stats()["max_active_seen"]}


# ---- concurrent streams ---------------------------------------------------------------------------------

def concurrent_streams(server: Server, model: str, n: int, max_tokens: int, salt: int, temperature: float = 0.0
                       ) -> dict[str, Any]:
    """n streaming requests at once (greedy, or sampled at `temperature`, seeded); their aggregate decode rate (see
    the module docstring)."""
    ends: list[tuple[float, float, int]] = []  # (end, decode_s, completion tokens)
    errors: list[str] = []

    def stream(index: int) -> None:
        try:
            final = None
            for chunk in client(server).completions.create(
                    model=model, prompt=f"Stream {index} of round {salt}: the plan, step by step.",
                    max_tokens=max_tokens, temperature=temperature, seed=1000 * salt + index, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                if chunk.usage is not None:
                    final = chunk
            end = time.perf_counter()
            ends.append((end, final.model_extra["timings"]["decode_s"], final.usage.completion_tokens))
        except Exception as e:  # reported in the record
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors or len(ends) != n:
        return {"streams": n, "errors": errors}
    window = max(end for end, _, _ in ends) - min(end - decode_s for end, decode_s, _ in ends)
    tokens = sum(count - 1 for _, _, count in ends)
    return {"streams": n, "tokens": tokens, "window_s": round(window, 4), "tok_per_s": round(tokens / window, 3),
            "stream_tok_per_s": [round((count - 1) / decode_s, 3) for _, decode_s, count in ends]}


def stream_scaling(servers: dict[str, Server], model: str, counts: list[int], max_tokens: int, rounds: int,
                   temperature: float = 0.0) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """Every round: for each stream count, each mode's server in turn (alternated under the same load)."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {label: {n: [] for n in counts} for label in servers}
    for r in range(rounds):
        for n in counts:
            for label, server in servers.items():
                record = concurrent_streams(server, model, n, max_tokens, r, temperature)
                runs[label][n].append(record)
                print(f"round {r + 1} {label} x{n}: {json.dumps(record)}", file=sys.stderr)
    return runs


def scaling_markdown(runs: dict[str, dict[int, list[dict[str, Any]]]]) -> str:
    labels = list(runs)
    counts = list(runs[labels[0]])
    median = {(label, n): statistics.median(r.get("tok_per_s", 0.0) for r in runs[label][n])
              for label in labels for n in counts}
    lines = ["| streams | " + " | ".join(f"{label}: tok/s (x of 1 stream)" for label in labels) +
             (f" | {labels[0]} / {labels[1]} |" if len(labels) > 1 else " |"),
             "|---:|" + "---:|" * (len(labels) + (len(labels) > 1))]
    for n in counts:
        cells = [f"{median[label, n]:.2f} ({median[label, n] / median[label, counts[0]]:.2f}x)" for label in labels]
        ratio = [f"{median[labels[0], n] / median[labels[1], n]:.2f}x"] if len(labels) > 1 else []
        lines.append(f"| {n} | " + " | ".join(cells + ratio) + " |")
    return "\n".join(lines)


# ---- report ----------------------------------------------------------------------------------------

def markdown(runs: dict[str, list[dict]], load: dict[str, Any] | None) -> str:
    on, off = runs.get("cache on", []), runs.get("cache off", [])
    lines = ["| turn | prompt tokens | cache on: cached | on: prefilled | on: TTFT client / server (s) "
             "| off: prefilled | off: TTFT client / server (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|"] if on or off else []
    for a, b in zip(on, off, strict=False):
        lines.append(f"| {a['turn']} | {a['prompt_tokens']} | {a['cached_tokens']} | {a['prefill_tokens']} | "
                     f"{a['client_ttft_s']:.3f} / {a['server_ttft_s']:.3f} | {b['prefill_tokens']} | "
                     f"{b['client_ttft_s']:.3f} / {b['server_ttft_s']:.3f} |")
    if on and off:
        lines.append(f"| **sum** | {sum(r['prompt_tokens'] for r in on)} | {sum(r['cached_tokens'] for r in on)} | "
                     f"{sum(r['prefill_tokens'] for r in on)} | {sum(r['client_ttft_s'] for r in on):.3f} / "
                     f"{sum(r['server_ttft_s'] for r in on):.3f} | {sum(r['prefill_tokens'] for r in off)} | "
                     f"{sum(r['client_ttft_s'] for r in off):.3f} / {sum(r['server_ttft_s'] for r in off):.3f} |")
    if load:
        lines += ["", "| clients | seconds | requests | errors | incomplete | tokens/s | latency p50 / p95 / max (s) "
                      "| max active |", "|---:|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {load['clients']} | {load['seconds']} | {load['requests']} | {load['errors']} | "
                  f"{load['incomplete']} | {load['tokens_per_s']} | {load['latency_p50_s']} / {load['latency_p95_s']}"
                  f" / {load['latency_max_s']} | {load['max_active_seen']} |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--snapshot", type=Path, help="converted snapshot (default: the tiny-bf16 fixture, converted)")
    p.add_argument("--preset", default="q4", help="preset for the converted fixture (default %(default)s)")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=16, help="reply tokens per agent turn (default %(default)s)")
    p.add_argument("--tool-result-chars", type=int, default=400)
    p.add_argument("--load-clients", type=int, default=4)
    p.add_argument("--load-seconds", type=float, default=20)
    p.add_argument("--load-max-tokens", type=int, default=16)
    p.add_argument("--streams", default="", help="concurrent stream counts to compare, e.g. 1,2,4 (default: none)")
    p.add_argument("--stream-tokens", type=int, default=48, help="tokens per stream (default %(default)s)")
    p.add_argument("--stream-temperature", type=float, default=0.0,
                   help="the streams' temperature (default %(default)s: greedy; above 0 each stream is seeded)")
    p.add_argument("--stream-rounds", type=int, default=3, help="rounds of every count and mode (default %(default)s)")
    p.add_argument("--stream-modes", default="batched=--max-batch 4;per-request=--max-batch 1",
                   help="LABEL=glm-serve flags, ';'-separated: one server each (default %(default)s)")
    p.add_argument("--server-args", default="", help="extra glm-serve flags, e.g. '--no-mtp --parallel 8'")
    p.add_argument("--json", type=Path, help="write all numbers here")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="glmkit-bench-serve-"))
    try:
        if args.snapshot is None:
            from tests.runtime_support import convert, copy_with_config

            # the fixture's 2048-token context is too short for ten turns of its 384-token vocabulary
            source = copy_with_config("tiny-bf16", work / "tiny-source", max_position_embeddings=8192)
            snapshot = convert(source, work / "tiny", args.preset)
        else:
            snapshot = servable(args.snapshot, work)
        model = snapshot.resolve().name
        extra = args.server_args.split()
        runs: dict[str, list[dict]] = {}
        commands = {}
        for label, cache in (("cache on", work / "cache"), ("cache off", None)) if args.turns > 0 else ():
            server = Server(snapshot, cache, work / f"server-{label.replace(' ', '-')}.log", extra)
            commands[label] = server.command
            try:
                runs[label] = agent_conversation(server, model, args.turns, args.max_tokens, args.tool_result_chars)
            finally:
                server.close()
            print(f"{label}: {json.dumps(runs[label])}", file=sys.stderr)
        scaling = None
        if args.streams:
            counts = [int(n) for n in args.streams.split(",")]
            servers = {}
            try:
                for mode in args.stream_modes.split(";"):
                    label, _, flags = mode.partition("=")
                    servers[label] = Server(snapshot, None, work / f"server-{label}.log", extra + flags.split())
                    commands[label] = servers[label].command
                scaling = stream_scaling(servers, model, counts, args.stream_tokens, args.stream_rounds,
                                         args.stream_temperature)
            finally:
                for server in servers.values():
                    server.close()
        load = None
        if args.load_clients > 0 and args.load_seconds > 0:
            server = Server(snapshot, work / "cache-load", work / "server-load.log", extra)
            commands["load"] = server.command
            try:
                load = load_test(server, model, args.load_clients, args.load_seconds, args.load_max_tokens)
            finally:
                server.close()
        if runs or load:
            print(markdown(runs, load))
        if scaling:
            print(scaling_markdown(scaling))
        if args.json:
            args.json.write_text(json.dumps({"snapshot": str(args.snapshot or f"tiny-bf16 8k ({args.preset})"),
                                             "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                                             "commands": commands, "turns": runs, "load": load,
                                             "streams": scaling}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
