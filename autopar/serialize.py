"""Lossless JSON round-trip for the dataclasses that cross stage boundaries.

`to_jsonable` turns a dataclass tree into plain JSON values; `from_jsonable(cls, data)` rebuilds
it from the field type hints, so every artifact (ModelProfile, Plan, ...) gets `to_json` /
`from_json` without hand-written converters that drift from the fields.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")
# Field metadata key: a field that is not written (e.g. a wall time, which would make two files
# from the same inputs differ); reading such a file gives the field its default.
TRANSIENT = "transient"
_PLAIN = (int, float, str, bool, type(None))


def to_jsonable(obj: Any) -> Any:
    """Dataclasses to dicts, enums to values, tuples to lists; everything else as it is."""
    if type(obj) in _PLAIN:  # most values: asked first
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {name: to_jsonable(getattr(obj, name)) for name in _written_fields(type(obj))}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(item) for item in obj]
    if isinstance(obj, dict):
        return {str(key): to_jsonable(value) for key, value in obj.items()}
    return obj


def compact_json(obj: Any) -> str:
    """``json.dumps(to_jsonable(obj))`` without indentation, with json's C encoder walking the
    tree: it calls back only for what JSON has no type for (a dataclass, an enum, a path), where
    `to_jsonable` makes a Python call for every value (a 405B profile: 0.8 million calls, half a
    second). The same text, except where a dict's keys are not strings, numbers or None, which it
    leaves to `to_jsonable`."""
    try:
        return json.dumps(obj, default=_json_default, separators=(",", ":"), allow_nan=True)
    except TypeError:  # keys json cannot write (tuples, enums): converted as to_jsonable does
        return json.dumps(to_jsonable(obj), separators=(",", ":"))


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {name: getattr(obj, name) for name in _written_fields(type(obj))}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON")


def from_jsonable(cls: type[T], data: Any) -> T:
    """Rebuild a value of type ``cls`` (a dataclass or a typing annotation) from JSON data."""
    return _convert(cls, data)


def upgrade_block_containers(data: dict[str, Any]) -> dict[str, Any]:
    """A plan or profile written when a model had one stack of blocks (its ``block_container``
    field) reads as that one stack (``block_containers``)."""
    if "block_container" not in data or "block_containers" in data:
        return data
    single = data["block_container"]
    return {**data, "block_containers": [single] if single else []}


def dumps(obj: Any) -> str:
    """Stable JSON text (sorted keys are not used: field order is the dataclass's, for readers)."""
    return json.dumps(to_jsonable(obj), indent=1)


class FieldError(ValueError):
    """A value of a file that does not fit its field (a null where a number belongs, 2.5 for a
    count, ...); ``path`` names the field (``plan.dp``, ``alternatives.0.reason``)."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}" if path else problem)
        self.path, self.problem = path, problem

    @property
    def why(self) -> str:
        return self.problem


def _number(annotation: type, data: Any) -> int | float:
    """An int or float field's value: a count stays a count (2.5 or true is refused, never
    truncated to 2 or read as 1); ranges are checked by the reader (e.g. Plan.problems)."""
    if isinstance(data, bool) or not isinstance(data, (int, float)):
        raise ValueError(f"{data!r} is not a number")
    if annotation is int:
        if isinstance(data, float) and not data.is_integer():
            raise ValueError(f"{data!r} is not an integer")
        return int(data)
    return float(data)


@functools.lru_cache(maxsize=None)
def _shape(annotation: Any) -> tuple[Any, tuple[Any, ...]]:
    """(origin, args) of an annotation, read once per annotation, not per value."""
    return typing.get_origin(annotation), typing.get_args(annotation)


def _convert(annotation: Any, data: Any) -> Any:
    # Most values of a profile are plain numbers and strings of the annotated type: returned as
    # they are before anything else is asked (a 405B profile holds 800,000 values).
    kind = type(data)
    if kind is annotation and kind in (str, int, bool, float):
        return data
    if annotation is float and kind is int:
        return float(data)
    origin, args = _shape(annotation)
    if data is None:
        if annotation is Any or annotation is None or type(None) in args:
            return None
        raise FieldError("", f"is null where {_type_words(annotation)} belongs")
    if origin in (typing.Union, types.UnionType):
        candidates = [a for a in args if a is not type(None)]
        return _convert(candidates[0], data) if len(candidates) == 1 else data
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        if not isinstance(data, dict):
            raise FieldError("", f"is {type(data).__name__} where an object ({annotation.__name__}) belongs")
        if hasattr(annotation, "upgrade_data"):  # an older file's fields, renamed since
            data = annotation.upgrade_data(data)
        kwargs = {}
        for name, hint, takes in _field_readers(annotation):
            if name in data:
                value = data[name]
                kwargs[name] = value if takes is not None and takes(value) else _field(name, hint, value)
        return annotation(**kwargs)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return annotation(data)
    if origin is list:
        if not args:
            return list(data)
        if args[0] in (str, int, bool) and all(type(item) is args[0] for item in data):
            return list(data)
        return [_field(i, args[0], item) for i, item in enumerate(data)]
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], item) for item in data)
        return tuple(_convert(a, item) for a, item in zip(args, data)) if args else tuple(data)
    if origin is dict:
        key_type, value_type = args if args else (str, Any)
        # JSON keys are strings: a number key is read from its text
        keys = (lambda k: key_type(k)) if key_type in (int, float) else (lambda k: _convert(key_type, k))
        return {keys(k): _field(str(k), value_type, v) for k, v in data.items()}
    if annotation in (int, float):
        return _number(annotation, data)
    if annotation in (str, bool):
        return annotation(data)
    if annotation is Path:
        return Path(data)
    return data


@functools.lru_cache(maxsize=None)
def _written_fields(cls: type) -> tuple[str, ...]:
    """Names of a dataclass's fields a file holds (not TRANSIENT), once per class."""
    return tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get(TRANSIENT))


@functools.lru_cache(maxsize=None)
def _init_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, resolved type) of a dataclass's init fields: resolved once per class, not per object
    (a 530B profile holds 18,000 of them; resolving each again took 7 of its 11 s of loading)."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init)


def _is(kind: type) -> Callable[[Any], bool]:
    return lambda value: type(value) is kind


def _plain_list(kind: type) -> Callable[[Any], bool]:
    return lambda value: type(value) is list and all(type(item) is kind for item in value)


def _plain_rows(kind: type) -> Callable[[Any], bool]:
    return lambda value: type(value) is list and all(type(row) is list and all(type(item) is kind for item in row)
                                                     for row in value)


# Field types whose JSON value, when of exactly these types, is the field's value as it is.
_TAKEN_AS_READ: dict[Any, Callable[[Any], bool]] = {
    **{kind: _is(kind) for kind in (str, int, bool, float)},
    list[str]: _plain_list(str), list[int]: _plain_list(int),
    list[list[str]]: _plain_rows(str), list[list[int]]: _plain_rows(int),
}


@functools.lru_cache(maxsize=None)
def _field_readers(cls: type) -> tuple[tuple[str, Any, Callable[[Any], bool] | None], ...]:
    """(name, type, test) of a dataclass's init fields, where `test` says a JSON value is already
    the field's value (a string for a str, a list of lists of ints for list[list[int]]), which is
    then taken as read, without `_convert`'s walk: a 70B profile's 19,000 ops are read in a third
    of the time. None: always converted."""
    return tuple((name, hint, _TAKEN_AS_READ.get(hint)) for name, hint in _init_fields(cls))


def _field(name: str | int, annotation: Any, data: Any) -> Any:
    """`_convert` of one field or item (an item by its index), naming it in the error of a value
    that does not fit."""
    try:
        return _convert(annotation, data)
    except FieldError as err:
        raise FieldError(f"{name}.{err.path}" if err.path else str(name), err.problem) from None
    except (ValueError, TypeError, OverflowError) as err:
        raise FieldError(str(name), str(err)) from None


def _type_words(annotation: Any) -> str:
    """'a float', 'a list', 'an object (Predicted)': what a field holds, for messages."""
    origin = typing.get_origin(annotation) or annotation
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return f"an object ({annotation.__name__})"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
             tuple: "a list", dict: "an object"}
    return names.get(origin, getattr(origin, "__name__", str(origin)))
