"""`carpool serve --replicas N` without Ray installed: a clear error naming `make scale`, before anything loads."""

import sys

import pytest

from carpool.server.replicas.serve import import_ray


def test_replicas_without_ray_names_make_scale(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what an interpreter without Ray sees: ImportError
    with pytest.raises(ValueError, match=r"--replicas: .*make scale"):
        import_ray()
