"""Fallbacks: the places where pgconvert has to guess, and ``--strict`` to refuse instead.

Each guess is logged as a warning naming what was assumed and kept in the report's notices;
under ``strict`` it is a ``StrictModeError`` instead, raised before anything is written where the
guess is made while planning.
"""

from __future__ import annotations

import logging

from pgconvert.errors import StrictModeError

log = logging.getLogger(__name__)


def fallback(message: str, strict: bool, notices: list[str] | None = None) -> None:
    """Record a guess: a warning (and a notice), or under ``strict`` an error."""
    if strict:
        raise StrictModeError(f"--strict: refusing to guess: {message}")
    log.warning("guess: %s", message)
    if notices is not None:
        notices.append(f"guess: {message}")
