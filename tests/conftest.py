import pytest


@pytest.fixture(autouse=True)
def isolated_prefix_cache(tmp_path, monkeypatch):
    """Every test gets its own prefill-cache directory: nothing leaks between tests or into ~/.cache."""
    monkeypatch.setenv("GLMKIT_CACHE_DIR", str(tmp_path / "prefix-cache"))
