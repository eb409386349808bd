"""Parsing human-friendly sizes on the command line."""

from __future__ import annotations

import argparse
import math

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'4G' / '1.5G' / '500M' / '64K' / '1000' -> bytes (binary units; a fraction rounds down to whole bytes). For
    argparse `type=`."""
    scale = _UNITS.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    whole, point, fraction = number.partition(".")
    if not (whole.isdigit() and (not point or fraction.isdigit())) or not number.isascii():
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (e.g. 4G, 1.5G, 500M, 64K)")
    return int(whole) * scale + int(fraction or "0") * scale // 10 ** len(fraction)


def parse_gigabytes(text: str) -> float:
    """A cache size in GiB, a finite number >= 0 (e.g. '20', '0.5'). For argparse `type=`."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"invalid size in GiB {text!r} (a finite number >= 0, e.g. 20 or 0.5)")
    return value


def format_size(nbytes: float) -> str:
    """Bytes -> '1.2 GB' (decimal units, like download tools and `df -H`)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(nbytes) < 1000:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"
