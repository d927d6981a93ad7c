"""Registry: the one name -> class table behind every swappable part (attention backends, MoE
backends, gates, executors).

A class joins with `@registry.register("name")` in the module that defines it. A name not yet
registered is looked up by importing the modules the registry's patterns name (pattern "x.{}_moe"
and name "torch": module x.torch_moe), so a part's dependencies (torch, a kernel library) load only
in processes that use it. This file owns the table and the lookup; it never builds an instance.
"""
from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, *module_patterns: str) -> None:
        self.kind = kind                    # for the error message: "unknown {kind} 'x'"
        self.module_patterns = module_patterns
        self._table: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def wrap(cls: T) -> T:
            self._table[name] = cls
            return cls
        return wrap

    def get(self, name: str) -> T:
        for pattern in self.module_patterns:
            if name in self._table:
                break
            module = pattern.format(name)
            try:
                importlib.import_module(module)   # registers it
            except ModuleNotFoundError as e:
                if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
                    raise   # the module exists but lacks a dependency: say which
        if name not in self._table:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {self.names()}")
        return self._table[name]

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: str) -> bool:
        return name in self._table
