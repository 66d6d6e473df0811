"""Load and export models: Lightning ``.ckpt`` files and exported directories.

An exported directory holds ``config.json`` (the ``ModelConfig``), ``model.safetensors`` (the
``Transformer`` state dict, MegaBlocks expert layout) and, when known, ``tokenizer.json``.
A Lightning checkpoint of ``MoELitModule`` keeps the config in ``hyper_parameters['model']`` and
the weights under the ``model.`` prefix; transforms that change shapes (expert expansion,
upcycling) update that hyper-parameter, so a checkpoint always rebuilds into its own shape.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Optional, Union

import torch

from moe_lit.config import ModelConfig
from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_directory

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
STATE_PREFIX = "model."


def export_model(model, out_dir: Union[str, Path], tokenizer_file: Optional[Union[str, Path]] = None) -> Path:
    """Write ``model`` (a Transformer) to ``out_dir`` atomically; returns the directory."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        if model.config.tie_embeddings:
            state.pop("lm_head.weight", None)  # safetensors refuses shared storage; rebuilt on load
        save_file(state, str(tmp / WEIGHTS_FILE))
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / TOKENIZER_FILE)
    return out_dir


def _config_from(value: Any) -> ModelConfig:
    if isinstance(value, ModelConfig):
        return value
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return ModelConfig.from_dict(dict(value))
    raise MoeLitError(f"checkpoint: cannot read a model config from {type(value).__name__}")


def read_lightning_checkpoint(path: Union[str, Path]) -> dict[str, Any]:
    """The raw checkpoint dict (trusted local files: hyper-parameters hold config objects)."""
    return torch.load(Path(path), map_location="cpu", weights_only=False)


def load_config(path: Union[str, Path]) -> ModelConfig:
    path = _existing(path)
    if path.is_dir():
        return ModelConfig.from_dict(json.loads((path / CONFIG_FILE).read_text()))
    hparams = read_lightning_checkpoint(path).get("hyper_parameters", {})
    if "model" not in hparams:
        raise MoeLitError(f"checkpoint {path}: no 'model' hyper-parameter; is it a moe_lit checkpoint?")
    return _config_from(hparams["model"])


def load_model(path: Union[str, Path], map_location: str = "cpu"):
    """Rebuild the Transformer stored in a ``.ckpt`` file or an exported directory."""
    from moe_lit.model import Transformer

    path = _existing(path)
    if path.is_dir():
        from safetensors.torch import load_file

        cfg = ModelConfig.from_dict(json.loads((path / CONFIG_FILE).read_text()))
        state = load_file(str(path / WEIGHTS_FILE), device=map_location)
    else:
        ckpt = read_lightning_checkpoint(path)
        cfg = _config_from(ckpt.get("hyper_parameters", {}).get("model"))
        state = {k[len(STATE_PREFIX):]: v for k, v in ckpt["state_dict"].items() if k.startswith(STATE_PREFIX)}
    model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise MoeLitError(f"checkpoint {path}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    return model.to(map_location).eval()


def find_tokenizer(path: Union[str, Path]) -> Optional[Path]:
    """The tokenizer stored with a checkpoint: beside an export, or in the datamodule's data_dir."""
    path = _existing(path)
    if path.is_dir():
        candidate = path / TOKENIZER_FILE
        return candidate if candidate.is_file() else None
    data_hparams = read_lightning_checkpoint(path).get("datamodule_hyper_parameters", {})
    data_dir = data_hparams.get("data_dir")
    if data_dir and (Path(data_dir) / TOKENIZER_FILE).is_file():
        return Path(data_dir) / TOKENIZER_FILE
    return None


def _existing(path: Union[str, Path]) -> Path:
    path = Path(path)
    if not path.exists():
        raise MoeLitError(f"checkpoint: no such file or directory {path}")
    return path
