"""The prefill cache through the command line: new processes hit, sessions resume, glm-cache manages."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glmkit.cli.cache import main as cache_main
from tests.runtime_support import FIXTURES, convert

ROOT = Path(__file__).parent.parent
LONG = "Wrap this text for a narrow window, then explain why the result reads well. " * 4


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    return convert(FIXTURES / "tiny-bf16", tmp_path_factory.mktemp("snap") / "s", "q4")


def glm_run(cache_dir, *args, stdin=None):
    """glm-run in a NEW process (the cache must survive it); returns (stdout, stats)."""
    stats = Path(cache_dir).parent / f"stats-{os.getpid()}-{len(list(Path(cache_dir).parent.glob('stats-*')))}.json"
    proc = subprocess.run([sys.executable, "-m", "glmkit.cli.run", *map(str, args), "--stats-json", str(stats)],
                          input=stdin, capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "GLMKIT_CACHE_DIR": str(cache_dir)})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(stats.read_text())


def test_a_new_process_reuses_the_shared_prefix(snapshot, tmp_path):
    cache = tmp_path / "cache"
    out1, miss = glm_run(cache, snapshot, "-p", LONG + "Question 1", "--max-tokens", 8)
    assert miss["cached_tokens"] == 0
    out2, hit = glm_run(cache, snapshot, "-p", LONG + "Question 2", "--max-tokens", 8)
    assert hit["cached_tokens"] >= 64 and hit["cached_from"]["disk"] == hit["cached_tokens"]
    plain, none = glm_run(tmp_path / "unused", snapshot, "-p", LONG + "Question 2", "--max-tokens", 8, "--no-cache")
    assert out2 == plain and none["cached_tokens"] == 0
    assert not (tmp_path / "unused").exists()
    same, again = glm_run(cache, snapshot, "-p", LONG + "Question 1", "--max-tokens", 8)
    assert same == out1 and again["cached_tokens"] == again["prompt_tokens"] - 1  # only the last token recomputed


def test_a_chat_session_resumes_in_a_new_process_without_prefill(snapshot, tmp_path):
    cache = tmp_path / "cache"
    first, s1 = glm_run(cache, snapshot, "--chat", "--session", "work", "--max-tokens", 6, stdin="Hello there\n")
    saved = json.loads(next(cache.glob("sessions/*/work.json")).read_text())["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant"]
    _, s2 = glm_run(cache, snapshot, "--chat", "--session", "work", "--max-tokens", 6, stdin="And again\n")
    turn = s2["turns"][0]
    # the template re-renders the first reply as `<think></think>reply`, so reuse stops after `<think>`
    # (the one token before it is recomputed for the MTP head)
    assert turn["cached_tokens"] == s1["prompt_tokens"] - 1 and turn["cached_from"]["disk"] > 0
    assert turn["prompt_tokens"] - turn["cached_tokens"] < 24  # the re-rendered reply and the new user turn
    saved = json.loads(next(cache.glob("sessions/*/work.json")).read_text())["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant", "user", "assistant"]


def test_glm_cache_ls_stats_prune_clear(snapshot, tmp_path, capsys):
    cache = tmp_path / "cache"
    glm_run(cache, snapshot, "-p", LONG, "--max-tokens", 4)
    assert cache_main(["--cache-dir", str(cache), "ls"]) == 0
    assert "entries" in capsys.readouterr().out
    assert cache_main(["--cache-dir", str(cache), "stats", "--model", str(snapshot)]) == 0
    out = capsys.readouterr().out
    entries = int(out.split()[1])
    assert entries >= 2
    (cache / "ab").mkdir(exist_ok=True)
    orphan = next(cache.glob("*/*/*.kvc")).parent.parent / "00" / ("0" * 64 + ".kvc")  # a blob no row names
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"junk")
    assert cache_main(["--cache-dir", str(cache), "prune", "--max-gb", "100"]) == 0
    assert "1 stale or orphaned" in capsys.readouterr().out and not orphan.exists()
    assert cache_main(["--cache-dir", str(cache), "clear", "--model", str(snapshot)]) == 0
    assert f"removed {entries} entries" in capsys.readouterr().out
    assert not list(cache.glob("*/*/*.kvc"))
    assert cache_main(["--cache-dir", str(cache), "stats", "--model", str(tmp_path)]) == 1
    assert "glm-cache: error:" in capsys.readouterr().err


def test_session_needs_chat_and_a_valid_name(snapshot, capsys):
    from glmkit.cli.run import main as run_main
    assert run_main([str(snapshot), "-p", "hi", "--session", "x"]) == 1
    assert "--session" in capsys.readouterr().err
