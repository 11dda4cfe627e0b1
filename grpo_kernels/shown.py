"""`shown(value)`: a user's value as an error message shows it, at most `MAX_SHOWN` characters whatever its size.

Every error that repeats a value it was given goes through this one formatter, so that a 50 MB string, a deeply
nested list or a YAML structure whose aliases share one list many times over is shown as a short prefix (`reprlib`
limits the depth and the items per level; the result is then cut), never expanded in full.
"""

from __future__ import annotations

import reprlib

MAX_SHOWN = 200  # characters of a shown value, at most


class _Repr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:  # repr of a 5,000-digit int raises; a long one is cut anyway
        if x.bit_length() > 4 * self.maxlong:
            return f"<int of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_REPR = _Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdeque = _REPR.maxarray = 6
_REPR.maxdict = 6
_REPR.maxstring = _REPR.maxother = 120
_REPR.maxlong = 60


def shown(value: object) -> str:
    """The repr of `value`, bounded: at most `MAX_SHOWN` characters (`...` where it is cut)."""
    text = _REPR.repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."
