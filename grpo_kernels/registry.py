"""Name -> component registries: configs select components by name, users add their own with a decorator.

ADVANTAGES = Registry("advantage estimator")

@ADVANTAGES.register("rloo", paper="arXiv:2402.14740")
def rloo(rewards, group_ids): ...

ADVANTAGES.get("rloo")      # the function; an unknown name is a ValueError listing the valid ones
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from grpo_kernels.shown import shown


@dataclass(frozen=True)
class Component:
    """A registered function or class, its name, the paper it implements and a one-line summary."""

    name: str
    obj: Any
    paper: str

    @property
    def summary(self) -> str:
        """The first line of the component's docstring."""
        return (self.obj.__doc__ or "").strip().splitlines()[0] if self.obj.__doc__ else ""


class Registry:
    """Components of one kind (advantage estimator, reward, sampler, ...) by name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._components: dict[str, Component] = {}

    def register(self, name: str, *, paper: str = "") -> Callable[[Any], Any]:
        """Decorator registering a function or class under `name`; a name taken twice is an error."""

        def add(obj: Any) -> Any:
            if name in self._components:
                raise ValueError(f"{self.kind} {shown(name)} is already registered")
            self._components[name] = Component(name, obj, paper)
            return obj

        return add

    def get(self, name: str) -> Any:
        """The component registered as `name`, or a ValueError listing the valid names."""
        return self.component(name).obj

    def component(self, name: str) -> Component:
        if name not in self._components:
            raise ValueError(f"unknown {self.kind} {shown(name)}; valid choices: {sorted(self._components)}")
        return self._components[name]

    def names(self) -> list[str]:
        return sorted(self._components)

    def __contains__(self, name: object) -> bool:
        return name in self._components

    def __iter__(self) -> Iterator[Component]:
        return iter(self._components.values())

    def __len__(self) -> int:
        return len(self._components)
