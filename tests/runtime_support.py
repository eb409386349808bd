"""Shared helpers for the runtime tests: the two oracle fixtures, converted once per test module."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from glmkit.backends.opencl.device import DeviceInfo, list_devices
from glmkit.cli.convert import main as convert_main
from glmkit.convert.sources.snapshot import HFSnapshot
from glmkit.errors import GlmkitError

FIXTURES = Path(__file__).parent / "fixtures"
VARIANTS = ("tiny-bf16", "tiny-fp8")


@cache
def oracle(variant: str) -> dict[str, Any]:
    return json.loads((FIXTURES / variant / "oracle.json").read_text())


def convert(source: Path, out: Path, preset: str = "f32", *flags: str) -> Path:
    """glm-convert SOURCE OUT --preset PRESET [flags]."""
    with contextlib.redirect_stdout(io.StringIO()):  # its one-line summary would pollute captured output
        assert convert_main([str(source), str(out), "--preset", preset, "--quiet", *flags]) == 0
    return out


def copy_with_config(variant: str, dest: Path, **config_changes: Any) -> Path:
    """A copy of a fixture's HF snapshot with edited config.json keys (convert it to run it)."""
    shutil.copytree(FIXTURES / variant, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(config_changes)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


# one more digit than the interpreter converts to an int (sys.get_int_max_str_digits: 4,300)
HUGE_INTEGER = "9" * 5000


def with_huge_integer(text: bytes) -> bytes:
    """JSON `text` (an object) with one more key first, holding HUGE_INTEGER."""
    return text.replace(b"{", b'{"x": ' + HUGE_INTEGER.encode() + b", ", 1)


class Snapshots:
    """Converted fixtures, made on first use and kept for the module: `snapshots(variant, preset, *flags)` (flags:
    more glm-convert options)."""

    def __init__(self, factory: pytest.TempPathFactory):
        self.factory = factory
        self.made: dict[tuple[str, ...], Path] = {}

    def __call__(self, variant: str, preset: str = "f32", *flags: str) -> Path:
        key = (variant, preset, *flags)
        if key not in self.made:
            out = self.factory.mktemp(f"{variant}-{preset}") / "snapshot"
            self.made[key] = convert(FIXTURES / variant, out, preset, *flags)
        return self.made[key]


def opencl_test_device() -> DeviceInfo:
    """The OpenCL device the kernel and backend tests run on: `GLMKIT_TEST_DEVICE` = cpu (default), gpu or
    PLATFORM:DEVICE (how a GPU machine runs them), else PoCL's CPU device."""
    devices = list_devices()
    if not devices:  # pyopencl[pocl] is a dependency: a missing device is a broken install, not a skip
        pytest.fail("no OpenCL device found (pyopencl with the pocl extra should provide PoCL's CPU device)")
    want = os.environ.get("GLMKIT_TEST_DEVICE", "cpu")
    if ":" in want:
        found = [d for d in devices if d.spec == f"opencl:{want}"]
    else:
        found = [d for d in devices if d.kind == want]
    if not found:
        pytest.fail(f"GLMKIT_TEST_DEVICE={want}: no such OpenCL device among {[d.name for d in devices]}")
    return found[0]


def fail_reading(monkeypatch: pytest.MonkeyPatch, prefix: str) -> Any:
    """Make the source's tensors named `prefix...` fail to read (a conversion that dies part way); returns the
    real `HFSnapshot.load`, to put back."""
    real = HFSnapshot.load

    def broken(self: HFSnapshot, spec: Any) -> Any:
        if spec.name.startswith(prefix):
            raise GlmkitError(f"{spec.name}: simulated read failure")
        return real(self, spec)
    monkeypatch.setattr(HFSnapshot, "load", broken)
    return real
