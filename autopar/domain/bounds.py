"""Declared ranges of numeric settings: one table per schema, checked by one function.

Each schema (the cluster here, the training, solver and plan settings in autopar) keeps a dict
``field name -> Bound`` beside its dataclass; `out_of_range` walks such a table over a node's
values and names the first one outside its range. A value is refused, never replaced: a
bandwidth of 0 or nan is a mistake to report, not a hint to fall back on a default, and nan
compares false with every bound, so each check asks whether the value is inside, never whether
it is outside.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping


@dataclass(frozen=True)
class Bound:
    """What a numeric field accepts.

    Attributes:
        low, high: the range's ends (None: unbounded on that side).
        low_open, high_open: the end itself is excluded.
        integer: a count (a bool or a float is refused, even 2.0).
        null: what null means where the field may be null ("" : it may not).
        each: the field is a list or mapping whose every number is checked.
        finite: inf is refused (nan always is).
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    null: str = ""
    each: bool = False
    finite: bool = True

    def accepts(self, value: Any) -> bool:
        """Whether one value (an item, for ``each``) lies in the range."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if math.isnan(value) or (self.finite and math.isinf(value)):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self) -> str:
        """The range in words, e.g. 'an integer of at least 1', 'a finite number above 0'."""
        kind = "integer" if self.integer else ("finite number" if self.finite else "number (not nan)")
        low, high = self.low, self.high
        if low is not None and high is not None and not self.low_open and not self.high_open:
            ends = f"from {_number(low)} to {_number(high)}"
        else:
            parts = []
            if low is not None:
                parts.append(f"above {_number(low)}" if self.low_open else f"at least {_number(low)}")
            if high is not None:
                parts.append(f"below {_number(high)}" if self.high_open else f"at most {_number(high)}")
            ends = " and ".join(parts)
        if self.each:
            text = f"{kind}s" + (f", each {ends}" if ends else "")
        else:
            text = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}" \
                + (f" {'of ' if ends.startswith('at ') else ''}{ends}" if ends else "")
        return text + (f", or null ({self.null})" if self.null else "")


@dataclass(frozen=True)
class OutOfRange:
    """A field outside its declared range: its name, the value given and the bound."""

    name: str
    value: Any
    bound: Bound

    def sentence(self, prefix: str = "") -> str:
        """'<prefix><name>=<value> is out of range (expected: <the range>)'."""
        return f"{prefix}{self.name}={_shown(self.value)} is out of range (expected: {self.bound.describe()})"


def out_of_range(values: Mapping[str, Any] | Any, table: Mapping[str, Bound]) -> OutOfRange | None:
    """The first field of ``table`` whose value (from a mapping, or an object's attributes) lies
    outside its bound, else None; fields the values lack are not checked."""
    for name, bound in table.items():
        if isinstance(values, Mapping):
            if name not in values:
                continue
            value = values[name]
        elif hasattr(values, name):
            value = getattr(values, name)
        else:
            continue
        if not within(value, bound):
            return OutOfRange(name, value, bound)
    return None


def within(value: Any, bound: Bound) -> bool:
    """Whether ``value`` satisfies ``bound`` (null where allowed; every item for ``each``)."""
    if value is None:
        return bool(bound.null)
    if not bound.each:
        return bound.accepts(value)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        return False
    return all(bound.accepts(item) for item in _leaves(value))


def _leaves(value: Any) -> Iterator[Any]:
    """The scalars of nested lists and mappings (a mapping's values)."""
    items = value.values() if hasattr(value, "values") and callable(value.values) else value
    for item in items:
        if isinstance(item, (str, bytes)) or not hasattr(item, "__iter__"):
            yield item
        else:
            yield from _leaves(item)


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() and abs(value) >= 10_000 else f"{value:g}"


def _shown(value: Any) -> str:
    """A value as the user would type it (a huge integer shortened)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**12:
        return f"{value:.3g}".replace("e+", "e")
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."
