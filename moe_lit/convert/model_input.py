"""Every model input a command takes: ours or a transformers directory.

:func:`load_any_config` / :func:`load_any_model` accept what :func:`moe_lit.checkpoint.load_config` /
:func:`~moe_lit.checkpoint.load_model` do (model and experiment YAMLs, ``.ckpt`` files, our exported
directories) and a transformers model directory of a supported family, read as
``moe-lit convert import-hf`` reads it (:mod:`moe_lit.convert.hf`, which needs transformers).

NOTE: the transformers route sits here, above ``checkpoint.py``: the HF import reads tokenizers
through ``data/``, which reads checkpoints (docs/architecture.md's layers).
"""

from __future__ import annotations

from pathlib import Path

from moe_lit.checkpoint import is_transformers_dir, load_config, load_model, resolve_device
from moe_lit.config import ModelConfig


def load_any_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of any model input (module docstring); no weights are read."""
    if is_transformers_dir(Path(path)):
        from moe_lit.convert.hf import hf_config_dir_to_ours

        return hf_config_dir_to_ours(path)
    return load_config(path)


def load_any_model(path: str | Path, map_location: str = "cpu"):
    """The Transformer of any model input with weights (a ``.ckpt`` or a directory), in eval mode on
    ``map_location`` (a device name or ``auto``, see :func:`~moe_lit.checkpoint.resolve_device`)."""
    if is_transformers_dir(Path(path)):
        from moe_lit.convert.hf import from_hf

        return from_hf(path).to(resolve_device(map_location)).eval()
    return load_model(path, map_location=map_location)


__all__ = ["load_any_config", "load_any_model"]
