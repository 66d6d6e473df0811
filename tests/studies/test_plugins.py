"""Study plug-ins by registered name (moe_lit.studies.plugins): a new kind is its module and its
registration, nothing else; an unknown kind or plug-in name is one line."""

import types

import pytest

from moe_lit.config import ConfigError
from moe_lit.registry import Entry
from moe_lit.studies.identity import Call
from moe_lit.studies.kinds import Analysis, kind_module
from moe_lit.studies.plugins import KINDS, MEASUREMENTS, POINT_PLUGINS
from moe_lit.studies.report import write_report
from moe_lit.studies.study import parse_study, run_study
from tests.helpers.models import tiny
from tests.studies import fakes


def measure_width(point, result, run_dir, scale: int) -> dict:
    """A new kind's measurement: the model's d_ff times ``scale``."""
    return {"width": point.model.d_ff * scale}


def _expand(spec, header):
    measure = Call.of(measure_width, scale=spec["scale"])
    models = [tiny().replace(d_ff=d_ff) for d_ff in (32, 64)]
    return [
        header.point(f"d_ff={m.d_ff}", seed, m, header.seeded_run(seed), {"d_ff": m.d_ff}, measure=measure)
        for seed in header.seeds
        for m in models
    ]


def _analyse(plan, records, plots_dir):
    return Analysis(tables={"widths": [{"width": record["width"]} for record in records]})


def _new_kind() -> types.ModuleType:
    """What a new kind module holds: its base run, spec, plan and analysis."""
    kind = types.ModuleType("moe_lit.studies.kinds.widths")
    kind.DEFAULT_RUN = {"data": {"seq_len": 16, "batch_size": 4}, "train": {"max_steps": 2, "val_every": 2}}
    kind.parse, kind.expand, kind.analyse = lambda fields, header: dict(fields), _expand, _analyse
    return kind


def test_a_new_kind_is_its_module_and_its_registration(monkeypatch, tmp_path):
    kind = _new_kind()
    monkeypatch.setitem(KINDS._entries, "widths", Entry("widths", 1, kind))
    monkeypatch.setitem(MEASUREMENTS._entries, "measure_width", Entry("measure_width", 1, measure_width))
    assert kind_module("widths") is kind
    study = parse_study({"name": "widths", "kind": "widths", "seeds": [0, 1], "scale": 3})
    assert [p.name for p in study.points] == ["d_ff=32/s0", "d_ff=64/s0", "d_ff=32/s1", "d_ff=64/s1"]
    records = run_study(study, tmp_path, train_fn=fakes.fake_train, prepare_data=False, log=lambda _: None)
    assert [r["width"] for r in records] == [96, 192, 96, 192] and all(r["status"] == "ok" for r in records)
    write_report(tmp_path)
    assert "| 96 |" in (tmp_path / "summary.md").read_text()


def test_an_unknown_kind_or_plug_in_is_one_line_naming_the_registered_ones():
    with pytest.raises(ConfigError, match="^kind: got 'magic', allowed values: dense_vs_sparse, upcycling, ") as info:
        kind_module("magic")
    assert "\n" not in str(info.value)
    with pytest.raises(LookupError, match="^study plug-in: unknown name 'nope', registered: expand_experts, dropless"):
        Call("nope").resolve()


def test_every_point_plug_in_has_one_name_in_one_registry():
    names = [name for registry in POINT_PLUGINS for name in registry.names()]
    assert len(names) == len(set(names))
    assert all(Call.of(fn).name == name for registry in POINT_PLUGINS for name, fn in registry.items())
