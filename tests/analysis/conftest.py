"""The tiny tokenizer, MoE model and exported checkpoint of tests/evaluation, for the analysis tests."""

from tests.evaluation.conftest import exported, prepared_dir, tiny_moe

__all__ = ["exported", "prepared_dir", "tiny_moe"]
