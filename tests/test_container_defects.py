"""Hostile and corrupted containers: each is refused with one line naming the container and the field at
fault, before anything is mapped; `verify_data` finds corrupted bytes, wherever they are.

Crafted containers have their manifest (or config.json) edited and the model hash recomputed with the
manifest module's own `content_hash`, so only validation can tell them from a real conversion.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from glmkit.cli.run import main as run_main
from glmkit.errors import GlmkitError
from glmkit.format.manifest import content_hash
from glmkit.format.reader import Container
from tests.runtime_support import FIXTURES, convert, with_huge_integer

NORM = "model.norm.weight"
ROUTER = "model.layers.1.mlp.gate.weight"
EXPERT = "model.layers.1.mlp.experts.0.gate_proj.weight"
O_PROJ = "model.layers.2.self_attn.o_proj.weight"
LAYER0_NORMS = ("model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-bf16 at q4 (nl4 experts, int8 embed, F32 norms and router) in three data files."""
    out = tmp_path_factory.mktemp("defects") / "container"
    return convert(FIXTURES / "tiny-bf16", out, "q4", "--quantizer", "absmax", "--max-file-size", "200K")


@pytest.fixture()
def box(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of the pristine container to break."""
    return Path(shutil.copytree(pristine, tmp_path / "container"))


def craft(directory: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit manifest.json and recompute its model hash, as a hostile writer would."""
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    manifest["model_hash"] = content_hash(manifest)
    path.write_text(json.dumps(manifest))


def craft_config(directory: Path, **changes: Any) -> None:
    """Edit config.json and record its new digest in a re-hashed manifest."""
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    digest = hashlib.sha256((directory / "config.json").read_bytes()).hexdigest()
    craft(directory, lambda m: m.update(config_sha256=digest))


def refused(directory: Path, *fragments: str) -> str:
    """Opening fails with one GlmkitError line that names the container and every fragment."""
    with pytest.raises(GlmkitError) as info:
        Container(directory).close()
    message = str(info.value)
    assert "\n" not in message and str(directory) in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def tensor(name: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda m: m["tensors"][name].update(fields)


def quant(name: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda m: m["tensors"][name]["quant"].update(fields)


def _drop_tensor(name: str) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        entry = m["tensors"].pop(name)
        if entry["quant"]:
            m["tensors"].pop(entry["quant"]["scales"])
    return edit


def _add_tensor(m: dict[str, Any]) -> None:
    m["tensors"]["model.layers.1.mlp.extra.weight"] = dict(m["tensors"][ROUTER])


def _swap_offsets(m: dict[str, Any]) -> None:
    a, b = (m["tensors"][n] for n in LAYER0_NORMS)
    a["offset"], b["offset"] = b["offset"], a["offset"]


def _onto(m: dict[str, Any]) -> None:
    a, b = (m["tensors"][n] for n in LAYER0_NORMS)
    a["offset"] = b["offset"]


def _bits3(m: dict[str, Any]) -> None:
    entry = m["tensors"][EXPERT]
    entry["quant"]["bits"] = 3
    entry["nbytes"] = entry["shape"][0] * 24 * -(-entry["shape"][1] // 64)


def _f16(name: str) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        m["tensors"][name].update(dtype="F16", nbytes=m["tensors"][name]["nbytes"] // 2)
    return edit


def _scales_shape(m: dict[str, Any]) -> None:
    qs = m["tensors"][EXPERT + ".qs"]
    qs.update(shape=[qs["shape"][0], 2], nbytes=qs["nbytes"] * 2)


def _experts(edit: Callable[[list[dict[str, Any]]], None]) -> Callable[[dict[str, Any]], None]:
    return lambda m: edit(m["experts"])


def _nest(m: dict[str, Any]) -> None:
    m["created_by"] = "DEEP"


CRAFTED: dict[str, tuple[Callable[[dict[str, Any]], None], tuple[str, ...]]] = {
    "unknown dtype": (tensor(NORM, dtype="Q7"), (NORM, "dtype")),
    "F16 norm": (_f16(NORM), (NORM, "dtype")),
    "F16 router": (_f16(ROUTER), (ROUTER, "dtype")),
    "dtype not a string": (tensor(NORM, dtype=["F32"]), (NORM, "dtype")),
    "bits 0": (quant(EXPERT, bits=0), (EXPERT, "bits")),
    "bits 3 where the conversion says 4": (_bits3, (EXPERT, "bits")),
    "bits as a string": (quant(EXPERT, bits="4"), (EXPERT, "bits")),
    "bits 8 where the conversion says 4": (lambda m: (quant(EXPERT, bits=8)(m), tensor(EXPERT, nbytes=2048)(m)),
                                           (EXPERT,)),
    "group size 0": (quant(EXPERT, group_size=0), (EXPERT, "group_size")),
    "group size negative": (quant(EXPERT, group_size=-64), (EXPERT, "group_size")),
    "unknown quant scheme": (quant(EXPERT, scheme="asymmetric"), (EXPERT, "scheme")),
    "quant scheme not a string": (quant(EXPERT, scheme=4), (EXPERT, "scheme")),
    "uniform codes where the conversion's grid says nl4": (quant(EXPERT, scheme="symmetric"), (EXPERT, "scheme")),
    "nl4 codes where the grid says uniform": (lambda m: m["conversion"].update(grid="uniform"), ("scheme", "grid")),
    "unknown grid": (lambda m: m["conversion"].update(grid="lloyd"), ("grid",)),
    "group sizes not an object": (lambda m: m["conversion"].update(group_sizes=[32]), ("group_sizes",)),
    "group size of an unknown role": (lambda m: m["conversion"].update(group_sizes={"bias": 32}), ("group_sizes",)),
    "a role's group size 0": (lambda m: m["conversion"].update(group_sizes={"attention": 0}), ("group_sizes",)),
    "a role's group size the tensors do not have": (
        lambda m: m["conversion"].update(group_sizes={"routed_expert": 32}), ("routed_expert", "group_size=32")),
    "nl4 at 8 bits": (lambda m: (quant(EXPERT, bits=8)(m), tensor(EXPERT, nbytes=2048)(m)), (EXPERT, "nl4")),
    "scales of another tensor": (quant(EXPERT, scales=ROUTER), (EXPERT, "scales")),
    "scales shape": (_scales_shape, (EXPERT + ".qs",)),
    "packed weight without quant": (tensor(EXPERT, quant=None), (EXPERT,)),
    "logical shape of a packed weight": (tensor(EXPERT, shape=[32, 72]), (EXPERT, "shape")),
    "shape with an extra dimension": (tensor(NORM, shape=[64, 1]), (NORM, "shape")),
    "shape of zero": (tensor(NORM, shape=[0], nbytes=0), (NORM, "shape")),
    "shape not a list": (tensor(NORM, shape=64), (NORM, "shape")),
    "offset +1": (lambda m: m["tensors"][NORM].update(offset=m["tensors"][NORM]["offset"] + 1), (NORM, "offset")),
    "offset as a float": (lambda m: m["tensors"][NORM].update(offset=m["tensors"][NORM]["offset"] + 0.5),
                          (NORM, "offset")),
    "offset as a string": (lambda m: m["tensors"][NORM].update(offset=str(m["tensors"][NORM]["offset"])),
                           (NORM, "offset")),
    "offset negative": (tensor(NORM, offset=-64), (NORM, "offset")),
    "nbytes +4": (lambda m: m["tensors"][NORM].update(nbytes=260), (NORM, "nbytes")),
    "two tensors on the same bytes": (_onto, ("overlap",)),
    "two norms swapped": (_swap_offsets, ("header",)),
    "role of another class": (tensor(NORM, role="attention"), (NORM, "role")),
    "unknown role": (tensor(NORM, role="bias"), (NORM, "role")),
    "digest not hex": (tensor(NORM, sha256="x" * 64), (NORM, "sha256")),
    "entry with an unknown key": (tensor(NORM, quantized=True), (NORM, "quantized")),
    "entry missing a key": (lambda m: m["tensors"][NORM].pop("role"), (NORM, "role")),
    "tensor missing": (_drop_tensor(O_PROJ), (O_PROJ, "missing")),
    "unknown tensor": (_add_tensor, ("model.layers.1.mlp.extra.weight",)),
    "no experts": (_experts(lambda e: e.clear()), ("expert",)),
    "an expert missing": (_experts(lambda e: e.pop()), ("expert",)),
    "an expert twice": (_experts(lambda e: e.append(dict(e[0]))), ("expert",)),
    "expert range shifted": (_experts(lambda e: e[0].update(offset=e[0]["offset"] + 64)), ("expert",)),
    "expert range too long": (_experts(lambda e: e[0].update(nbytes=e[0]["nbytes"] + 64)), ("expert",)),
    "expert of a dense layer": (_experts(lambda e: e[0].update(layer=0)), ("expert",)),
    "expert number out of range": (_experts(lambda e: e[0].update(expert=16)), ("expert",)),
    "expert entry not an object": (_experts(lambda e: e.append(7)), ("expert",)),
    "files record without a digest": (lambda m: next(iter(m["files"].values())).pop("sha256"), ("sha256",)),
    "files record with a negative size": (lambda m: next(iter(m["files"].values())).update(nbytes=-1), ("nbytes",)),
    "format_version true": (lambda m: m.update(format_version=True), ("format_version",)),
    "conversion bits of another width": (lambda m: m["conversion"]["bits"].update(routed_expert=8), ("bits",)),
    "conversion without MTP": (lambda m: m["conversion"].update(mtp=False), ("model.layers.4.",)),
    "conversion mtp not a bool": (lambda m: m["conversion"].update(mtp="yes"), ("mtp",)),
    "tensors not an object": (lambda m: m.update(tensors=[]), ("tensors",)),
    "an unknown top-level key": (lambda m: m.update(signature="x"), ("signature",)),
    "JSON nested too deep": (_nest, ("nested",)),
}


@pytest.mark.parametrize("case", list(CRAFTED), ids=list(CRAFTED))
def test_crafted_manifest_is_refused(box, case):
    edit, fragments = CRAFTED[case]
    craft(box, edit)
    if case == "JSON nested too deep":  # json.dumps cannot write it: splice the text in
        path = box / "manifest.json"
        path.write_text(path.read_text().replace('"DEEP"', "[" * 100_000 + "]" * 100_000))
    refused(box, *fragments)


@pytest.mark.parametrize("changes", [
    {"num_hidden_layers": 3},
    {"n_routed_experts": 32, "n_group": 4},
    {"hidden_size": 72},
    {"num_nextn_predict_layers": 0},
    {"moe_intermediate_size": 48},
], ids=["fewer layers", "more experts", "hidden size", "no MTP layer", "expert width"])
def test_config_edited_with_its_digest_recorded_is_refused(box, changes):
    craft_config(box, **changes)
    refused(box, "tensor")


def _move_out(box: Path, target: str) -> None:
    """Rename the first data file to `target` (relative to the container) in the manifest and on disk."""
    first = sorted(json.loads((box / "manifest.json").read_text())["files"])[0]
    destination = (box / target) if not target.startswith("/") else Path(target)
    shutil.move(box / first, destination)

    def edit(m: dict[str, Any]) -> None:
        m["files"][target] = m["files"].pop(first)
        for entry in [*m["tensors"].values(), *m["experts"]]:
            if entry["file"] == first:
                entry["file"] = target
    craft(box, edit)


@pytest.mark.parametrize("where", ["../outside.safetensors", "ABSOLUTE", "sub/inside.safetensors",
                                   "config.json"])
def test_data_file_names_are_plain_names_in_the_container(box, tmp_path, where):
    if where == "ABSOLUTE":
        where = str(tmp_path / "absolute.safetensors")
    if where == "sub/inside.safetensors":
        (box / "sub").mkdir()
    if where == "config.json":  # a data file named like a side file: refused as a name, nothing moved
        craft(box, lambda m: m["files"].update({"config.json": {"nbytes": 1, "sha256": "0" * 64}}))
    else:
        _move_out(box, where)
    refused(box, "data file name")


def _replace(path: Path, how: str, outside: Path) -> None:
    path.unlink()
    if how == "fifo":
        os.mkfifo(path)
    elif how == "directory":
        path.mkdir()
    elif how == "/dev/zero":
        path.symlink_to("/dev/zero")
    elif how == "symlink out":
        path.symlink_to(outside)
    elif how == "symlink loop":
        path.symlink_to(path.name)


@pytest.mark.parametrize("how, says", [("fifo", "FIFO"), ("directory", "directory"),
                                       ("/dev/zero", "out of the container"),
                                       ("symlink out", "out of the container"), ("symlink loop", "symlink")])
@pytest.mark.parametrize("which", ["data", "manifest.json", "config.json"])
def test_files_that_are_not_regular_files_of_the_container(box, tmp_path, which, how, says):
    name = sorted(json.loads((box / "manifest.json").read_text())["files"])[0] if which == "data" else which
    outside = tmp_path / "outside"
    shutil.copyfile(box / name, outside)  # the very same bytes, but not in the container
    _replace(box / name, how, outside)
    refused(box, name, says)


@pytest.mark.parametrize("name", ["manifest.json", "generation_config.json", "tokenizer_config.json"])
def test_an_integer_past_the_digit_limit_is_one_line_error(box, capsys, name):
    (box / name).write_bytes(with_huge_integer((box / name).read_bytes()))
    assert run_main([str(box), "-p", "def f(x):", "--raw-prompt", "--max-tokens", "1", "--no-cache"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"glm-run: error: {box / name}: ") and "JSON" in err, err


def test_a_tokenizer_with_ids_past_the_vocabulary_is_one_line_error(box, capsys):
    """tokenizer.json is not in the manifest's digests: its ids are checked against config.json's vocab_size."""
    tokenizer = json.loads((box / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({**tokenizer["added_tokens"][0], "id": 5000, "content": "ZZZ"})
    (box / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert run_main([str(box), "-p", "def ZZZ(x):", "--raw-prompt", "--max-tokens", "1", "--no-cache"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"glm-run: error: {box / 'tokenizer.json'}: token id 384 "), err


def test_config_is_read_with_a_bound(box):
    with open(box / "config.json", "r+b") as f:  # a sparse 64 MB config.json: refused by its size, not read
        f.truncate(64 << 20)
    refused(box, "config.json", "bytes")


def test_a_data_file_symlinked_inside_the_container_is_read(box):
    name = sorted(json.loads((box / "manifest.json").read_text())["files"])[0]
    (box / "store").mkdir()
    shutil.move(box / name, box / "store" / name)
    (box / name).symlink_to(Path("store") / name)
    c = Container(box)
    assert c.verify_data() == []
    c.close()


def _data_file_and_gap(directory: Path) -> tuple[Path, int]:
    """The first data file and the offset of a padding byte between two of its tensors."""
    manifest = json.loads((directory / "manifest.json").read_text())
    name = sorted(manifest["files"])[0]
    spans = sorted((e["offset"], e["offset"] + e["nbytes"]) for e in manifest["tensors"].values() if e["file"] == name)
    gap = next(end for (_, end), (begin, _) in zip(spans, spans[1:], strict=False) if begin > end)
    return directory / name, gap


def test_verify_data_checks_every_byte_of_a_data_file(box):
    path, gap = _data_file_and_gap(box)
    raw = bytearray(path.read_bytes())
    raw[gap] ^= 0x01  # padding: no tensor changes, the file's digest does
    path.write_bytes(bytes(raw))
    c = Container(box)
    assert c.verify_data() == [path.name]
    c.close()


def test_verify_data_names_tensors_and_counts_progress(box):
    c = Container(box)
    e = c.entry(NORM)
    c.close()
    path = box / e.file
    raw = bytearray(path.read_bytes())
    raw[e.offset + 5] ^= 0x10
    path.write_bytes(bytes(raw))
    c = Container(box)
    seen: list[int] = []
    assert c.verify_data(progress=seen.append) == [NORM]
    assert sum(seen) >= c.nbytes  # every file read whole, then the damaged file's tensors again
    c.close()


def test_verify_data_on_a_file_truncated_after_opening(box):
    c = Container(box)
    path = box / c.entry(NORM).file
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(GlmkitError, match=f"{path.name}.*(truncated|changed)"):
        c.verify_data()
    c.close()


def test_verify_data_after_close_is_a_clear_error(box):
    c = Container(box)
    c.close()
    with pytest.raises(GlmkitError, match="closed"):
        c.verify_data()


def test_truncated_or_odd_shaped_int3_weight_is_refused(tmp_path):
    """A q3 container whose int3 expert claims the bytes of a plain 3-bit stream (not whole 24-byte blocks), or
    whose data file lost its tail, is refused naming the tensor or the file."""
    q3 = convert(FIXTURES / "tiny-bf16", tmp_path / "q3", "q3")
    odd = Path(shutil.copytree(q3, tmp_path / "odd"))
    down = EXPERT.replace("gate_proj", "down_proj")  # [64, 32]: one 24-byte block holds a row's 12 bytes of codes
    rows, cols = json.loads((q3 / "manifest.json").read_text())["tensors"][down]["shape"]
    craft(odd, tensor(down, nbytes=rows * ((cols * 3 + 7) // 8)))
    refused(odd, down, "nbytes")
    cut = Path(shutil.copytree(q3, tmp_path / "cut"))
    data = sorted(cut.glob("*.safetensors"))[0]
    os.truncate(data, data.stat().st_size - 24)
    refused(cut, data.name, "truncated")
