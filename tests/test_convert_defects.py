"""Hostile and mistaken conversion inputs: OUT overlapping SOURCE, a source changed between a kill and the
resume, non-finite or misread weights, a config that disagrees with the tensors, untrusted JSON side files,
and rerunning a finished conversion."""

import hashlib

import pytest

from tests.test_convert_errors import run_bad
from tools.synth import make_snapshot


def tree_digest(directory) -> dict[str, str]:
    """sha256 of every regular file under `directory`, by relative path."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


# --- OUT must not be, hold or sit inside SOURCE ----------------------------------------------------------------

@pytest.mark.parametrize("where", ["same", "inside", "parent", "symlink"])
def test_out_overlapping_the_source_is_refused_before_touching_it(tmp_path, capsys, where):
    src = tmp_path / "model"
    make_snapshot(src, shards=2)  # Hub-style model-0000N-of-00002.safetensors, what OUT's cleanup deletes
    before = tree_digest(tmp_path)
    out = {"same": src, "inside": src / "q4", "parent": tmp_path}.get(where)
    if where == "symlink":
        out = tmp_path / "link"
        out.symlink_to(src)
        before = tree_digest(tmp_path)
    err = run_bad(capsys, src, out, "--preset", "q4", "--force")
    assert "source" in err and str(src) in err
    assert tree_digest(tmp_path) == before
    assert not (src / ".glm-convert").exists() and not (src / "q4").exists()
