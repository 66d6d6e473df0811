"""Load and export models: Lightning ``.ckpt`` files and exported directories.

:func:`load_config` is the one resolver of a model of ours: a model YAML, an experiment YAML
(``moe-lit fit --config``), a ``.ckpt``, an exported directory. :func:`load_model` needs weights, so
it takes the last two; a YAML is a one-line error saying what to pass. A transformers directory is
read one layer up (:mod:`moe_lit.convert.model_input`, which the commands use); here it is a
one-line error saying so.

An exported directory holds ``config.json`` (the ``ModelConfig``), ``model.safetensors`` (the
``Transformer`` state dict, MegaBlocks expert layout) and, when known, ``tokenizer.json``.
A Lightning checkpoint of ``MoELitModule`` keeps the config in ``hyper_parameters['model']`` and
the weights under the ``model.`` prefix; transforms that change shapes (expert expansion,
upcycling) update that hyper-parameter, so a checkpoint always rebuilds into its own shape.

Reading never runs code: ``.ckpt`` files load with ``torch.load(weights_only=True)`` and only the
classes of :data:`SAFE_GLOBALS` besides tensors and plain data; a file that is missing, truncated,
not a checkpoint, hostile or unreadable is a :class:`MoeLitError` naming it (one line, exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

from moe_lit.config import ModelConfig, MoEConfig
from moe_lit.configbase import to_data, yaml_problem
from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_directory, atomic_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
STATE_PREFIX = "model."
RUN_LAST_CHECKPOINT = "checkpoints/last.ckpt"
"""A run directory's newest checkpoint (``moe-lit fit --out DIR``, ``train_run``)."""
SAFE_GLOBALS = (ModelConfig, MoEConfig, pathlib.PosixPath, pathlib.WindowsPath)
"""Classes a checkpoint may hold besides tensors and plain data: configs (checkpoints written before
hyper-parameters became plain dicts keep the dataclasses) and paths (a datamodule's ``data_dir``)."""
YAML_SUFFIXES = (".yaml", ".yml")
EXPERIMENT_KEYS = {"data", "trainer", "seed_everything", "checkpoint", "routing", "train", "ckpt_path"}
"""Top-level keys that make a YAML an experiment (LightningCLI) config rather than a model YAML."""
_UNSUPPORTED = re.compile(r"(?:[Uu]nsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)")


def export_model(model, out_dir: str | Path, tokenizer_file: str | Path | None = None) -> Path:
    """Write ``model`` (a Transformer) to ``out_dir`` atomically; returns the directory."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        if model.config.tie_embeddings:
            state.pop("lm_head.weight", None)  # safetensors refuses shared storage; rebuilt on load
        try:
            save_file(state, str(tmp / WEIGHTS_FILE))
        except SafetensorError as exc:
            raise _write_error(exc) from exc
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / TOKENIZER_FILE)
    return out_dir


def _write_error(exc: Exception) -> Exception:
    """safetensors' error for a refused write (``... I/O error: ... (os error 28)``) as the OSError it
    wraps, which the atomic directory turns into one line naming the output; any other error unchanged."""
    found = re.search(r"\(os error (\d+)\)", str(exc))
    return OSError(int(found.group(1)), os.strerror(int(found.group(1)))) if found else exc


def _config_from(value: Any, path: Path) -> ModelConfig:
    if dataclasses.is_dataclass(value) and not isinstance(value, (type, ModelConfig)):
        value = to_data(value)
    if not isinstance(value, (dict, ModelConfig)):
        raise MoeLitError(f"checkpoint {path}: no moe_lit model config inside; is it a moe_lit checkpoint?")
    try:
        return ModelConfig.from_dict(value)
    except (MoeLitError, TypeError) as exc:
        raise MoeLitError(f"checkpoint {path}: its model config is invalid ({exc})") from exc


def read_lightning_checkpoint(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """The raw checkpoint dict, loaded without running code (a MoeLitError naming the file if not);
    ``mmap``: its tensors mapped from the file instead of read (for a look at its keys)."""
    path = _existing(path)
    if path.is_dir():
        raise MoeLitError(f"checkpoint {path}: is a directory, expected a Lightning .ckpt file")
    if path.suffix in YAML_SUFFIXES:
        raise MoeLitError(
            f"checkpoint {path}: a config holds no weights; pass a .ckpt or an exported directory "
            f"(train one with moe-lit fit --config {path})"
        )
    try:
        # NOTE: the allow-list is scoped to this call (a context manager), never added globally.
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise MoeLitError(f"checkpoint {path}: refused, {_refusal(str(exc))}") from exc
    except PermissionError as exc:
        raise MoeLitError(f"checkpoint {path}: cannot read ({exc.strerror})") from exc
    except Exception as exc:
        # NOTE: garbage reaches torch's zip reader or its weights-only unpickler, which fail with
        # whatever they trip on (RuntimeError, OSError(EINVAL), KeyError, EOFError, ...).
        raise MoeLitError(f"checkpoint {path}: not a readable checkpoint (truncated or another format)") from exc
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise MoeLitError(f"checkpoint {path}: not a Lightning checkpoint (no state_dict)")
    return checkpoint


def _refusal(message: str) -> str:
    """Why torch's weights-only unpickler refused a file, in a few words."""
    found = _UNSUPPORTED.search(message)
    if found:
        return f"it holds {found.group(1)}, which is not weights or plain data (loading never runs code)"
    if "Weights only load failed" in message:
        return "it holds objects other than weights and plain data (loading never runs code)"
    return "not a readable checkpoint (truncated or another format)"


TRAINING_STATE_KEYS = ("optimizer_states", "lr_schedulers")
"""What a Lightning checkpoint holds only to continue its run (:func:`drop_training_state`)."""


def has_training_state(path: str | Path) -> bool:
    """Whether a Lightning checkpoint can continue its run: it holds the optimizer state."""
    return "optimizer_states" in read_lightning_checkpoint(path, mmap=True)


def drop_training_state(path: str | Path) -> bool:
    """Rewrite a Lightning checkpoint in place (atomically) without :data:`TRAINING_STATE_KEYS`: its
    weights and config load as before (:func:`load_model`), but it no longer resumes a run, as a
    ``save_weights_only`` checkpoint. False when it held none."""
    checkpoint = read_lightning_checkpoint(path)
    if not any(key in checkpoint for key in TRAINING_STATE_KEYS):
        return False
    for key in TRAINING_STATE_KEYS:
        checkpoint.pop(key, None)
    with atomic_file(path) as tmp:
        torch.save(checkpoint, tmp)
    return True


def checkpoint_config(checkpoint: dict[str, Any], path: str | Path) -> ModelConfig:
    """The ModelConfig inside a checkpoint dict read from ``path`` (see read_lightning_checkpoint)."""
    return _config_from(checkpoint.get("hyper_parameters", {}).get("model"), Path(path))


def load_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of any model input (module docstring); an experiment YAML's ``seq_len`` is
    its ``data.seq_len`` (else the datamodule's default), its ``vocab_size`` that of its prepared data
    when that exists (else the model YAML's)."""
    path = _existing(path)
    if path.is_file() and path.name == CONFIG_FILE:
        path = path.parent
    if path.is_dir():
        return _exported_config(_ours(path))
    if path.suffix in YAML_SUFFIXES:
        return _yaml_config(path)
    return checkpoint_config(read_lightning_checkpoint(path), path)


def _yaml_config(path: Path) -> ModelConfig:
    """A model YAML (``model:`` fields, optionally beside ``optim:``) or an experiment YAML."""
    doc = _read_yaml(path)
    if not (isinstance(doc, dict) and EXPERIMENT_KEYS & set(doc)):
        return _model_yaml(path)
    # NOTE: relative paths in an experiment YAML resolve against its own directory (docs/training.md).
    model = doc.get("model") or {}
    cfg = _model_yaml(path.parent / model) if isinstance(model, str) else _model_section(model, path)
    data = doc.get("data") or {}
    data = _read_yaml(path.parent / data) if isinstance(data, str) else data
    changes: dict[str, Any] = {"seq_len": data["seq_len"]} if "seq_len" in data else {}
    meta = path.parent / str(data.get("data_dir", "")) / "meta.json"
    if data.get("data_dir") and meta.is_file():
        changes["vocab_size"] = json.loads(meta.read_text())["vocab_size"]
    return cfg.replace(**changes)


def _model_yaml(path: Path) -> ModelConfig:
    _read_yaml(path)  # one line naming the file if it is missing, binary or not YAML
    try:
        return ModelConfig.from_yaml(path)
    except MoeLitError as exc:
        raise MoeLitError(f"{path}: {exc}") from exc


def _model_section(section: Any, path: Path) -> ModelConfig:
    """An experiment's inline ``model:`` section: ``{model: {...fields}, optim: {...}}``."""
    fields = section.get("model") if isinstance(section, dict) else None
    if not isinstance(fields, dict):
        raise MoeLitError(f"{path}: model: expected a YAML file name or a mapping with a model: mapping")
    try:
        return ModelConfig.from_dict(fields)
    except MoeLitError as exc:
        raise MoeLitError(f"{path}: {exc}") from exc


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(_existing(path).read_text())
    except UnicodeDecodeError as exc:
        raise MoeLitError(f"{path}: not a YAML file (binary; a checkpoint is a .ckpt or a directory)") from exc
    except yaml.YAMLError as exc:
        raise MoeLitError(f"{path}: not valid YAML ({yaml_problem(exc)})") from exc


def is_transformers_dir(path: Path) -> bool:
    """A transformers model directory (or its ``config.json``): the config names a ``model_type``."""
    directory = path.parent if path.name == CONFIG_FILE else path
    try:
        return "model_type" in json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def _ours(directory: Path) -> Path:
    """``directory``, unless it is a transformers one (a one-line error naming the loader that reads it)."""
    if is_transformers_dir(directory):
        raise MoeLitError(
            f"checkpoint {directory}: a transformers directory; read it with moe_lit.convert.model_input "
            "(as every moe-lit command does) or import it with moe-lit convert import-hf"
        )
    return directory


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when CUDA is available, else ``cpu``; any other name is checked and kept.

    NOTE: ``auto`` is every command's default, as Lightning's ``accelerator: auto`` is fit's."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise MoeLitError(f"device: {device!r} is not a torch device; allowed: auto, cpu, cuda, cuda:N") from exc
    if kind == "cuda" and not torch.cuda.is_available():
        raise MoeLitError(f"device: {device} requested but CUDA is not available; use auto or cpu")
    return device


def load_model(path: str | Path, map_location: str = "cpu"):
    """Rebuild the Transformer stored in a ``.ckpt`` file or an exported directory of ours, on
    ``map_location`` (a device name or ``auto``, see :func:`resolve_device`)."""
    from moe_lit.model import Transformer

    map_location = resolve_device(map_location)
    path = _existing(path)
    if path.is_dir():
        cfg = _exported_config(_ours(path))
        state = _exported_weights(path / WEIGHTS_FILE, map_location)
    else:
        ckpt = read_lightning_checkpoint(path)
        cfg = checkpoint_config(ckpt, path)
        state = {k[len(STATE_PREFIX) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(STATE_PREFIX)}
    model = Transformer(cfg)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a weight of another shape than the config says
        raise MoeLitError(f"checkpoint {path}: its weights do not fit its config ({_first_line(exc)})") from exc
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise MoeLitError(f"checkpoint {path}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    return model.to(map_location).eval()


def _exported_config(directory: Path) -> ModelConfig:
    file = directory / CONFIG_FILE
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError as exc:
        last = directory / RUN_LAST_CHECKPOINT
        if last.is_file():
            raise MoeLitError(f"checkpoint {directory}: a run directory; pass its newest checkpoint {last}") from exc
        raise MoeLitError(f"checkpoint {directory}: no {CONFIG_FILE}; is it an exported moe_lit model?") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MoeLitError(f"checkpoint {file}: not a readable JSON config ({_first_line(exc)})") from exc
    return _config_from(data, file)


def _exported_weights(file: Path, map_location: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        raise MoeLitError(f"checkpoint {file.parent}: no {WEIGHTS_FILE}; is it an exported moe_lit model?")
    try:
        return load_file(str(file), device=map_location)
    except (SafetensorError, OSError) as exc:
        raise MoeLitError(f"checkpoint {file}: not a readable safetensors file (truncated or another format)") from exc


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise MoeLitError(f"checkpoint: no such file or directory {path}")
    return path
