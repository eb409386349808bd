"""Seeded, bounded fuzzing of opening a container (run with `pytest -s` to see the table).

Two families of damaged copies of one converted fixture:
- corrupted: byte flips, zeroed blocks, truncations and extensions of the data files, manifest.json and
  config.json; deleted or swapped files; a file replaced by a FIFO, a directory, an empty or a sparse 1 GB file, a
  symlink loop or a symlink to /dev/zero, to a copy outside the container or to another data file;
- crafted: manifest.json (or config.json) edited and the model hash recomputed with the manifest module's own
  `content_hash`: random values in random fields, entries and expert ranges removed, added, renamed or swapped,
  coordinated edits that keep sizes consistent (other bits, other dtype, another group size, swapped offsets).

Each case must end in one of two ways: opening raises one GlmkitError line naming the container, or the open
gives every tensor bit-identical to the pristine container (same names, roles, shapes, dtypes, quantization,
bytes; same expert ranges' bytes; same config). A corrupted case whose tensor bytes differ may also be caught by
`verify_data()` instead. Anything else is counted as bad: another exception (traceback), no answer within
CASE_SECONDS (hang), an allocation past CASE_MEMORY_BYTES more than the process held (memory blow-up: the
case runs under that RLIMIT_DATA), different tensors (silent wrong), or a file of the container changed by the
reader (data lost). Cases start from hard links to the pristine files: a mutation writes a new file, never
through a link.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from glmkit.errors import GlmkitError
from glmkit.format.manifest import content_hash
from glmkit.format.reader import Container
from tests.runtime_support import FIXTURES, convert

SEED = 20261201
CASES = {"corrupted": 400, "crafted": 700}
CASE_SECONDS = 10
CASE_MEMORY_BYTES = 64 << 20  # the container is 0.7 MB
COLUMNS = ("tried", "clean error", "same tensors", "traceback", "hang", "memory blow-up", "silent wrong",
           "data lost")
BAD = ("traceback", "hang", "memory blow-up", "silent wrong", "data lost")


class CaseHang(BaseException):
    """Raised by the alarm when a case runs past CASE_SECONDS (a BaseException: no handler swallows it)."""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-bf16 at q4 (int4 experts, int8 embed, F32 norms and router) in three data files."""
    out = tmp_path_factory.mktemp("fuzz") / "container"
    return convert(FIXTURES / "tiny-bf16", out, "q4", "--quantizer", "absmax", "--max-file-size", "200K")


def contents(c: Container) -> dict[str, Any]:
    """What a reader of `c` computes with: every tensor's entry but its place and digest, its stored bytes, and
    every expert range's bytes."""
    tensors = {name: (e.role, e.shape, e.dtype, e.quant, c.raw(name).tobytes())
               for name, e in c.manifest.tensors.items()}
    experts = {(r.layer, r.expert): c.expert_bytes(r.layer, r.expert).tobytes() for r in c.manifest.experts}
    return {"tensors": tensors, "experts": experts}


def rewrite(path: Path, data: bytes) -> None:
    """Replace the file with new content as a new file (the old one may be a hard link to the pristine copy)."""
    path.unlink()
    path.write_bytes(data)


def listing(directory: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry of the container directory as the reader must leave it: kind, and size and digest of regular
    files or the target of symlinks (nothing is opened but regular files)."""
    out: dict[str, tuple[Any, ...]] = {}
    for entry in os.scandir(directory):
        if entry.is_symlink():
            out[entry.name] = ("symlink", os.readlink(entry.path))
        elif entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            small = st.st_size <= 16 << 20  # a sparse 1 GB file is told by its size and change time
            digest = hashlib.sha256(Path(entry.path).read_bytes()).hexdigest() if small else st.st_mtime_ns
            out[entry.name] = ("file", st.st_size, digest)
        else:
            out[entry.name] = ("other", entry.stat(follow_symlinks=False).st_mode)
    return out


class Fixture:
    """The pristine container's facts the mutations draw from."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.manifest = json.loads((directory / "manifest.json").read_text())
        self.config = json.loads((directory / "config.json").read_text())
        self.data_files = sorted(self.manifest["files"])
        self.header_bytes = {}
        for name in self.data_files:
            with open(directory / name, "rb") as f:
                self.header_bytes[name] = 8 + struct.unpack("<Q", f.read(8))[0]


# ---- corrupted: damage to the files themselves ----------------------------------------------------------------

def _pick_file(rng: random.Random, fx: Fixture) -> str:
    return rng.choice([*fx.data_files, *fx.data_files, "manifest.json", "config.json"])


def flip(rng: random.Random, fx: Fixture, d: Path) -> str:
    name = _pick_file(rng, fx)
    raw = bytearray((d / name).read_bytes())
    header = fx.header_bytes.get(name, len(raw))
    spots = [rng.randrange(header) if rng.random() < 0.5 else rng.randrange(len(raw))
             for _ in range(rng.choice((1, 1, 1, 2, 8)))]
    for spot in spots:
        raw[spot] ^= rng.randrange(1, 256)
    rewrite(d / name, bytes(raw))
    return f"flip {name} at {spots}"


def zero_block(rng: random.Random, fx: Fixture, d: Path) -> str:
    name = rng.choice(fx.data_files)
    raw = bytearray((d / name).read_bytes())
    start = rng.randrange(len(raw))
    raw[start:start + 4096] = bytes(len(raw[start:start + 4096]))
    rewrite(d / name, bytes(raw))
    return f"zero 4096 bytes of {name} at {start}"


def truncate(rng: random.Random, fx: Fixture, d: Path) -> str:
    name = _pick_file(rng, fx)
    raw = (d / name).read_bytes()
    keep = rng.choice((0, 1, 7, 8, 9, rng.randrange(len(raw)), len(raw) - 1))
    rewrite(d / name, raw[:keep])
    return f"truncate {name} to {keep}"


def extend(rng: random.Random, fx: Fixture, d: Path) -> str:
    name = _pick_file(rng, fx)
    extra = rng.randbytes(rng.choice((1, 64, 4096)))
    rewrite(d / name, (d / name).read_bytes() + extra)
    return f"append {len(extra)} bytes to {name}"


def delete(rng: random.Random, fx: Fixture, d: Path) -> str:
    name = _pick_file(rng, fx)
    (d / name).unlink()
    return f"delete {name}"


def swap_files(rng: random.Random, fx: Fixture, d: Path) -> str:
    a, b = rng.sample(fx.data_files, 2)
    (d / a).rename(d / "swap.tmp")
    (d / b).rename(d / a)
    (d / "swap.tmp").rename(d / b)
    return f"swap {a} and {b}"


def replace(rng: random.Random, fx: Fixture, d: Path) -> str:
    name = _pick_file(rng, fx)
    how = rng.choice(("fifo", "directory", "empty", "sparse 1 GB", "loop", "/dev/zero", "outside", "other data file"))
    outside = d.parent / f"{d.name}-outside" / name
    outside.parent.mkdir()
    shutil.copyfile(d / name, outside)  # the very same bytes, but not in the container
    (d / name).unlink()
    if how == "fifo":
        os.mkfifo(d / name)
    elif how == "directory":
        (d / name).mkdir()
    elif how == "empty":
        (d / name).write_bytes(b"")
    elif how == "sparse 1 GB":
        with open(d / name, "wb") as f:
            f.truncate(1 << 30)
    elif how == "loop":
        (d / name).symlink_to(name)
    elif how == "/dev/zero":
        (d / name).symlink_to("/dev/zero")
    elif how == "outside":
        (d / name).symlink_to(outside)
    else:
        (d / name).symlink_to(rng.choice([f for f in fx.data_files if f != name]))
    return f"replace {name} by {how}"


CORRUPTIONS: list[tuple[Callable[[random.Random, Fixture, Path], str], int]] = [
    (flip, 8), (zero_block, 2), (truncate, 3), (extend, 2), (delete, 1), (swap_files, 1), (replace, 3)]
# an open after these has read something that is not the container's own regular file: wrong even if identical
MUST_REFUSE = ("delete", "replace")


# ---- crafted: a consistent-looking manifest that lies ----------------------------------------------------------

def _evil(rng: random.Random, fx: Fixture, value: Any) -> Any:
    """A value for a field that held `value`: near misses, other types, other valid values of the format."""
    pool: list[Any] = [None, True, False, 0, -1, 1, 3, 63, 64, 65, 2**31, 2**63, 2**64, 10**30, 0.5, 1e308, -0.0,
                       float("nan"), float("inf"), "", "x", "F16", "BF16", "U8", "F32", "I8", "norm", "scales",
                       "routed_expert", "symmetric", "../x.safetensors", "/etc/passwd", "sub/x.safetensors",
                       "manifest.json", "a" * 5000, rng.choice(fx.data_files), [], [0], [1], [64], [-1], [64, 64],
                       [1, 2, 3], ["64"], [True], [64.0], {}, {"bits": 4}, [[[[]]]]]
    if isinstance(value, bool):
        pool += [not value]
    elif isinstance(value, int):
        pool += [value + 1, value - 1, value + 64, value - 64, value * 2, value // 2, -value, float(value),
                 str(value), value + 0.5]
    elif isinstance(value, list):
        pool += [value[::-1], [*value, 1], value[:-1], [v + 1 if isinstance(v, int) else v for v in value],
                 [v * 2 if isinstance(v, int) else v for v in value]]
    elif isinstance(value, str):
        pool += [value + "x", value.upper(), value[:-1], value + ".qs", value.replace("1", "2")]
    return rng.choice(pool)


def _leaf_paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(node, dict):
        return [prefix] + [p for k, v in node.items() for p in _leaf_paths(v, (*prefix, k))]
    if isinstance(node, list):
        return [prefix] + [p for i, v in enumerate(node) for p in _leaf_paths(v, (*prefix, i))]
    return [prefix]


def _set(node: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        node = node[key]
    return node


def field_edit(rng: random.Random, fx: Fixture, m: dict[str, Any], d: Path) -> str:
    """One random value at one random place: mostly inside a tensor entry, else anywhere in the manifest."""
    if rng.random() < 0.6:
        name = rng.choice(list(m["tensors"]))
        root: Any = m["tensors"][name]
        prefix: tuple[Any, ...] = ("tensors", name)
    elif rng.random() < 0.4:
        i = rng.randrange(len(m["experts"]))
        root, prefix = m["experts"][i], ("experts", i)
    else:
        root, prefix = m, ()
    path = rng.choice([p for p in _leaf_paths(root) if p])
    old = _get(root, path)
    new = _evil(rng, fx, old)
    _set(root, path, new)
    return f"set {[*prefix, *path]} from {str(old)[:40]} to {str(new)[:40]}"


def structure_edit(rng: random.Random, fx: Fixture, m: dict[str, Any], d: Path) -> str:
    """Entries and ranges removed, added, renamed, duplicated; keys removed or added."""
    tensors, experts, files = m["tensors"], m["experts"], m["files"]
    name = rng.choice(list(tensors))
    what = rng.choice(("drop tensor", "copy tensor", "rename tensor", "drop key", "add key", "drop expert",
                       "copy expert", "clear experts", "drop file record", "add file record", "drop top key",
                       "add top key"))
    if what == "drop tensor":
        del tensors[name]
    elif what == "copy tensor":
        tensors[rng.choice((name.replace("layers.1.", "layers.2."), name + ".extra", "lm_head.bias"))] = \
            json.loads(json.dumps(tensors[name]))
    elif what == "rename tensor":
        tensors[rng.choice((name.upper(), name + ".qs", name.replace(".weight", ".bias")))] = tensors.pop(name)
    elif what == "drop key":
        tensors[name].pop(rng.choice(list(tensors[name])))
    elif what == "add key":
        tensors[name][rng.choice(("extra", "offset2", "quantized"))] = 1
    elif what == "drop expert":
        experts.pop(rng.randrange(len(experts)))
    elif what == "copy expert":
        experts.append(dict(rng.choice(experts)))
    elif what == "clear experts":
        experts.clear()
    elif what == "drop file record":
        files.pop(rng.choice(list(files)))
    elif what == "add file record":
        files["model-00009-of-00009.safetensors"] = {"nbytes": 4096, "sha256": "0" * 64}
    elif what == "drop top key":
        m.pop(rng.choice([k for k in m if k != "model_hash"]))
    else:
        m["signature"] = "x"
    return f"{what} ({name})"


def consistent_edit(rng: random.Random, fx: Fixture, m: dict[str, Any], d: Path) -> str:
    """Edits that keep every size self-consistent, so only the format's rules and the data can refute them."""
    tensors = m["tensors"]
    packed = [n for n, e in tensors.items() if e["quant"]]
    floats = [n for n, e in tensors.items() if not e["quant"]]
    what = rng.choice(("bits", "dtype", "group", "swap", "header", "rename file", "mtp", "conversion bits"))
    if what == "bits":
        e = tensors[rng.choice(packed)]
        bits = rng.choice((2, 3, 4, 5, 8, 16))
        e["quant"]["bits"] = bits
        e["nbytes"] = e["shape"][0] * ((e["shape"][1] * bits + 7) // 8)
        return f"bits {bits} on {e['quant']['scales'][:-3]}"
    if what == "dtype":
        name = rng.choice(floats)
        dtype, size = rng.choice((("F16", 2), ("BF16", 2), ("F64", 8), ("I32", 4), ("U8", 1)))
        tensors[name]["dtype"] = dtype
        tensors[name]["nbytes"] = tensors[name]["nbytes"] // 4 * size
        return f"dtype {dtype} on {name}"
    if what == "group":
        name = rng.choice(packed)
        group = rng.choice((None, 1, 16, 32, 128))
        e, qs = tensors[name], tensors[name + ".qs"]
        e["quant"]["group_size"] = group
        qs["shape"] = [e["shape"][0]] if group is None else [e["shape"][0], -(-e["shape"][1] // group)]
        qs["nbytes"] = 4 * e["shape"][0] * (1 if group is None else qs["shape"][1])
        return f"group {group} on {name}"
    if what == "swap":
        name = rng.choice(list(tensors))
        same = [n for n, e in tensors.items() if n != name and e["nbytes"] == tensors[name]["nbytes"]
                and e["file"] == tensors[name]["file"]]
        if not same:
            return "swap: none of the same size"
        other = rng.choice(same)
        a, b = tensors[name], tensors[other]
        for key in ("offset", "sha256") if rng.random() < 0.5 else ("offset",):
            a[key], b[key] = b[key], a[key]
        return f"swap offsets of {name} and {other}"
    if what == "header":
        name = rng.choice(list(tensors))
        tensors[name]["offset"] = rng.choice((0, 64))
        return f"{name} moved into the safetensors header"
    if what == "rename file":  # consistent everywhere and on disk: a legitimate container with other names
        old = rng.choice(fx.data_files)
        new = rng.choice(("renamed.safetensors", "a-b.safetensors"))
        m["files"][new] = m["files"].pop(old)
        for entry in [*tensors.values(), *m["experts"]]:
            if entry["file"] == old:
                entry["file"] = new
        (d / old).rename(d / new)
        return f"rename {old} to {new} (on disk too)"
    if what == "mtp":
        m["conversion"]["mtp"] = not m["conversion"]["mtp"]
        return "conversion mtp flipped"
    role = rng.choice(list(m["conversion"]["bits"]) + ["norm", "router", "lm_head"])
    m["conversion"]["bits"][role] = rng.choice((2, 4, 8))
    return f"conversion bits of {role}"


# the keys that decide which tensors the model has and their shapes (others change the model, not its tensors)
CONFIG_KEYS = ("num_hidden_layers", "hidden_size", "n_routed_experts", "first_k_dense_replace", "moe_intermediate_size",
               "num_nextn_predict_layers", "vocab_size", "q_lora_rank", "index_head_dim", "n_shared_experts",
               "intermediate_size", "index_topk_freq", "num_attention_heads")


def config_edit(rng: random.Random, fx: Fixture, m: dict[str, Any], d: Path) -> str:
    """config.json edited and its new digest recorded in the manifest."""
    config = json.loads((d / "config.json").read_text())
    key = rng.choice(CONFIG_KEYS)
    config[key] = _evil(rng, fx, config.get(key)) if rng.random() < 0.3 else rng.choice(
        (config[key] + 1, config[key] - 1, config[key] * 2, 0))
    rewrite(d / "config.json", json.dumps(config).encode())
    m["config_sha256"] = hashlib.sha256((d / "config.json").read_bytes()).hexdigest()
    return f"config {key} = {config[key]}"


def craft(rng: random.Random, fx: Fixture, d: Path) -> str:
    m = json.loads((d / "manifest.json").read_text())
    edit = rng.choices((field_edit, structure_edit, consistent_edit, config_edit), (5, 2, 3, 1))[0]
    what = edit(rng, fx, m, d)
    m["model_hash"] = content_hash(m)
    rewrite(d / "manifest.json", json.dumps(m).encode())
    return what


# ---- running the cases ----------------------------------------------------------------------------------------

def data_bytes() -> int:
    """The process's data segment and private writable mappings now (what RLIMIT_DATA bounds)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))


def run_case(d: Path, reference: dict[str, Any], corrupted: bool, must_refuse: bool) -> tuple[str, str]:
    """(outcome, detail) of opening the damaged container `d` (and verifying it, when a corrupted one opens with
    other tensor bytes)."""
    before = listing(d)

    def on_alarm(signum: int, frame: Any) -> None:
        raise CaseHang()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    limits = resource.getrlimit(resource.RLIMIT_DATA)
    bound = data_bytes() + CASE_MEMORY_BYTES
    resource.setrlimit(resource.RLIMIT_DATA, (bound if limits[1] == resource.RLIM_INFINITY else min(bound, limits[1]),
                                              limits[1]))
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    try:
        try:
            c = Container(d)
        except GlmkitError as e:
            message = str(e)
            clean = "\n" not in message and str(d) in message
            outcome, detail = ("clean error" if clean else "traceback"), message
        else:
            try:
                same = contents(c) == reference
                if same and not must_refuse:
                    outcome, detail = "same tensors", ""
                elif corrupted and not must_refuse and c.verify_data():
                    outcome, detail = "clean error", "verify_data"
                else:
                    outcome, detail = "silent wrong", "opened" + (" identical" if same else "")
            except GlmkitError as e:
                outcome, detail = "clean error", f"verify_data: {e}"
            finally:
                c.close()
    except CaseHang:
        outcome, detail = "hang", ""
    except MemoryError:
        outcome, detail = "memory blow-up", "MemoryError"
    except Exception as e:
        outcome, detail = "traceback", f"{type(e).__name__}: {e}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_DATA, limits)
    if listing(d) != before:
        outcome, detail = "data lost", "the container's files changed"
    return outcome, detail


def test_fuzz_container(pristine, tmp_path):
    fx = Fixture(pristine)
    untouched = listing(pristine)
    c = Container(pristine)
    reference = contents(c)
    assert c.verify_data() == []
    c.close()
    rng = random.Random(SEED)
    counts = {family: collections.Counter() for family in CASES}
    bad: list[str] = []
    for family, cases in CASES.items():
        for i in range(cases):
            case_rng = random.Random(rng.getrandbits(64))
            d = tmp_path / f"{family}-{i}"
            shutil.copytree(pristine, d, copy_function=os.link)
            if family == "crafted":
                what = craft(case_rng, fx, d)
                must_refuse = False
            else:
                mutate = case_rng.choices([m for m, _ in CORRUPTIONS], [w for _, w in CORRUPTIONS])[0]
                what = mutate(case_rng, fx, d)
                must_refuse = mutate.__name__ in MUST_REFUSE and not what.endswith("by other data file")
            outcome, detail = run_case(d, reference, family == "corrupted", must_refuse)
            counts[family][outcome] += 1
            counts[family]["tried"] += 1
            if outcome in BAD:
                bad.append(f"{family} {i}: {what}: {outcome}: {detail}")
            shutil.rmtree(d)
            shutil.rmtree(tmp_path / f"{family}-{i}-outside", ignore_errors=True)
    width = max(len(c) for c in COLUMNS)
    print("\n" + " " * 10 + "".join(f"{c:>{width + 1}}" for c in COLUMNS))
    for family, counter in counts.items():
        print(f"{family:<10}" + "".join(f"{counter[c]:>{width + 1}}" for c in COLUMNS))
    assert not bad, "\n".join(bad[:20])
    assert listing(pristine) == untouched
    for family, counter in counts.items():  # the harness itself must reach both ways of passing
        assert counter["clean error"] > counter["tried"] // 4 and counter["same tensors"] > 0, (family, counter)
