"""Checks an object against a protocol where it is built, in one line naming what it lacks:
`check_policy` for a required protocol, `has_capability` for an optional one."""
from __future__ import annotations

import inspect
from typing import Generic, Protocol


def _protocol_methods(protocol: type) -> dict[str, bool]:
    """Member -> whether it is a method, over the protocol and the protocols it extends."""
    methods: dict[str, bool] = {}
    for cls in reversed(protocol.__mro__):
        if cls in (object, Protocol, Generic) or not cls.__dict__.get("_is_protocol"):
            continue
        for name in cls.__dict__.get("__annotations__", {}):
            methods.setdefault(name, False)
        for name, value in cls.__dict__.items():
            if not name.startswith("_") and (callable(value) or isinstance(value, property)):
                methods.setdefault(name, callable(value))
    return methods


def protocol_members(protocol: type) -> list[str]:
    """The attributes and methods a protocol lists, in the order it lists them."""
    return list(_protocol_methods(protocol))


def _has_member(obj, name: str, is_method: bool) -> bool:
    # The class is read statically so no property runs; getattr_static on the instance would
    # turn off CPython's specialised attribute access on it for the rest of the run.
    try:
        value = inspect.getattr_static(type(obj), name)
    except AttributeError:
        if not hasattr(obj, name):
            return False
        value = getattr(obj, name)
    if isinstance(value, (staticmethod, classmethod)):
        return True
    return not is_method or callable(value)


def missing_members(obj, protocol: type) -> list[str]:
    """The members of `protocol` that `obj` lacks, in the protocol's order."""
    return [name for name, is_method in _protocol_methods(protocol).items()
            if not _has_member(obj, name, is_method)]


def _lacks(obj, protocol: type, field: str, missing: list[str]) -> str:
    where = protocol.__module__.replace(".", "/") + ".py"
    return (f"{field}: {type(obj).__name__} lacks {', '.join(missing)} "
            f"({protocol.__name__}, {where})")


def check_policy(obj, protocol: type, field: str) -> None:
    """Raise one line naming what `obj` (the setting `field`) lacks of `protocol`."""
    missing = missing_members(obj, protocol)
    if missing:
        raise ValueError(_lacks(obj, protocol, field, missing))


def has_capability(obj, protocol: type, field: str) -> bool:
    """Whether `obj` has the optional `protocol`; a ValueError when it has only some of it, since
    a capability half written is a mistake, not an opt-out."""
    missing = missing_members(obj, protocol)
    if not missing:
        return True
    members = protocol_members(protocol)
    if len(missing) == len(members):
        return False
    have = ", ".join(name for name in members if name not in missing)
    raise ValueError(f"{_lacks(obj, protocol, field, missing)} but has {have}: give it all of "
                     f"{', '.join(members)} or none")
