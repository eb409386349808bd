"""glm-convert from a Hub repo, against a fake Hub on 127.0.0.1 (tests/fake_hub.py): no network.

Streaming shard by shard, resume after kill -9, refusals, verification, disk checks, the lock, HF cache sources.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from glmkit.cli.convert import main as convert_main
from glmkit.convert import convert as convert_module
from glmkit.convert.sources.fetch import ShardFetcher, peak_alive_bytes
from glmkit.convert.sources.snapshot import HFSnapshot
from glmkit.errors import GlmkitError
from glmkit.format.reader import Container
from glmkit.format.safetensors_file import read_header
from tests.fake_hub import FakeHub, read_dir
from tests.runtime_support import fail_reading

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).parent.parent
BF16 = "org/tiny-bf16"
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
PRIVATE_TOKEN = "hf_fake_private_token"


def _fixture_files(name: str) -> dict[str, bytes]:
    return {k: v for k, v in read_dir(FIXTURES / name).items() if k != "oracle.json"}


def _split_fp8() -> dict[str, bytes]:
    """tiny-fp8 resharded adversarially: weights, their `*_scale_inv` and embed/lm_head in three shards."""
    src = FIXTURES / "tiny-fp8" / "model.safetensors"
    data = src.read_bytes()
    infos = read_header(src)
    groups: dict[str, list[str]] = {s: [] for s in ("model-00001-of-00003.safetensors",
                                                    "model-00002-of-00003.safetensors",
                                                    "model-00003-of-00003.safetensors")}
    names = list(groups)
    for name in infos:
        shard = 1 if "scale_inv" in name else 2 if name in ("model.embed_tokens.weight", "lm_head.weight") else 0
        groups[names[shard]].append(name)
    files = {k: v for k, v in _fixture_files("tiny-fp8").items() if k != "model.safetensors"}
    weight_map = {}
    for shard, members in groups.items():
        header, pos, body = {}, 0, []
        for name in members:
            info = infos[name]
            header[name] = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": [pos, pos + info.nbytes]}
            body.append(data[info.start:info.start + info.nbytes])
            pos += info.nbytes
            weight_map[name] = shard
        text = json.dumps(header).encode()
        files[shard] = len(text).to_bytes(8, "little") + text + b"".join(body)
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    return files


@pytest.fixture(scope="module")
def hub():
    fake = FakeHub()
    bf16 = _fixture_files("tiny-bf16")
    fake.add_repo(BF16, bf16, refs={"v2": {**bf16, "README.md": b"a later commit"}})
    fake.add_repo("org/tiny-fp8", _fixture_files("tiny-fp8"))
    fake.add_repo("org/tiny-fp8-split", _split_fp8())
    fake.add_repo("org/private", bf16, token=PRIVATE_TOKEN)
    yield fake
    fake.close()


@pytest.fixture(autouse=True)
def hf_env(monkeypatch, tmp_path):
    """No token, no real cache, no proxy, online: huggingface_hub reads some of these at import time."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture(scope="module")
def local_ref(tmp_path_factory):
    """Local-directory conversions to compare against, by (fixture, extra args)."""
    cache: dict[tuple, Container] = {}

    def get(fixture: str, *args: str) -> Container:
        if (fixture, args) not in cache:
            out = tmp_path_factory.mktemp("local") / "out"
            assert convert_main([str(FIXTURES / fixture), str(out), "--quiet", *args]) == 0
            cache[(fixture, args)] = Container(out)
        return cache[(fixture, args)]
    return get


def run_hub(hub, repo, out, *args) -> int:
    return convert_main([repo, str(out), "--quiet", "--endpoint", hub.endpoint, *args])


def same_files(a: Container, b: Container) -> None:
    assert a.model_hash == b.model_hash
    assert set(a.manifest.files) == set(b.manifest.files)
    for name in a.manifest.files:
        assert (a.directory / name).read_bytes() == (b.directory / name).read_bytes(), name


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("glm-convert: error: "), err
    return err[-1]


def subprocess_env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_CACHE=str(tmp_path / "hf-cache"),
               NO_PROXY="127.0.0.1,localhost", PYTHONPATH=str(ROOT))
    return env


def wait_for(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def start_held_converter(hub, tmp_path, out, *args):
    """A glm-convert process that downloads shards 1-2, then stalls inside shard 3 (the Hub holds it)."""
    hold = hub.hold(BF16, SHARDS[2], after=100_000)
    proc = subprocess.Popen([sys.executable, "-m", "glmkit.cli.convert", BF16, str(out), "--quiet", "--endpoint",
                             hub.endpoint, *args], env=subprocess_env(tmp_path), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: hold.reached.is_set() or proc.poll() is not None, "the converter to reach shard 3")
        assert proc.poll() is None, proc.communicate()
    except BaseException:
        proc.kill()
        hub.release()
        raise
    return proc


# --- conversion from the Hub --------------------------------------------------------------------------------

@pytest.mark.parametrize("repo,fixture", [(BF16, "tiny-bf16"), ("org/tiny-fp8", "tiny-fp8")])
def test_hub_conversion_equals_local_directory(hub, local_ref, tmp_path, repo, fixture):
    before = {s: hub.downloads(s) for s in (*SHARDS, "model.safetensors")}
    assert run_hub(hub, repo, tmp_path / "out") == 0
    c = Container(tmp_path / "out")
    ref = local_ref(fixture)
    same_files(c, ref)
    assert c.manifest.source["files"] == ref.manifest.source["files"]  # LFS sha256 == sha256 of the local files
    origin = c.manifest.source["origin"]
    assert origin["kind"] == "hub" and origin["repo"] == repo and origin["requested_revision"] == "main"
    assert origin["revision"] == hub.repos[repo].refs["main"] and origin["endpoint"] == hub.endpoint
    assert ref.manifest.source["origin"]["kind"] == "local"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in ref.directory.iterdir())
    for shard in (*SHARDS, "model.safetensors"):  # every shard downloaded once (or not at all)
        assert hub.downloads(shard) - before[shard] in ((1,) if shard in c.manifest.source["files"] else (0,))
    assert c.verify_data() == []


def test_streaming_holds_only_the_shards_the_next_tensors_need(hub, tmp_path, capsys):
    sizes = {s: len(hub.repos[BF16].commits[hub.repos[BF16].refs["main"]][s]) for s in SHARDS}
    assert run_hub(hub, BF16, tmp_path / "one", "--max-inflight", "0") == 0
    summary = capsys.readouterr().out
    # layer 2 spans shards 1 and 2 (expert 1's matrices sit in both): two shards at most, never three
    assert "at most 811.1 kB of downloaded shards on disk" in summary
    assert sizes[SHARDS[0]] + sizes[SHARDS[1]] == 811_064 < sum(sizes.values())
    assert not (tmp_path / "one" / ".glm-convert").exists()


def test_weights_scales_and_experts_in_different_shards(hub, local_ref, tmp_path):
    """FP8 weights with their weight_scale_inv in another shard, fused experts, embed/lm_head shard kept alive."""
    assert run_hub(hub, "org/tiny-fp8-split", tmp_path / "out", "--max-inflight", "0", "--max-file-size", "64K") == 0
    c = Container(tmp_path / "out")
    ref = local_ref("tiny-fp8", "--max-file-size", "64K")
    digests = {n: e.sha256 for n, e in c.manifest.tensors.items()}
    assert digests == {n: e.sha256 for n, e in ref.manifest.tensors.items()}
    assert c.model_hash != ref.model_hash  # different source files, so a different source record


def test_dry_run_lists_files_sizes_and_disk(hub, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)  # the endpoint may come from the environment
    before = len(hub.requests)
    assert convert_main([BF16, str(tmp_path / "out"), "--dry-run", "--preset", "q2"]) == 0
    text = capsys.readouterr().out
    commit = hub.repos[BF16].refs["main"]
    assert f"source: {BF16} @ {commit}" in text
    for shard in SHARDS:
        assert shard in text
    assert "download: 1.2 MB" in text
    for line in ("f32      2.4 MB", "q8     795.1 kB", "q4     469.5 kB", "q2     371.1 kB  <- selected"):
        assert line in text
    assert "disk needed in" in text and "shards in flight" in text
    assert not (tmp_path / "out").exists()
    # only metadata and ranged header reads, never a whole shard
    assert not [r for r in hub.requests[before:] if r[0] == "GET" and r[1].endswith(".safetensors") and not r[2]]


# --- resume ---------------------------------------------------------------------------------------------------

def test_kill_9_then_resume_is_byte_identical(hub, tmp_path, capsys):
    args = ("--max-inflight", "0", "--max-file-size", "64K")
    assert run_hub(hub, BF16, tmp_path / "ref", *args) == 0
    ref = Container(tmp_path / "ref")
    out = tmp_path / "out"
    proc = start_held_converter(hub, tmp_path, out, *args)
    wait_for(lambda: (out / ".glm-convert" / "done.jsonl").is_file()
             and (out / ".glm-convert" / "done.jsonl").read_text().count("\n") >= 2, "two data files")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    hub.release()
    done = [json.loads(line)["file"] for line in (out / ".glm-convert" / "done.jsonl").read_text().splitlines()]
    kept = {name: (out / name).stat() for name in done}
    assert not (out / "manifest.json").exists() and len(done) < len(ref.manifest.files)

    assert run_hub(hub, BF16, out, *args) == 0
    captured = capsys.readouterr()
    assert f"resuming {out}: {len(done)} of {len(ref.manifest.files)} data files already converted" in captured.err
    assert f"(resumed after {len(done)} complete data files)" in captured.out
    same_files(Container(out), ref)
    for name, st in kept.items():  # completed files were not rewritten
        assert (out / name).stat().st_ino == st.st_ino and (out / name).stat().st_mtime_ns == st.st_mtime_ns
    assert not (out / ".glm-convert").exists() and not list(out.glob("*.tmp"))


def test_failed_run_resumes_only_with_the_same_inputs(hub, tmp_path, capsys):
    """A corrupted shard fails twice (clear error, state kept); other inputs are refused; the same command resumes."""
    out = tmp_path / "out"
    hub.corrupt(BF16, SHARDS[2], times=2)
    assert run_hub(hub, BF16, out, "--max-inflight", "0", "--max-file-size", "64K") == 1
    err = error_line(capsys)
    assert SHARDS[2] in err and "downloaded twice" in err and "sha256" in err
    assert not (out / "manifest.json").exists() and not (out / ".glm-convert" / "source" / SHARDS[2]).exists()
    assert (out / ".glm-convert" / "done.jsonl").read_text().count("\n") >= 1

    assert run_hub(hub, BF16, out, "--preset", "q8", "--max-file-size", "64K") == 1
    err = error_line(capsys)
    assert 'conversion.preset: "q4" in OUT vs "q8" now' in err and "--force" in err
    assert run_hub(hub, BF16, out, "--revision", "v2", "--max-file-size", "64K") == 1
    err = error_line(capsys)
    main = hub.repos[BF16].refs["main"]
    assert f'source.revision: "{main}" in OUT vs "{hub.repos[BF16].refs["v2"]}" now' in err
    assert f"rerun that command (with --revision {main}) to finish it" in err
    assert convert_main([str(FIXTURES / "tiny-bf16"), str(out), "--quiet", "--max-file-size", "64K"]) == 1
    assert 'source.kind: "hub" in OUT vs "local" now' in error_line(capsys)
    assert run_hub(hub, BF16, out) == 1
    assert "max_file_bytes: 65536 in OUT vs 4294967296 now" in error_line(capsys)

    assert run_hub(hub, BF16, out, "--max-file-size", "64K") == 0  # --max-inflight does not matter
    assert run_hub(hub, BF16, tmp_path / "ref", "--max-file-size", "64K") == 0
    same_files(Container(out), Container(tmp_path / "ref"))


def test_local_source_resumes_too(local_ref, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    real = fail_reading(monkeypatch, "model.layers.3.")
    args = [str(FIXTURES / "tiny-bf16"), str(out), "--quiet", "--max-file-size", "64K"]
    assert convert_main(args) == 1
    assert "simulated read failure" in error_line(capsys)
    monkeypatch.setattr(HFSnapshot, "load", real)
    assert convert_main(args) == 0
    assert "data files already converted" in capsys.readouterr().err
    same_files(Container(out), local_ref("tiny-bf16", "--max-file-size", "64K"))


def test_model_hash_covers_source_digests_not_origin(local_ref, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(local_ref("tiny-bf16").directory, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["source"]["origin"] = {"kind": "hub", "repo": "somewhere/else", "revision": "0" * 40}
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert Container(out).model_hash == local_ref("tiny-bf16").model_hash
    manifest["source"]["files"][SHARDS[0]]["sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GlmkitError, match="does not match its model hash"):
        Container(out)


def test_force_starts_over_with_other_inputs(hub, tmp_path, capsys):
    out = tmp_path / "out"
    hub.corrupt(BF16, SHARDS[2], times=2)
    assert run_hub(hub, BF16, out, "--max-file-size", "64K") == 1
    capsys.readouterr()
    assert run_hub(hub, BF16, out, "--preset", "q8", "--force") == 0
    c = Container(out)
    assert c.manifest.conversion["preset"] == "q8" and len(c.manifest.files) == 1
    assert sorted(p.name for p in out.glob("model-*")) == ["model-00001-of-00001.safetensors"]


def test_two_converters_on_one_out(hub, tmp_path, capsys):
    out = tmp_path / "out"
    proc = start_held_converter(hub, tmp_path, out, "--max-inflight", "0")
    try:
        assert run_hub(hub, BF16, out, "--max-inflight", "0") == 1
        err = error_line(capsys)
        assert f"another glm-convert (pid {proc.pid}) is converting into this directory" in err
        assert run_hub(hub, BF16, out, "--preset", "q8", "--force") == 1  # --force does not break the lock
        assert "another glm-convert" in error_line(capsys)
    finally:
        hub.release()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()
    Container(out)


# --- verification and errors ----------------------------------------------------------------------------------

def test_corrupted_download_is_fetched_again(hub, local_ref, tmp_path, capsys):
    hub.corrupt(BF16, SHARDS[1], times=1)
    before = hub.downloads(SHARDS[1])
    assert run_hub(hub, BF16, tmp_path / "out") == 0
    assert hub.downloads(SHARDS[1]) - before == 2
    err = capsys.readouterr().err
    assert f"{SHARDS[1]}: sha256 " in err and "does not match the Hub's" in err and "downloading it again" in err
    same_files(Container(tmp_path / "out"), local_ref("tiny-bf16"))


def test_repo_and_revision_not_found(hub, tmp_path, capsys):
    assert run_hub(hub, "org/nope", tmp_path / "out") == 1
    err = error_line(capsys)
    assert f"org/nope: repository not found on {hub.endpoint}" in err and "HF_TOKEN" in err
    assert run_hub(hub, BF16, tmp_path / "out", "--revision", "no-such-branch") == 1
    assert f"{BF16}: revision 'no-such-branch' not found" in error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_unauthorized_hints_at_hf_token(hub, tmp_path, capsys, monkeypatch):
    assert run_hub(hub, "org/private", tmp_path / "out") == 1
    err = error_line(capsys)
    assert "401 Unauthorized" in err and "no token was sent: set HF_TOKEN or run `hf auth login`" in err
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    assert run_hub(hub, "org/private", tmp_path / "out") == 1
    assert "the token from HF_TOKEN (or `hf auth login`) was rejected" in error_line(capsys)
    monkeypatch.setenv("HF_TOKEN", PRIVATE_TOKEN)
    assert run_hub(hub, "org/private", tmp_path / "out", "--dry-run") == 0
    assert "org/private @" in capsys.readouterr().out


def test_not_enough_disk_is_refused_up_front(hub, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(convert_module, "free_bytes", lambda path: 2_000_000)
    before = hub.downloads(SHARDS[0])
    assert run_hub(hub, BF16, tmp_path / "out") == 1  # ~1.0 MB output + 1.2 MB of shards in flight
    err = error_line(capsys)
    assert "not enough disk space: needs 2.2 MB" in err and "available" in err and "--max-inflight" in err
    assert "--force" in err and not (tmp_path / "out").exists() and hub.downloads(SHARDS[0]) == before
    assert run_hub(hub, BF16, tmp_path / "out", "--max-inflight", "0") == 0  # 1.0 MB + 0.8 MB (2 shards) fits
    assert run_hub(hub, BF16, tmp_path / "forced", "--force") == 0


def test_source_errors_name_the_hub_file(hub, tmp_path, capsys):
    files = _fixture_files("tiny-bf16")
    files["config.json"] = json.dumps({**json.loads(files["config.json"]), "model_type": "llama"}).encode()
    hub.add_repo("org/llama", files)
    assert run_hub(hub, "org/llama", tmp_path / "out") == 1
    err = error_line(capsys)
    assert "org/llama@" in err and "/config.json" in err and "unsupported model_type 'llama'" in err
    assert "glm-convert-meta" not in err and not (tmp_path / "out").exists()


# --- Hugging Face cache ---------------------------------------------------------------------------------------

def test_keep_source_then_cache_hits_and_cache_dir_as_source(hub, local_ref, tmp_path):
    cache = Path(constants.HF_HUB_CACHE)
    before = {s: hub.downloads(s) for s in SHARDS}
    assert run_hub(hub, BF16, tmp_path / "a", "--keep-source") == 0
    ref = local_ref("tiny-bf16")
    same_files(Container(tmp_path / "a"), ref)
    repo_dir = cache / "models--org--tiny-bf16"
    commit = hub.repos[BF16].refs["main"]
    assert all((repo_dir / "snapshots" / commit / s).is_file() for s in SHARDS)

    assert run_hub(hub, BF16, tmp_path / "b") == 0  # served from the cache: no shard downloaded again
    assert {s: hub.downloads(s) - before[s] for s in SHARDS} == dict.fromkeys(SHARDS, 1)
    assert all((repo_dir / "snapshots" / commit / s).is_file() for s in SHARDS)  # the cache is never cleaned
    same_files(Container(tmp_path / "b"), ref)

    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    for source in (repo_dir, repo_dir / "snapshots" / commit):
        out = tmp_path / f"from-{source.name}"
        assert convert_main([str(source), str(out), "--quiet"]) == 0
        c = Container(out)
        same_files(c, ref)
        assert c.manifest.source["origin"] == {"kind": "hf-cache", "repo": BF16, "revision": commit,
                                               "path": str((repo_dir / "snapshots" / commit).resolve())}


def test_cache_dir_with_unknown_revision(tmp_path, capsys):
    repo_dir = tmp_path / "models--org--x"
    (repo_dir / "snapshots").mkdir(parents=True)
    assert convert_main([str(repo_dir), str(tmp_path / "out"), "--quiet", "--revision", "v9"]) == 1
    assert "has no ref 'v9'" in error_line(capsys)


# --- the fetcher on its own -------------------------------------------------------------------------------------

class _Snapshot:
    def __init__(self):
        self.paths: dict[str, Path] = {}

    def attach(self, name, path):
        self.paths[name] = path

    def detach(self, name):
        del self.paths[name]


class _Store:
    def __init__(self, sizes):
        self.sizes, self.on_disk, self.peak, self.fetched = sizes, set(), 0, []

    def fetch(self, name):
        self.on_disk.add(name)
        self.fetched.append(name)
        self.peak = max(self.peak, sum(self.sizes[n] for n in self.on_disk))
        return Path(name)

    def discard(self, name, path):
        self.on_disk.remove(name)


@pytest.mark.parametrize("budget", [0, 5, 12, 100])
def test_fetcher_disk_bound_and_order(budget):
    sizes = {"a": 4, "b": 3, "c": 5, "d": 2, "e": 6}
    steps = [{"a"}, {"a", "c"}, {"b"}, {"c"}, {"d", "e"}, {"d"}, {"a"}, {"e"}]
    store = _Store(sizes)
    snapshot = _Snapshot()
    fetcher = ShardFetcher(store, snapshot, steps, sizes, budget)
    for i, needed in enumerate(steps):
        fetcher.acquire(i)
        assert needed <= set(snapshot.paths)
        fetcher.release(i)
    fetcher.close()
    assert store.on_disk == set() and snapshot.paths == {}
    assert store.fetched == ["a", "c", "b", "d", "e"]  # first-need order, each once
    bound = max(budget, peak_alive_bytes(steps, sizes))
    assert store.peak <= bound and fetcher.peak_bytes <= bound
    assert peak_alive_bytes(steps, sizes) == 12  # a + c + b alive at step 2


def test_fetcher_hands_download_errors_to_the_converter():
    class Failing(_Store):
        def fetch(self, name):
            raise OSError(f"{name}: boom")

    fetcher = ShardFetcher(Failing({"a": 1}), _Snapshot(), [{"a"}], {"a": 1}, 0)
    with pytest.raises(OSError, match="a: boom"):
        fetcher.acquire(0)
    fetcher.close()


def test_calibrate_from_the_hub_equals_local(hub, local_ref, tmp_path):
    """--calibrate with a Hub source: the repo streams once, a layer's shards held while it is calibrated and
    converted; the container equals the same command on a local copy."""
    calib = FIXTURES / "tiny-trained" / "calib_tokens.json"  # token ids below tiny-bf16's vocabulary too
    args = ("--preset", "q4", "--calibrate", str(calib), "--calibrate-windows", "2")
    out = tmp_path / "out"
    assert run_hub(hub, BF16, out, *args) == 0
    from_hub = Container(out)
    assert from_hub.manifest.conversion["quantizer"] == "gptq" and from_hub.manifest.conversion["calibration"]["tokens"]
    same_files(from_hub, local_ref("tiny-bf16", *args))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary container or staging left
    # a layer's tensors and their FP8 scales in different shards, one shard in flight at a time: each downloaded once
    split = tmp_path / "split"
    before = {s: hub.downloads(s) for s in SHARDS}
    assert run_hub(hub, "org/tiny-fp8-split", split, *args, "--max-inflight", "0") == 0
    assert {s: hub.downloads(s) - before[s] for s in SHARDS} == dict.fromkeys(SHARDS, 1)
    digests = {n: e.sha256 for n, e in Container(split).manifest.tensors.items()}
    assert digests == {n: e.sha256 for n, e in local_ref("tiny-fp8", *args).manifest.tensors.items()}
