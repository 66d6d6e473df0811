"""The tiny exported MoE model and parallel corpus of the evaluation tests, for the prune command."""

from tests.evaluation.conftest import exported, prepared_dir, tiny_moe  # noqa: F401 - fixtures
