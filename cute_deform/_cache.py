"""Where cute_deform keeps what it builds between processes: compiled kernels and the C++ launcher."""
from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/cute_deform (~/.cache/cute_deform)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cute_deform"


def cache_dir() -> Path | None:
    """Where compiled kernels are kept between processes: $CUTE_DEFORM_CACHE_DIR, else user_cache_dir().
    CUTE_DEFORM_CACHE_DIR=off (or empty) disables it."""
    configured = os.environ.get("CUTE_DEFORM_CACHE_DIR")
    if configured is None:
        return user_cache_dir()
    if configured.strip().lower() in ("", "0", "off", "none", "false"):
        return None
    return Path(configured)
