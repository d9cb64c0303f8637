"""Path checks for untrusted checkpoint directories."""

from __future__ import annotations

from pathlib import Path

from pgconvert.errors import CheckpointError


def ensure_within(root: Path, path: Path) -> Path:
    """``path`` resolved, refusing anything (a symlink, ``..``) that leads outside ``root``."""
    resolved_root = root.resolve()
    resolved = path.resolve()
    try:
        resolved.relative_to(resolved_root)
    except ValueError:
        detail = f" (a symlink to {resolved})" if path.is_symlink() or resolved != path.absolute() else ""
        raise CheckpointError(f"{path}: leads outside the source directory {root}{detail}; refusing to read it") from None
    return resolved
