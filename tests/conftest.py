from pathlib import Path

import pytest

from glmkit.generate.engine import Engine
from tests.runtime_support import Snapshots


@pytest.fixture(autouse=True)
def isolated_prefix_cache(tmp_path, monkeypatch):
    """Every test gets its own prefill-cache directory: nothing leaks between tests or into ~/.cache."""
    monkeypatch.setenv("GLMKIT_CACHE_DIR", str(tmp_path / "prefix-cache"))


@pytest.fixture(scope="session")
def device_profile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("device-profiles")


@pytest.fixture(autouse=True)
def isolated_device_profiles(device_profile_dir, monkeypatch):
    """OpenCL device profiles (`--device auto` measures once per device and model) live in one temporary
    directory for the whole session: measured at most once per model there, never written to ~/.cache."""
    monkeypatch.setenv("GLMKIT_DEVICE_CACHE_DIR", str(device_profile_dir))


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-bf16 converted at f32, once per module (modules with a `snapshot` of their own override it)."""
    return Snapshots(tmp_path_factory)("tiny-bf16", "f32")


@pytest.fixture(scope="module")
def engine(snapshot: Path) -> Engine:
    """An Engine on `snapshot` (NumPy)."""
    return Engine(snapshot)
