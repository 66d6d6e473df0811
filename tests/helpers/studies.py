"""Small study specs: dense_vs_sparse with every grid axis and ablation (planning only) and one that
trains real tiny models on a written corpus; the run section and model of the kinds' tiny studies."""

from pathlib import Path


def small_spec(**changes) -> dict:
    spec = {
        "name": "t",
        "kind": "dense_vs_sparse",
        "base": {"vocab_size": 97, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64},
        "budgets": [{"name": "S", "d_ff": 64}, {"name": "M", "d_ff": 128}],
        "grid": {"num_experts": ["dense", 4, 8], "top_k": [2], "match": ["active"]},
        "ablations": {
            "budget": "M",
            "num_experts": 4,
            "top_k": 2,
            "granularity": [1, 4],
            "shared_fraction": [0.5],
            "size_profiles": {"skewed": [3, 1, 1, 1]},
            "balancing": [{"balancing": "bias"}, {"balancing": "aux_loss", "aux_loss_coef": 0.01}],
            "capacity_factor": [1.0, 2.0],
            "match": ["total"],
        },
        "run": {"data": {"seq_len": 16, "batch_size": 4, "val_batches": 1}, "train": {"max_tokens": 4096}},
        "seeds": [0],
    }
    spec.update(changes)
    return spec


def trained_spec(tmp_path: Path, corpus: Path, steps: int, **changes) -> dict:
    """A dense_vs_sparse study of real ``steps``-step runs of 1-layer models on ``corpus`` (prepared
    into ``tmp_path/data``, vocabulary 300): S budget, E4 top-2 (``grid``/``ablations`` in ``changes``)."""
    spec = {
        "name": "e2e",
        "kind": "dense_vs_sparse",
        "data": {"source": str(corpus), "vocab_size": 300, "val_fraction": 0.1, "test_fraction": 0.1},
        "base": {"vocab_size": 300, "d_model": 32, "n_layers": 1, "n_heads": 4, "d_ff": 64},
        "budgets": [{"name": "S"}],
        "grid": {"num_experts": [4], "top_k": [2], "moe": {"backend": "torch"}},
        "run": {
            "data": {"data_dir": str(tmp_path / "data"), "seq_len": 16, "batch_size": 4, "val_batches": 1},
            "optim": {"warmup_steps": 1},
            "train": {"max_tokens": 16 * 4 * steps},
            "trainer": {"enable_progress_bar": False},
        },
    }
    spec.update(changes)
    return spec


def tiny_kind_run() -> dict:
    """The run section of a kind's tiny study: 16-token windows, 2 a batch, 4 CPU steps."""
    return {
        "data": {"data_dir": "some/data", "seq_len": 16, "batch_size": 2, "val_batches": 1},
        "optim": {"warmup_steps": 1},
        "train": {"max_steps": 4, "val_every": 4},
        "trainer": {"enable_progress_bar": False, "accelerator": "cpu"},
    }


def tiny_kind_model(**moe) -> dict:
    """A 2-layer, d_model-32 model over 300 tokens: an MoE with these ``moe`` fields, dense without."""
    model = {"vocab_size": 300, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64}
    return {**model, "moe": moe} if moe else model
