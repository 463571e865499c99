"""Human-readable quantities (binary units for bytes, decimal for FLOPs and counts)."""
from __future__ import annotations


def _three_digits(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def format_bytes(value: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{_three_digits(value / scale)} {unit}"
    return f"{value:.0f} B"


def format_flops(value: float) -> str:
    return _decimal(value, "FLOP")


def format_count(value: float) -> str:
    return _decimal(value, "").strip()


def _decimal(value: float, suffix: str) -> str:
    for unit, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{_three_digits(value / scale)} {unit}{suffix}"
    return f"{value:.0f} {suffix}"
