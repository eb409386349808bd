"""`glm-run`: one-shot and chat generation, --stats-json, and its one-line errors."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import threading
from pathlib import Path

import jsonschema
import pytest

from glmkit.cli.run import main as run_main
from glmkit.errors import GlmkitError
from glmkit.generate.constraint import ThinkingBudget
from glmkit.generate.engine import Engine
from glmkit.generate.generator import Generator
from glmkit.generate.sampling import Sampler, SamplingParams
from glmkit.model import expert_cache, expert_stream
from glmkit.model.expert_cache import ExpertCache
from glmkit.model.glm5 import GlmMoeDsaModel
from glmkit.units import parse_size
from tests.runtime_support import FIXTURES, convert, copy_with_config
from tests.test_validate import flip_data_byte

STATS_KEYS = {"prompt_tokens", "cached_tokens", "prefill_s", "ttft_s", "decode_tokens", "decode_s", "peak_rss_mb",
              "device", "mtp_acceptance"}


@pytest.fixture(scope="module")
def small_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-fp8 with a 24-token context (config.json edits must go through a reconversion)."""
    root = tmp_path_factory.mktemp("small-context")
    source = copy_with_config("tiny-fp8", root / "source", max_position_embeddings=24)
    return convert(source, root / "snapshot")


def reply(engine: Engine, ids: list[int], max_tokens: int, constraint: ThinkingBudget | None = None
          ) -> tuple[list[int], str]:
    """Greedy reply without MTP, as glm-run prints it: (tokens, text without the eos token)."""
    tokens = list(Generator(engine.model, engine.eos_token_ids, use_mtp=False).generate(
        ids, max_tokens, Sampler(SamplingParams(), constraint)))
    shown = tokens[:-1] if tokens and tokens[-1] in engine.eos_token_ids else tokens
    return tokens, engine.tokenizer.decode(shown)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = run_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


# ---- one shot ------------------------------------------------------------------------------------

def test_prompt_prints_the_greedy_reply_and_writes_stats(snapshot, engine, capsys, tmp_path):
    stats_path = tmp_path / "stats.json"
    rc, out, err = run(capsys, snapshot, "-p", "Hello", "--max-tokens", 8, "--stats-json", stats_path)
    assert rc == 0 and err == ""
    ids = engine.tokenizer.encode_chat([user("Hello")], enable_thinking=True)
    tokens, text = reply(engine, ids, 8)
    assert out == text + "\n"

    stats = json.loads(stats_path.read_text())
    assert STATS_KEYS <= set(stats)
    assert stats["prompt_tokens"] == len(ids) and stats["cached_tokens"] == 0
    assert stats["decode_tokens"] == len(tokens) and 1 <= stats["decode_tokens"] <= 8
    assert 0 < stats["ttft_s"] < 60 and 0 < stats["prefill_s"] <= stats["ttft_s"]
    assert 0 <= stats["decode_s"] < 60
    assert 10 < stats["peak_rss_mb"] < 100_000
    assert stats["device"] == "numpy"
    assert stats["mtp_acceptance"] is None or 0 <= stats["mtp_acceptance"] <= 1
    assert stats["stop_reason"] in ("length", "eos")
    assert "turns" not in stats


def test_a_thinking_budget_closes_the_thinking_block(snapshot, engine, capsys):
    """`--thinking-budget 3`: the reply's 4th token is `</think>` (greedy, the template opens a thinking block), as
    the same constraint gives in-process; without it the reply has no `</think>` there."""
    ids = engine.tokenizer.encode_chat([user("Hello")], enable_thinking=True)
    close = engine.tokenizer.tokenizer.token_to_id("</think>")
    tokens, text = reply(engine, ids, 12, ThinkingBudget(close, 3, engine.config.vocab_size))
    free, _ = reply(engine, ids, 12)
    assert tokens[3] == close and close not in free and tokens[:3] == free[:3]
    rc, out, err = run(capsys, snapshot, "-p", "Hello", "--max-tokens", 12, "--thinking-budget", 3, "--no-cache")
    assert rc == 0 and out == text + "\n", err


def test_no_mtp_gives_the_same_text(snapshot, capsys, tmp_path):
    outputs = {}
    for flags in ([], ["--no-mtp"]):
        stats_path = tmp_path / f"stats{len(flags)}.json"
        rc, out, _ = run(capsys, snapshot, "-p", "Hello", "--max-tokens", 24, "--stats-json", stats_path, *flags)
        assert rc == 0
        outputs[bool(flags)] = (out, json.loads(stats_path.read_text()))
    assert outputs[True][0] == outputs[False][0]
    assert outputs[True][1]["mtp_acceptance"] is None and outputs[True][1]["tokens_per_forward"] == 1.0
    with_mtp = outputs[False][1]
    assert with_mtp["mtp_acceptance"] is not None and with_mtp["tokens_per_forward"] >= 1


@pytest.mark.parametrize("kv_dtype", ["bf16", "f16", "fp8"])
def test_kv_dtype_option(snapshot, capsys, tmp_path, kv_dtype):
    """`--kv-dtype`: the reply of a model whose KV rows are kept at that precision; a second run restores the
    prompt's rows from the prefill cache (stored at that precision) and prints the same text."""
    engine = Engine(snapshot, kv_dtype=kv_dtype)
    _, text = reply(engine, engine.tokenizer.encode_chat([user("Hello")], enable_thinking=True), 8)
    cached = []
    for turn in range(2):
        stats_path = tmp_path / f"stats{turn}.json"
        rc, out, err = run(capsys, snapshot, "-p", "Hello", "--max-tokens", 8, "--no-mtp", "--kv-dtype", kv_dtype,
                           "--cache-dir", tmp_path / "cache", "--stats-json", stats_path)
        assert rc == 0 and out == text + "\n", err
        cached.append(json.loads(stats_path.read_text())["cached_tokens"])
    assert cached[0] == 0 and cached[1] > 0


def test_raw_prompt_skips_the_chat_template(snapshot, engine, capsys, tmp_path):
    stats_path = tmp_path / "stats.json"
    rc, out, _ = run(capsys, snapshot, "-p", "def main():", "--raw-prompt", "--max-tokens", 6,
                     "--stats-json", stats_path)
    assert rc == 0
    ids = engine.tokenizer.encode("def main():")
    assert json.loads(stats_path.read_text())["prompt_tokens"] == len(ids)
    assert out == reply(engine, ids, 6)[1] + "\n"


def test_system_prompt_and_no_think_change_the_prompt(snapshot, engine, capsys, tmp_path):
    stats_path = tmp_path / "stats.json"
    rc, out, _ = run(capsys, snapshot, "-p", "Hello", "--system", "Be brief.", "--no-think", "--max-tokens", 5,
                     "--stats-json", stats_path)
    assert rc == 0
    ids = engine.tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, user("Hello")],
                                       enable_thinking=False)
    assert json.loads(stats_path.read_text())["prompt_tokens"] == len(ids)
    assert out == reply(engine, ids, 5)[1] + "\n"


def test_seeded_sampling_is_reproducible(snapshot, capsys):
    args = (snapshot, "-p", "Hello", "--max-tokens", 16, "--temp", "1.0", "--top-p", "0.9", "--top-k", "50")
    first = run(capsys, *args, "--seed", 7)
    assert first[0] == 0
    assert run(capsys, *args, "--seed", 7) == first


def test_generation_stops_at_the_context(small_context, capsys, tmp_path):
    stats_path = tmp_path / "stats.json"
    rc, _, _ = run(capsys, small_context, "-p", "Hi", "--no-think", "--max-tokens", 100, "--stats-json", stats_path)
    assert rc == 0
    stats = json.loads(stats_path.read_text())
    assert stats["stop_reason"] == "context"  # this greedy reply meets no eos token
    assert stats["prompt_tokens"] + stats["decode_tokens"] == 24


def test_max_context_bounds_the_prompt_and_the_reply(snapshot, capsys, tmp_path):
    """`--max-context N`: a reply stops at N positions, a longer prompt is a one-line error naming the flag, and N
    past the model's own context is refused."""
    stats_path = tmp_path / "stats.json"
    rc, _, err = run(capsys, snapshot, "-p", "Hi", "--no-think", "--max-tokens", 100, "--max-context", 24,
                     "--stats-json", stats_path, "--no-cache")
    stats = json.loads(stats_path.read_text())
    assert rc == 0 and stats["stop_reason"] == "context", err  # this greedy reply meets no eos token
    assert stats["prompt_tokens"] + stats["decode_tokens"] == 24
    rc, _, err = run(capsys, snapshot, "-p", "Hello " * 30, "--max-context", 24, "--no-cache")
    assert rc == 1 and err.startswith("glm-run: error: prompt is ") and err.strip().endswith("--max-context is 24")
    rc, _, err = run(capsys, snapshot, "-p", "Hi", "--max-context", 10 ** 9)
    assert rc == 1 and "--max-context 1000000000: must be in 1.." in err

def test_pinning_and_no_prefetch_options(snapshot, capsys, tmp_path):
    outputs = []
    for flags in ([], ["--ram-budget", "1G", "--no-prefetch"]):
        stats_path = tmp_path / f"stats{len(flags)}.json"
        rc, out, _ = run(capsys, snapshot, "-p", "Hello " * 12, "--max-tokens", 6, "--no-cache",
                         "--stats-json", stats_path, *flags)
        assert rc == 0
        outputs.append((out, json.loads(stats_path.read_text())))
    assert outputs[0][0] == outputs[1][0]
    plain, pinned = outputs[0][1], outputs[1][1]
    # the freshly converted container sits in the page cache: nothing needs prefetching
    assert plain["experts_pinned"] == 0 and plain["experts_prefetched"] == 0
    assert pinned["experts_pinned"] > 0 and pinned["experts_prefetched"] == 0
    for stats in (plain, pinned):
        assert stats["expert_hits"] + stats["expert_misses"] > 0


def test_expert_cache_gives_the_same_text_and_reports_reads(snapshot, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("GLMKIT_CACHE_DIR", str(tmp_path / "cache" / "prefix"))
    outputs = []
    for flags in ([], ["--expert-cache", "4M"], ["--expert-cache", "4M"]):
        stats_path = tmp_path / f"stats{len(outputs)}.json"
        rc, out, err = run(capsys, snapshot, "-p", "Hello " * 12, "--max-tokens", 6, "--no-cache", "--no-mtp",
                           "--device", "numpy", "--stats-json", stats_path, *flags)
        assert rc == 0, err
        outputs.append((out, json.loads(stats_path.read_text())))
    assert outputs[0][0] == outputs[1][0] == outputs[2][0]
    cold, warm = outputs[1][1], outputs[2][1]
    assert cold["expert_misses"] > 0 and cold["expert_bytes_read"] > 0 and cold["experts_preloaded"] == 0
    assert 0 <= cold["readahead_recall"] <= 1
    # the second run starts from the first one's usage scores: its hot set is read before it is asked for
    assert (tmp_path / "cache" / "experts").is_dir() and warm["experts_preloaded"] > 0


def test_expert_cache_is_on_by_default_only_where_the_model_outgrows_ram(snapshot, capsys, tmp_path, monkeypatch):
    """Where the container is larger than the RAM the process may use, glm-run keeps its experts in a cache sized
    from that RAM (said once on stderr) unless told `--expert-cache off`; where it fits, the page cache."""
    monkeypatch.setenv("GLMKIT_CACHE_DIR", str(tmp_path / "cache" / "prefix"))
    runs = {}
    for name, limit, flags in (("fits", 1 << 40, []), ("outgrows", 64 << 20, []),
                               ("off", 64 << 20, ["--expert-cache", "off"])):
        monkeypatch.setattr(expert_stream, "memory_limit_bytes", lambda limit=limit: limit)
        monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda limit=limit: limit)
        monkeypatch.setattr(expert_cache, "anonymous_resident_bytes", lambda: 0)  # a process of no size
        stats_path = tmp_path / f"{name}.json"
        rc, out, err = run(capsys, snapshot, "-p", "Hello " * 12, "--max-tokens", 6, "--no-cache", "--no-mtp",
                           "--device", "numpy", "--stats-json", stats_path, *flags)
        assert rc == 0, err
        runs[name] = out, err, json.loads(stats_path.read_text())
    assert runs["fits"][0] == runs["outgrows"][0] == runs["off"][0]
    assert "expert_bytes_read" in runs["outgrows"][2] and "expert cache" in runs["outgrows"][1]
    for name in ("fits", "off"):
        assert "expert_bytes_read" not in runs[name][2] and "expert cache" not in runs[name][1]


# ---- chat ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [[], ["--no-mtp"]], ids=["mtp", "no-mtp"])
def test_chat_two_turns_reuse_the_cache(snapshot, engine, capsys, monkeypatch, tmp_path, flags):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n\nHow are you?\n"))
    stats_path = tmp_path / "stats.json"
    rc, out, err = run(capsys, snapshot, "--chat", "--max-tokens", 10, "--stats-json", stats_path, *flags)
    assert rc == 0 and err == ""

    # the same conversation computed from scratch, each turn without any cache
    tok = engine.tokenizer
    ids1 = tok.encode_chat([user("Hello")])
    tokens1, text1 = reply(engine, ids1, 10)
    ids2 = tok.encode_chat([user("Hello"), {"role": "assistant", "content": text1}, user("How are you?")])
    tokens2, text2 = reply(engine, ids2, 10)
    assert out == text1 + "\n" + text2 + "\n"  # no "> " prompts: stdin is not a terminal

    stats = json.loads(stats_path.read_text())
    first, second = stats["turns"]
    assert (first["prompt_tokens"], first["cached_tokens"]) == (len(ids1), 0)
    assert second["prompt_tokens"] == len(ids2)
    assert 0 < second["cached_tokens"] < len(ids2)
    # at least the first turn's prompt is reused (the rendered history may re-tokenize the reply)
    assert second["cached_tokens"] >= len(ids1)
    assert (first["decode_tokens"], second["decode_tokens"]) == (len(tokens1), len(tokens2))
    assert stats["cached_tokens"] == second["cached_tokens"]  # top level: the last turn


def test_chat_holds_every_reply_to_the_thinking_budget(snapshot, engine, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nHow are you?\n"))
    rc, out, err = run(capsys, snapshot, "--chat", "--max-tokens", 8, "--thinking-budget", 2, "--no-cache")
    assert rc == 0, err
    tok, close = engine.tokenizer, engine.tokenizer.tokenizer.token_to_id("</think>")
    ids1 = tok.encode_chat([user("Hello")])
    tokens1, text1 = reply(engine, ids1, 8, ThinkingBudget(close, 2, engine.config.vocab_size))
    ids2 = tok.encode_chat([user("Hello"), {"role": "assistant", "content": text1}, user("How are you?")])
    tokens2, text2 = reply(engine, ids2, 8, ThinkingBudget(close, 2, engine.config.vocab_size))
    assert tokens1[2] == tokens2[2] == close and out == text1 + "\n" + text2 + "\n"

def test_chat_exit_command_and_empty_input(snapshot, capsys, monkeypatch, tmp_path):
    stats_path = tmp_path / "stats.json"
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n/exit\nNever read\n"))
    rc, out, _ = run(capsys, snapshot, "--chat", "--max-tokens", 3, "--stats-json", stats_path)
    assert rc == 0 and len(json.loads(stats_path.read_text())["turns"]) == 1
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    rc, out, _ = run(capsys, snapshot, "--chat", "--stats-json", stats_path)
    assert rc == 0 and out == "" and json.loads(stats_path.read_text())["turns"] == []


def test_json_schema_and_grammar_constrain_the_reply(snapshot, capsys, tmp_path):
    """--json-schema (inline or @FILE) and --grammar-file: the random fixture's reply parses and matches (its free
    reply is no JSON: tests/test_constrained.py)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 3}}, "required": ["n", "tags"],
              "additionalProperties": False}
    path = write(tmp_path / "schema.json", json.dumps(schema))
    for value in (json.dumps(schema), f"@{path}"):
        rc, out, err = run(capsys, snapshot, "-p", "Describe it.", "--max-tokens", 100, "--json-schema", value)
        assert rc == 0 and err == ""
        jsonschema.validate(json.loads(out), schema)
    rc, out, err = run(capsys, snapshot, "-p", "Yes or no?", "--max-tokens", 20, "--temp", 1, "--seed", 3,
                       "--grammar-file", write(tmp_path / "g.lark", 'start: "yes" | "no" | "maybe"'))
    assert rc == 0 and out.strip() in ("yes", "no", "maybe"), out
    with pytest.raises(SystemExit):  # one or the other
        run(capsys, snapshot, "-p", "x", "--json-schema", "{}", "--grammar-file", tmp_path / "g.lark")


# ---- errors: exit 1 and one line -----------------------------------------------------------------

ERROR_CASES = {
    "missing snapshot": lambda snap, tmp: [tmp / "nope", "-p", "Hello"],
    "not a container": lambda snap, tmp: [tmp, "-p", "Hello"],
    "unconverted HF snapshot": lambda snap, tmp: [FIXTURES / "tiny-bf16", "-p", "Hello"],
    "empty prompt": lambda snap, tmp: [snap, "-p", "   "],
    "prompt longer than the context": lambda snap, tmp: [snap, "-p", " ".join(str(i) for i in range(1500))],
    "negative temperature": lambda snap, tmp: [snap, "-p", "Hello", "--temp", "-1"],
    "nan temperature": lambda snap, tmp: [snap, "-p", "Hello", "--temp", "nan"],
    "top-p zero": lambda snap, tmp: [snap, "-p", "Hello", "--top-p", "0"],
    "top-p above one": lambda snap, tmp: [snap, "-p", "Hello", "--top-p", "1.5"],
    "negative top-k": lambda snap, tmp: [snap, "-p", "Hello", "--top-k", "-3"],
    "negative seed": lambda snap, tmp: [snap, "-p", "Hello", "--seed", "-1", "--temp", "1"],
    "max-tokens zero": lambda snap, tmp: [snap, "-p", "Hello", "--max-tokens", "0"],
    "unknown device": lambda snap, tmp: [snap, "-p", "Hello", "--device", "tpu"],
    "expert cache below one layer": lambda snap, tmp: [snap, "-p", "Hello", "--expert-cache", "1K"],
    "expert cache and ram budget": lambda snap, tmp: [snap, "-p", "Hello", "--expert-cache", "4M", "--ram-budget",
                                                      "1M"],
    "stats path unwritable": lambda snap, tmp: [snap, "-p", "Hello", "--max-tokens", "2",
                                                "--stats-json", tmp / "no" / "dir" / "stats.json"],
    "json schema not JSON": lambda snap, tmp: [snap, "-p", "Hello", "--json-schema", "{type: object"],
    "json schema not an object": lambda snap, tmp: [snap, "-p", "Hello", "--json-schema", "[1]"],
    "json schema too deep": lambda snap, tmp: [snap, "-p", "Hello", "--json-schema", "[" * 100000],
    "json schema uncompilable": lambda snap, tmp: [snap, "-p", "Hello", "--json-schema",
                                                   '{"type": "string", "pattern": "(?=a)b"}'],
    "json schema file missing": lambda snap, tmp: [snap, "-p", "Hello", "--json-schema", f"@{tmp / 'none.json'}"],
    "grammar that does not parse": lambda snap, tmp: [snap, "-p", "Hello", "--grammar-file",
                                                      write(tmp / "bad.lark", "start: (")],
    "json schema with chat": lambda snap, tmp: [snap, "--chat", "--json-schema", "{}"],
    "thinking budget zero": lambda snap, tmp: [snap, "-p", "Hello", "--thinking-budget", "0"],
    "thinking budget without thinking": lambda snap, tmp: [snap, "-p", "Hello", "--thinking-budget", "8",
                                                           "--no-think"],
    "thinking budget with a schema": lambda snap, tmp: [snap, "-p", "Hello", "--thinking-budget", "8",
                                                        "--json-schema", "{}"],
    "more pipeline stages than layers": lambda snap, tmp: [snap, "-p", "Hello", "--pipeline",
                                                           "99999999999999999999"],
}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_input_is_one_error_line(snapshot, capsys, tmp_path, case):
    rc, out, err = run(capsys, *ERROR_CASES[case](snapshot, tmp_path))
    assert rc == 1, (case, out, err)
    assert len(err.splitlines()) == 1 and err.startswith("glm-run: error: "), err



def test_a_stats_path_no_file_can_take_is_refused_before_generating(snapshot, capsys, tmp_path):
    rc, out, err = run(capsys, snapshot, "-p", "Hello", "--stats-json", tmp_path, "--no-cache")
    assert rc == 1 and out == "" and err == f"glm-run: error: --stats-json: cannot write {tmp_path} (Is a directory)\n"


@pytest.mark.parametrize("size", ["inf", "1e400", "-1", "nan"])
def test_a_cache_size_that_is_not_finite_and_positive_is_a_usage_error(snapshot, capsys, size):
    with pytest.raises(SystemExit) as exit_info:
        run(capsys, snapshot, "-p", "Hello", "--cache-max-gb", size)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "argument --cache-max-gb: invalid size in GiB" in err

def test_sizes_take_binary_units_and_fractions():
    assert [parse_size(t) for t in ("1000", "64K", "500M", "4G", "1.5G", "0.25T", "1.25k")] == [
        1000, 64 << 10, 500 << 20, 4 << 30, 3 << 29, 1 << 38, 1280]
    for text in ("", "G", "-1", "1e3", ".5G", "12.", "1.5.2G", "4GB", "\uff11G"):
        with pytest.raises(argparse.ArgumentTypeError, match="invalid size"):
            parse_size(text)

def test_prompt_longer_than_a_small_context(small_context, capsys, monkeypatch):
    rc, _, err = run(capsys, small_context, "-p", "Hello there, how are you doing today my friend?")
    assert rc == 1 and err.startswith("glm-run: error: prompt is ") and "context is 24" in err
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there, how are you doing today my friend?\n"))
    rc, _, err = run(capsys, small_context, "--chat")
    assert rc == 1 and len(err.splitlines()) == 1 and err.startswith("glm-run: error: prompt is ")


def test_edited_config_is_detected(snapshot, capsys, tmp_path):

    copy = tmp_path / "copy"
    shutil.copytree(snapshot, copy)
    config = json.loads((copy / "config.json").read_text())
    config["max_position_embeddings"] = 16
    (copy / "config.json").write_text(json.dumps(config))
    rc, _, err = run(capsys, copy, "-p", "Hello")
    assert rc == 1 and err.startswith("glm-run: error: ") and "manifest" in err


def test_verify_refuses_a_flipped_data_byte(snapshot, capsys, tmp_path):
    """--verify checks every tensor against the manifest's digests before running; without it a last-bit flip
    goes unnoticed (the reply still comes)."""
    rc, out, err = run(capsys, snapshot, "-p", "Hello", "--max-tokens", "2", "--no-cache", "--verify")
    assert rc == 0 and out.strip() and err == "", err
    copy = shutil.copytree(snapshot, tmp_path / "copy")
    data_file = flip_data_byte(copy, "model.embed_tokens.weight")
    rc, out, err = run(capsys, copy, "-p", "Hello", "--max-tokens", "2", "--no-cache", "--verify")
    assert rc == 1 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"glm-run: error: {data_file}: "), err
    assert "model.embed_tokens.weight" in err
    rc, out, _ = run(capsys, copy, "-p", "Hello", "--max-tokens", "2", "--no-cache")
    assert rc == 0 and out.strip()


@pytest.mark.parametrize("failure", ["no tokenizer", "device step"])
def test_a_failed_start_leaves_no_expert_cache_thread(snapshot, capsys, tmp_path, monkeypatch, failure):
    """Opening a snapshot that fails once its expert cache could have started reading (its saved hot set, from a
    run before) gives one error line and leaves no read or preloading thread running: a missing tokenizer is found
    before the cache opens, a later failure closes it."""
    monkeypatch.setenv("GLMKIT_CACHE_DIR", str(tmp_path / "cache" / "prefix"))
    rc, _, err = run(capsys, snapshot, "-p", "Hello", "--max-tokens", 2, "--no-mtp", "--device", "numpy",
                     "--expert-cache", "4M")
    assert rc == 0, err  # leaves usage scores: the next cache preloads
    target = snapshot
    if failure == "no tokenizer":
        target = tmp_path / "no-tokenizer"
        shutil.copytree(snapshot, target)
        (target / "tokenizer.json").unlink()
    else:
        def fail(model: GlmMoeDsaModel) -> None:
            raise GlmkitError("no device step")
        monkeypatch.setattr(GlmMoeDsaModel, "decodes_on_device", fail)
    preloads, preload = [], ExpertCache._preload
    monkeypatch.setattr(ExpertCache, "_preload", lambda self, hot: (preloads.append(len(hot)), preload(self, hot)))
    before = set(threading.enumerate())
    rc, _, err = run(capsys, target, "-p", "Hello", "--device", "numpy", "--expert-cache", "4M")
    assert rc == 1 and len(err.splitlines()) == 1 and err.startswith("glm-run: error: "), err
    assert bool(preloads) == (failure == "device step")
    left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith(("glmkit-preload",
                                                                                     "glmkit-experts"))]
    assert not left, left
