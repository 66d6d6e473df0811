"""A small dense_vs_sparse study spec (every grid axis and ablation, a tiny budget)."""


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
