"""Checkpoint files as MoELitModule writes them, and the broken inputs every command must refuse."""

import json

import torch

from tests.helpers.models import tiny


def lightning_checkpoint(path, model):
    """A checkpoint as MoELitModule writes it: weights under ``model.``, the config as a plain dict."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": {"model": model.config.to_dict()}}, path)
    return path


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def bad_checkpoint(name, tmp_path, files):
    """Make the bad input of table case ``name``; returns (path given to the command, expected words)."""
    if name == "missing":
        return tmp_path / "nope.ckpt", "no such file"
    if name == "truncated ckpt":
        _truncate(files["ckpt"])
        return files["ckpt"], "not a readable checkpoint"
    if name == "truncated safetensors":
        _truncate(files["export"] / "model.safetensors")
        return files["export"], "not a readable safetensors file"
    if name == "not a checkpoint":
        (tmp_path / "notes.ckpt").write_text("hello")
        return tmp_path / "notes.ckpt", "not a readable checkpoint"
    if name == "another lightning module":
        torch.save({"state_dict": {"w": torch.zeros(1)}, "hyper_parameters": {"lr": 1.0}}, tmp_path / "other.ckpt")
        return tmp_path / "other.ckpt", "no moe_lit model config inside"
    if name == "export without config.json":
        (files["export"] / "config.json").unlink()
        return files["export"], "no config.json"
    if name == "weights of another shape":
        cfg = tiny().to_dict()
        cfg["d_model"] = 64
        (files["export"] / "config.json").write_text(json.dumps(cfg))
        return files["export"], "do not fit its config"
    raise AssertionError(name)


CASES = [
    "missing",
    "truncated ckpt",
    "truncated safetensors",
    "not a checkpoint",
    "another lightning module",
    "export without config.json",
    "weights of another shape",
]
