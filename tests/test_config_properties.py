"""Property-based checks of config validation (hypothesis): every valid config builds, and any value
of any type in any field either builds or raises ConfigError naming that field, never another error."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_lit.config import BACKENDS, BALANCING, SCORE_FUNCS, ConfigError, ModelConfig, MoEConfig

# NOTE: derandomized: the same examples on every run, so a CI run is reproducible; set
# derandomize=False locally to search further.
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.integers(-1, 2), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)
positive = st.integers(1, 6)
rate = st.floats(0, 1, allow_nan=False)


@st.composite
def moe_fields(draw, n_layers: int) -> dict:
    num_experts = draw(positive)
    return {
        "num_experts": num_experts,
        "expert_size": draw(st.one_of(positive, st.lists(positive, min_size=num_experts, max_size=num_experts))),
        "top_k": draw(st.integers(1, num_experts)),
        "shared_expert_size": draw(st.integers(0, 4)),
        "score_func": draw(st.sampled_from(SCORE_FUNCS)),
        "renormalize": draw(st.booleans()),
        "balancing": draw(st.sampled_from(BALANCING)),
        "aux_loss_coef": draw(rate),
        "bias_update_rate": draw(rate),
        "z_loss_coef": draw(rate),
        "capacity_factor": draw(st.one_of(st.none(), st.floats(0.1, 4))),
        "first_dense_layers": draw(st.integers(0, n_layers - 1)),
        "layer_interval": draw(positive),
        "backend": draw(st.sampled_from(BACKENDS)),
    }


@st.composite
def model_fields(draw) -> dict:
    n_heads = draw(st.sampled_from([1, 2, 4]))
    n_kv_heads = draw(st.sampled_from([None, *[k for k in (1, 2, 4) if n_heads % k == 0]]))
    n_layers = draw(st.integers(1, 4))
    return {
        "vocab_size": draw(st.integers(1, 100)),
        "d_model": n_heads * 2 * draw(st.integers(1, 4)),
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "seq_len": draw(positive),
        "rope_base": draw(st.floats(1, 1e6)),
        "d_ff": draw(positive),
        "moe": draw(st.one_of(st.none(), moe_fields(n_layers))),
        "tie_embeddings": draw(st.booleans()),
        "init_std": draw(st.floats(1e-4, 1)),
        "norm_eps": draw(st.floats(1e-8, 1e-2)),
        "loss_chunk_tokens": draw(st.integers(0, 512)),
    }


@SETTINGS
@given(model_fields())
def test_every_valid_config_builds_and_round_trips(fields):
    cfg = ModelConfig.from_dict(fields)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig.from_yaml(cfg.to_yaml()) == cfg


def _check_builds_or_names_the_field(build, field: str, prefix: str) -> None:
    try:
        build()
    except ConfigError as exc:
        assert f"{prefix}{field}" in str(exc) or field in str(exc).split(":", 1)[1], str(exc)
        assert len(str(exc).splitlines()) == 1


@SETTINGS
@given(model_fields(), st.sampled_from([f for f in ModelConfig.__dataclass_fields__ if f != "moe"]), JUNK)
def test_any_value_in_a_model_field_builds_or_is_a_config_error_naming_it(fields, field, value):
    _check_builds_or_names_the_field(lambda: ModelConfig.from_dict({**fields, field: value}), field, "model.")


@SETTINGS
@given(model_fields(), st.sampled_from(list(MoEConfig.__dataclass_fields__)), JUNK)
def test_any_value_in_a_moe_field_builds_or_is_a_config_error_naming_it(fields, field, value):
    moe = fields["moe"] or {"num_experts": 4, "expert_size": 8, "top_k": 2}
    _check_builds_or_names_the_field(
        lambda: ModelConfig.from_dict({**fields, "moe": {**moe, field: value}}), field, "moe."
    )


@SETTINGS
@given(JUNK.filter(lambda v: v is not None and not isinstance(v, dict)))
def test_a_moe_section_of_another_type_is_a_config_error(value):
    with pytest.raises(ConfigError, match="moe"):
        ModelConfig.from_dict({"moe": value})


def test_non_finite_numbers_are_refused():
    for field in ("rope_base", "init_std", "norm_eps"):
        with pytest.raises(ConfigError, match=f"model.{field}"):
            ModelConfig(**{field: math.nan})
