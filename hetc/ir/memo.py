"""`cached_property` without a lock.

Note [cached_property without a lock]: Python 3.11's `functools.cached_property` takes an RLock on
every first read of an instance's property (removed in 3.12). hetc reads such properties once on
each of tens of thousands of short-lived objects while planning (a stage's cost view per option,
its layer counts, its lane classes): the lock was about a tenth of the option tables' time. hetc
computes them in one thread, so this one stores the value in the instance's `__dict__` on first
read, as functools' does, without the lock; later reads find it there and never call `__get__`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

__all__ = ["cached_property"]

_T = TypeVar("_T")


class cached_property(Generic[_T]):   # named as the functools decorator it stands for
    def __init__(self, func: Callable[[Any], _T]):
        self.func = func
        self.name = func.__name__
        self.__doc__ = func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> cached_property[_T]: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> _T: ...

    def __get__(self, instance: object | None, owner: type | None = None) -> _T | cached_property[_T]:
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.func(instance)
        return value
