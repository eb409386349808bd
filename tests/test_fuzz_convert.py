"""A bounded, seeded fuzz of glm-convert's inputs: mutated safetensors headers and bytes, mutated config.json and
side files, NaN/Inf injections, OUT overlapping SOURCE.

Every case runs `glmkit.cli.convert.main` in-process under a time and address-space limit and ends in one of:

- converted: exit 0 and the container reads back (glmkit.format.reader), its hashes verify, it holds exactly the
  tensors its config.json describes, every source shard passes the stock safetensors parser, and (f32 preset)
  every tensor equals an independent decoding of the mutated source, bit for bit;
- clean error: nonzero exit, stderr one line `glm-convert: error: ...`, and no manifest in OUT;
- traceback (an exception escaped, or the error was not one line), hang, memory blow-up, silent wrong (exit 0 but
  the output is not what the input says, or a failed run left a valid-looking manifest), data lost (a source
  file changed).

`pytest -s` prints the outcome table per category; the test asserts the bad columns are zero.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from glmkit.cli.convert import main as convert_main
from glmkit.convert.sources.snapshot import side_file_limit
from glmkit.errors import GlmkitError
from glmkit.format.reader import Container
from glmkit.format.schema import model_tensors
from tests.test_convert_defects import Hang, bounded, tree_digest
from tools.synth import TINY_CONFIG, make_snapshot

SEED = 1729
CASES_PER_CATEGORY = 60
OUTCOMES = ("converted", "clean error", "traceback", "hang", "memory blow-up", "silent wrong", "data lost")
BAD = OUTCOMES[2:]
NP_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
             "F8_E4M3": ml_dtypes.float8_e4m3fn}
HOSTILE_VALUES = [None, "4", "", 4.5, True, False, -1, 0, 1, 2, 3, 2**31, 2**63, 10**30, 1e308, float("nan"),
                  float("inf"), -float("inf"), [], [1], [[1]], {}, {"a": 1}, "glm_moe_dsa", ["full"], "F"]


# --- the source files ------------------------------------------------------------------------------------------------

def split_shard(path: Path) -> tuple[dict, bytes]:
    """(decoded header, data section) of a well-formed shard."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def join_shard(path: Path, header: object, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def random_tensor(rng: random.Random, header: dict) -> str:
    return rng.choice(sorted(n for n in header if n != "__metadata__"))


def decode_source(src: Path) -> dict[str, np.ndarray]:
    """Every tensor of the (mutated) source as float32, decoded here independently of the converter: per-expert
    names, BF16/F16/F32/F64 as they are, FP8 times its 128x128-block `weight_scale_inv`."""
    raw: dict[str, tuple[str, np.ndarray]] = {}
    for shard in sorted(src.glob("*.safetensors")):
        header, data = split_shard(shard)
        for name, e in header.items():
            if name != "__metadata__":
                begin, end = e["data_offsets"]
                raw[name] = (e["dtype"], np.frombuffer(data[begin:end], NP_DTYPES[e["dtype"]]).reshape(e["shape"]))
    out = {}
    for name, (dtype, a) in raw.items():
        if dtype == "F8_E4M3":
            scale = raw[name.removesuffix(".weight") + ".weight_scale_inv"][1].astype(np.float32)
            full = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[:a.shape[0], :a.shape[1]]
            out[name] = a.astype(np.float32) * full
        elif not name.endswith("_scale_inv"):
            out[name] = a.astype(np.float32)
    return out


def wrong_output(src: Path, out: Path, preset: str, allow_nonfinite: bool) -> str | None:
    """Why a successful conversion is not what its input says, or None."""
    try:
        c = Container(out)
    except GlmkitError as e:
        return f"the container does not read back: {e}"
    try:
        return _container_differs(src, c, allow_nonfinite)
    finally:
        c.close()


def _container_differs(src: Path, c: Container, allow_nonfinite: bool) -> str | None:
    """`wrong_output`'s checks of an opened container `c` against its source."""
    if bad := c.verify_data():
        return f"hashes do not verify: {bad[:2]}"
    for shard in src.glob("*.safetensors"):
        try:
            with safe_open(str(shard), "np"):
                pass
        except SafetensorError as e:
            return f"{shard.name}: accepted, but the safetensors library refuses it ({e})"
    expected = decode_source(src)
    names = {s.name for s in model_tensors(c.config, include_mtp=bool(c.manifest.conversion["mtp"]))}
    stored = {n for n, e in c.manifest.tensors.items() if e.role != "scales"}
    if stored != names:
        return f"tensors differ from the config's: {sorted(stored ^ names)[:3]}"
    if not allow_nonfinite and not all(np.isfinite(expected[n]).all() for n in names):
        return "non-finite source values converted without --allow-nonfinite"
    for name in sorted(names):
        w, stored = expected[name], c.weight(name)
        if c.manifest.tensors[name].quant is None:
            if not np.array_equal(stored, w, equal_nan=True):
                return f"{name}: differs from the source"
        elif np.isfinite(w).all():  # quantized: finite, and never off by more than the row's largest magnitude
            error = np.abs(stored.dequantize().astype(np.float64) - w)
            if not (error <= np.abs(w).max(axis=1, keepdims=True)).all():
                return f"{name}: dequantizes {float(np.nanmax(error)):.3g} away from the source"
    return None


# --- mutations: each edits the case's copy of a source and returns the extra command-line arguments -------------------

def mutate_header_bits(rng: random.Random, src: Path) -> list[str]:
    shard = src / "model.safetensors"
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    for _ in range(rng.randint(1, 3)):
        data[8 + rng.randrange(n)] ^= 1 << rng.randrange(8)
    shard.write_bytes(bytes(data))
    return []


def mutate_length_field(rng: random.Random, src: Path) -> list[str]:
    shard = src / "model.safetensors"
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    text, body = data[8:8 + n], data[8 + n:]
    if rng.random() < 0.3:  # padded header (as the safetensors library writes), then declared k bytes short
        pad = rng.randint(1, 8)
        text += b" " * pad
        length = len(text) - rng.randint(1, pad)
    else:
        length = rng.choice([n - 1, n + 1, n - 8, n + 8, 0, 1, len(data) - 8, len(data), 2**63, 2**64 - 1,
                             rng.randrange(len(data))])
    shard.write_bytes(length.to_bytes(8, "little") + text + body)
    return []


def mutate_truncate_or_append(rng: random.Random, src: Path) -> list[str]:
    shard = src / rng.choice(["model.safetensors", "model.safetensors", "config.json"])
    data = shard.read_bytes()
    if rng.random() < 0.7:
        shard.write_bytes(data[:rng.randrange(len(data))])
    else:
        shard.write_bytes(data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))))
    return []


def mutate_offsets(rng: random.Random, src: Path) -> list[str]:
    shard = src / "model.safetensors"
    header, data = split_shard(shard)
    name = random_tensor(rng, header)
    begin, end = header[name]["data_offsets"]
    other = header[random_tensor(rng, header)]["data_offsets"]
    k = rng.choice([1, 2, 64, -1, -2, -64])
    header[name]["data_offsets"] = rng.choice([
        [begin + k, end + k], [begin, end + k], [begin + k, end], list(other), [end, begin], [-1, end],
        [begin, begin], [float(begin), float(end)], [str(begin), end], [begin, end, end], [begin, 2**70], [True, end],
        [begin, len(data) + 1], None])
    join_shard(shard, header, data)
    return []


def mutate_dtype(rng: random.Random, src: Path) -> list[str]:
    shard = src / "model.safetensors"
    header, data = split_shard(shard)
    name = random_tensor(rng, header)
    header[name]["dtype"] = rng.choice(["F32", "F16", "BF16", "F8_E4M3", "F64", "I8", "U8", "I16", "BOOL", "F8_E5M2",
                                        "bf16", "", None, 3, ["BF16"], {"BF16": 1}])
    join_shard(shard, header, data)
    return []


def mutate_shape(rng: random.Random, src: Path) -> list[str]:
    shard = src / "model.safetensors"
    header, data = split_shard(shard)
    name = random_tensor(rng, header)
    shape = header[name]["shape"]
    i = rng.randrange(len(shape))
    changed = list(shape)
    changed[i] = rng.choice([shape[i] + 1, shape[i] - 1, 0, -shape[i], 2**40, float(shape[i]), True, str(shape[i])])
    header[name]["shape"] = rng.choice([
        changed, shape[::-1], [math.prod(shape)], [*shape, 1], [1, *shape], [], [shape], "shape", None,
        [math.prod(shape) * 2**20, 0]])
    join_shard(shard, header, data)
    return []


def mutate_entries(rng: random.Random, src: Path) -> list[str]:
    shard = src / "model.safetensors"
    header, data = split_shard(shard)
    name = random_tensor(rng, header)
    op = rng.randrange(9)
    if op == 0:  # entry gone, its bytes left behind
        del header[name]
    elif op == 1:  # entry and bytes gone, the rest laid out again
        tensors = {n: e for n, e in header.items() if n not in ("__metadata__", name)}
        pieces, pos = [], 0
        for e in tensors.values():
            b, f = e["data_offsets"]
            pieces.append(data[b:f])
            e["data_offsets"] = [pos, pos + f - b]
            pos += f - b
        header, data = tensors, b"".join(pieces)
    elif op == 2:  # an extra tensor, with its bytes
        extra = rng.choice(["model.layers.9.mlp.gate.weight", "model.layers.1.self_attn.indexer.wk.weight",
                            "model.layers.0.eh_proj.weight", "lm_head.weight_scale_inv", "junk"])
        header[extra] = {"dtype": "F32", "shape": [2], "data_offsets": [len(data), len(data) + 8]}
        data += bytes(8)
    elif op == 3:
        header["__metadata__"] = rng.choice([{"format": 1}, ["pt"], "pt", {"a": {"b": "c"}}, {"format": "pt"}])
    elif op == 4:
        header[name] = rng.choice([[], "x", 1, None, {}, {"dtype": "F32"}])
    elif op == 5:  # renamed
        header[name + rng.choice(["x", ".bias", "_scale_inv"])] = header.pop(name)
    elif op == 6:  # the same key twice in the JSON text
        text = json.dumps(header)
        entry = json.dumps({name: header[name]})[1:-1]
        text = text[:-1] + ", " + entry + "}"
        shard.write_bytes(len(text).to_bytes(8, "little") + text.encode() + data)
        return []
    elif op == 7:  # nested deep
        text = ("[" * 10**5 + "]" * 10**5) if rng.random() < 0.5 else json.dumps(header)[:-1] + (
            ', "__metadata__": {"x": ' + "[" * 200 + "]" * 200 + "}}")
        shard.write_bytes(len(text).to_bytes(8, "little") + text.encode() + data)
        return []
    else:
        header = rng.choice([[header], "header", 1, None])
    join_shard(shard, header, data)
    return []


def mutate_config_values(rng: random.Random, src: Path) -> list[str]:
    cfg = json.loads((src / "config.json").read_text())
    for _ in range(rng.randint(1, 2)):
        key = rng.choice(sorted(cfg))
        value = cfg[key]
        if isinstance(value, int) and not isinstance(value, bool) and rng.random() < 0.4:
            cfg[key] = value + rng.choice([-1, 1, value, -value])  # a near miss, often still a valid config
        else:
            choice = rng.choice(HOSTILE_VALUES)
            if choice is None:
                del cfg[key]
            else:
                cfg[key] = choice
    (src / "config.json").write_text(json.dumps(cfg))
    return []


def mutate_config_text(rng: random.Random, src: Path) -> list[str]:
    path = src / "config.json"
    text = path.read_text()
    op = rng.randrange(10)
    if op == 0:
        path.write_text(text[:-1] + ', "deep": ' + "[" * rng.choice([65, 999, 10**4, 10**6]) + "]}")
    elif op == 1:
        path.write_bytes(text.encode().replace(b"glm_moe_dsa", b"glm_moe_dsa\xff\xfe"))
    elif op == 2:
        key = rng.choice(sorted(json.loads(text)))
        path.write_text(text[:-1] + f', "{key}": {json.dumps(json.loads(text)[key])}' + "}")
    elif op == 3:
        path.write_text(rng.choice(["[]", '"config"', "1", "null", "", "{", "\ufeff" + text, "NaN"]))
    elif op == 4:
        path.write_text(text[:rng.randrange(len(text))])
    elif op == 5:
        with open(path, "r+b") as f:
            f.truncate(17 << 20)  # sparse: too big to be read at all
    elif op == 6:
        path.unlink()
        os.mkfifo(path)
    elif op == 7:
        path.unlink()
        path.symlink_to(rng.choice(["/dev/zero", "/dev/null", str(src), "/nonexistent"]))
    elif op == 8:
        path.unlink()
        path.mkdir()
    else:
        path.write_text(text.replace('"', "'", 1))
    return []


def mutate_side_files(rng: random.Random, src: Path) -> list[str]:
    """On a two-shard copy with model.safetensors.index.json."""
    name = rng.choice(["generation_config.json", "tokenizer.json", "model.safetensors.index.json"])
    path = src / name
    op = rng.randrange(6)
    if op == 0:
        path.unlink(missing_ok=True)
        os.mkfifo(path)
    elif op == 1:
        path.unlink(missing_ok=True)
        path.symlink_to("/dev/zero")
    elif op == 2:
        path.write_bytes(b"\xff\xfe{}")
    elif op == 3:
        path.write_text("[" * 10**5)
    elif op == 4:
        with open(path, "ab") as f:
            f.truncate(side_file_limit(name) + 1)  # sparse: one byte too many
    elif name == "model.safetensors.index.json":
        index = json.loads(path.read_text())
        some = rng.choice(sorted(index["weight_map"]))
        index["weight_map"][some] = rng.choice(["../model.safetensors", "missing.safetensors", 3, ".hidden"])
        path.write_text(json.dumps(rng.choice([index, {"weight_map": []}, []])))
    else:
        path.write_text('{"eos_token_id": [1], "eos_token_id": [2]}')
    return []


def mutate_nonfinite(rng: random.Random, src: Path) -> list[str]:
    """NaN/Inf in a BF16 or FP8 weight, or a bad FP8 scale; sometimes with --allow-nonfinite."""
    shard = src / "model.safetensors"
    header, _ = split_shard(shard)
    scales = [n for n in header if n.endswith("_scale_inv")]
    if scales and rng.random() < 0.5:
        name = rng.choice(scales)
        value = rng.choice([np.nan, np.inf, -np.inf, 0.0, -1.0, 1e30, 1e-45])
    else:
        name = random_tensor(rng, {n: e for n, e in header.items() if n not in scales})
        value = rng.choice([np.nan, np.inf, -np.inf, 3e38])
    e = header[name]
    dtype = NP_DTYPES.get(e["dtype"], np.float32)
    item = np.array([value], np.float32).astype(dtype).tobytes()
    count = (e["data_offsets"][1] - e["data_offsets"][0]) // len(item)
    n = int.from_bytes(shard.read_bytes()[:8], "little")
    with open(shard, "r+b") as f:
        f.seek(8 + n + e["data_offsets"][0] + rng.randrange(count) * len(item))
        f.write(item)
    return ["--allow-nonfinite"] if rng.random() < 0.3 else []


def mutate_data_bits(rng: random.Random, src: Path) -> list[str]:
    """A valid file with other weights: converts exactly (or fails if a flip made a NaN/Inf)."""
    shard = src / "model.safetensors"
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    for _ in range(rng.randint(1, 8)):
        data[8 + n + rng.randrange(len(data) - 8 - n)] ^= 1 << rng.randrange(8)
    shard.write_bytes(bytes(data))
    return []


Mutation = Callable[[random.Random, Path], list[str]]
# category -> (base source, mutation, presets drawn from)
CATEGORIES: dict[str, tuple[str, Mutation, tuple[str, ...]]] = {
    "header bit flips": ("bf16", mutate_header_bits, ("f32",)),
    "header length field": ("bf16", mutate_length_field, ("f32",)),
    "truncation / trailing bytes": ("bf16", mutate_truncate_or_append, ("f32",)),
    "data_offsets": ("bf16", mutate_offsets, ("f32",)),
    "dtypes": ("bf16", mutate_dtype, ("f32",)),
    "shapes": ("bf16", mutate_shape, ("f32",)),
    "header entries / JSON": ("bf16", mutate_entries, ("f32",)),
    "config.json values": ("bf16", mutate_config_values, ("f32",)),
    "config.json text / file": ("bf16", mutate_config_text, ("f32",)),
    "side files / index": ("bf16-sharded", mutate_side_files, ("f32",)),
    "NaN/Inf BF16": ("bf16", mutate_nonfinite, ("f32", "q4", "q8")),
    "NaN/Inf/bad scales FP8": ("fp8", mutate_nonfinite, ("f32", "q4")),
    "data bit flips": ("fp8", mutate_data_bits, ("f32",)),
}


RESUME_ARGS = ["--max-file-size", "16K"]


def interrupted_out(src: Path, out: Path) -> None:
    """OUT as a conversion of `src` (f32, RESUME_ARGS) left it when it failed after a few complete data files."""
    from glmkit.convert.sources.snapshot import HFSnapshot

    real = HFSnapshot.load

    def failing(self, spec):
        if spec.name.startswith("model.layers.2."):
            raise GlmkitError("simulated read failure")
        return real(self, spec)
    HFSnapshot.load = failing
    try:
        assert convert_main([str(src), str(out), "--quiet", "--preset", "f32", *RESUME_ARGS]) == 1
    finally:
        HFSnapshot.load = real
    assert (out / ".glm-convert" / "done.jsonl").read_text().count("\n") >= 2


def mutate_out_state(rng: random.Random, out: Path) -> list[str]:
    """A resume from tampered state: state.json, done.jsonl, a completed data file or a stray manifest."""
    state = out / ".glm-convert"
    done = sorted(p for p in out.glob("model-*.safetensors"))
    op = rng.randrange(8)
    target = rng.choice([state / "state.json", state / "done.jsonl", out / "manifest.json"])
    if op == 0:
        target.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randint(0, 200))))
    elif op == 1:
        target.write_text(rng.choice(["[]", "{}", '{"identity": []}', '{"identity": {"source": []}}',
                                      '{"file": 1, "record": [], "tensors": 2}', "[" * 10**5, "\xff"]))
    elif op == 2:
        target.unlink(missing_ok=True)
        if rng.random() < 0.5:
            os.mkfifo(target)
        else:
            target.symlink_to("/dev/zero")
    elif op == 3:  # a done.jsonl line whose record or entries lie
        lines = (state / "done.jsonl").read_text().splitlines()
        i = rng.randrange(len(lines))
        item = json.loads(lines[i])
        tensor = rng.choice(sorted(item["tensors"]))
        field = rng.choice(["offset", "nbytes", "shape", "dtype", "sha256", "file"])
        item["tensors"][tensor][field] = rng.choice([0, -1, 10**12, [1], "x", None, "F32"])
        if rng.random() < 0.3:
            item["record"] = rng.choice([{}, {"nbytes": "x"}, [], {"nbytes": 1, "sha256": "0" * 64}])
        lines[i] = json.dumps(item)
        (state / "done.jsonl").write_text("\n".join(lines) + "\n")
    elif op == 4:  # a completed data file edited in place (same size)
        path = rng.choice(done)
        data = bytearray(path.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    elif op == 5:
        path = rng.choice(done)
        path.write_bytes(path.read_bytes()[:rng.randrange(path.stat().st_size)])
    elif op == 6:
        rng.choice(done).unlink()
    else:
        (state / "done.jsonl").write_text((state / "done.jsonl").read_text() + rng.choice(["{", "[]\n", "1\n"]))
    return rng.choice([[], [], ["--force"]])


def overlap_case(rng: random.Random, root: Path, src: Path) -> tuple[Path, list[str]]:
    """OUT overlapping SOURCE: the same directory, inside, its parent, or through a symlink."""
    op = rng.randrange(4)
    if op == 3:
        (root / "link").symlink_to(src)
        return root / "link", ["--force"]
    return [src, src / "out", root][op], ["--force"] if rng.random() < 0.8 else []


# --- the harness ------------------------------------------------------------------------------------------------------

def run_case(capsys, src: Path, out: Path, args: list[str], preset: str) -> tuple[str, str]:
    """(outcome, detail) of one conversion."""
    before = tree_digest(src)
    rc, escaped = None, None
    try:
        with bounded(seconds=10, memory=1 << 30):
            rc = convert_main([str(src), str(out), "--quiet", "--preset", preset, *args])
    except Hang as e:
        return "hang", str(e)
    except MemoryError:
        return "memory blow-up", "MemoryError"
    except BaseException as e:  # noqa: B036 - SystemExit, KeyboardInterrupt: anything escaping main is a defect
        escaped = e
    err = capsys.readouterr().err.strip()
    if tree_digest(src) != before:
        return "data lost", "a source file changed"
    if escaped is not None:
        return "traceback", f"{type(escaped).__name__}: {escaped}"[:300]
    if rc != 0:
        if len(err.splitlines()) != 1 or not err.startswith("glm-convert: error: ") or "Traceback" in err:
            return "traceback", f"not a one-line error: {err[:300]!r}"
        if out.is_dir() and (out / "manifest.json").exists():
            return "silent wrong", f"failed but left a manifest: {err}"
        return "clean error", err
    try:
        why = wrong_output(src, out, preset, "--allow-nonfinite" in args)
    except Exception as e:  # the oracle could not even decode what was accepted
        why = f"accepted an input the oracle cannot decode: {type(e).__name__}: {e}"
    return ("silent wrong", why) if why else ("converted", "")


def test_fuzz_conversion_inputs(tmp_path, capsys):
    rng = random.Random(SEED)
    bases = {"bf16": tmp_path / "base-bf16", "bf16-sharded": tmp_path / "base-sharded", "fp8": tmp_path / "base-fp8"}
    make_snapshot(bases["bf16"], TINY_CONFIG)
    make_snapshot(bases["bf16-sharded"], TINY_CONFIG, shards=2)
    make_snapshot(bases["fp8"], TINY_CONFIG, fp8=True)
    (bases["bf16-sharded"] / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    template = tmp_path / "interrupted"
    interrupted_out(bases["bf16"], template)
    capsys.readouterr()
    counts = {category: dict.fromkeys(OUTCOMES, 0)
              for category in [*CATEGORIES, "OUT overlapping SOURCE", "resume state in OUT"]}
    seconds = dict.fromkeys(counts, 0.0)
    examples: list[str] = []
    case = 0
    for category in counts:
        for _ in range(CASES_PER_CATEGORY):
            case += 1
            root = tmp_path / f"case-{case}"
            root.mkdir()
            if category in CATEGORIES:
                base, mutate, presets = CATEGORIES[category]
                src = root / "src"
                shutil.copytree(bases[base], src)
                args, out = mutate(rng, src), root / "out"
                preset = rng.choice(presets)
            elif category == "OUT overlapping SOURCE":
                src = root / "src"
                shutil.copytree(bases["bf16-sharded"], src)
                out, args = overlap_case(rng, root, src)
                preset = "q4"
            else:  # resumes the template's conversion: the same source path, a tampered copy of its OUT
                src, out, preset = bases["bf16"], root / "out", "f32"
                shutil.copytree(template, out, symlinks=True)
                args = [*RESUME_ARGS, *mutate_out_state(rng, out)]
            start = time.perf_counter()
            outcome, detail = run_case(capsys, src, out, args, preset)
            seconds[category] += time.perf_counter() - start
            counts[category][outcome] += 1
            if outcome in BAD and len(examples) < 20:
                examples.append(f"{category} #{case} ({preset} {' '.join(args)}): {outcome}: {detail}")
            shutil.rmtree(root)
    print_table(counts, seconds)
    totals = {o: sum(c[o] for c in counts.values()) for o in OUTCOMES}
    assert sum(totals.values()) == case
    assert all(totals[o] == 0 for o in BAD), "\n".join(examples)
    assert totals["clean error"] > case // 2 and totals["converted"] > 0  # the fuzz reaches both sides


def print_table(counts: dict[str, dict[str, int]], seconds: dict[str, float]) -> None:
    """Outcomes per category (inputs tried, then one column per outcome) and the seconds its conversions took."""
    width = max(map(len, counts))
    print(f"\n{'category':{width}s} {'inputs':>7s} " + " ".join(f"{o:>14s}" for o in OUTCOMES) + f" {'seconds':>8s}")
    total = {o: sum(c[o] for c in counts.values()) for o in OUTCOMES}
    rows = [*((c, counts[c], seconds[c]) for c in counts), ("total", total, sum(seconds.values()))]
    for category, row, spent in rows:
        print(f"{category:{width}s} {sum(row.values()):7d} " + " ".join(f"{row[o]:14d}" for o in OUTCOMES)
              + f" {spent:8.1f}")
