"""Module names of earlier versions, kept importable: ``import ops_transformer.train`` is
``ops_transformer.training.loop`` (the same module object, so ``monkeypatch`` reaches it).
A finder on ``sys.meta_path`` resolves an old name only when it is imported: nothing is loaded
up front (``ops-transformer train --help`` imports no torch)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):  # the target ran already
        pass


class AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves the old names of :data:`aliases` (old dotted name → new dotted name)."""

    def __init__(self, aliases: dict[str, str]):
        self.aliases = dict(aliases)

    def find_spec(self, name, path=None, target=None):
        new = self.aliases.get(name)
        if new is None:
            return None
        return importlib.util.spec_from_loader(name, _Alias(new))


def install(aliases: dict[str, str]) -> None:
    """Put one finder for ``aliases`` on ``sys.meta_path`` (again on a reload: replaced)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, AliasFinder)]
    sys.meta_path.insert(0, AliasFinder(aliases))
