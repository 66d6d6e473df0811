"""Study kind ``language_expansion``: does an MoE add languages without the interference of a dense model?

Per seed a dense model and its active-matched MoE pretrain on the base languages (the new ones are validated on,
never trained on); each continues from its weights (fresh optimizer and schedule, the same token budget) on a mix
that adds the new languages: ``dense``, ``moe``, ``moe_grown`` (grown E -> m*E experts at the switch by
:func:`moe_lit.convert.expand.expand_experts`). Interference = the base languages' val loss change from the switch
to the end; gain = the drop on the new languages; routing: the JS divergence of each new language's expert usage
from the base languages' mean (0 = same experts, 1 = disjoint) after the continuation. Claims (Marco-MoE): each MoE
arm interferes less than dense, paired by seed (one seed's arms read one data stream). Plot: the interference per
arm and each MoE arm minus dense, paired by seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_lit.accounting import matched_moe_config
from moe_lit.config import ConfigError, ModelConfig
from moe_lit.convert.expand import expand_experts
from moe_lit.stats import summarize
from moe_lit.studies import plots
from moe_lit.studies import spec as check
from moe_lit.studies.engine import Call, Point
from moe_lit.studies.kinds import Analysis
from moe_lit.studies.measures import routing_divergence
from moe_lit.studies.records import cells, collect, minus, select
from moe_lit.studies.verdicts import LOWER, Claim

ARMS = ("dense", "moe", "moe_grown")
CLAIM = "an MoE adds languages without the dense model's interference (Marco-MoE)"
Values = dict[str, dict[str, dict[int, float]]]
"""arm -> measure -> seed -> value."""


@dataclass
class LanguageExpansionSpec:
    """The kind's own fields."""

    dense: ModelConfig
    """The dense model (seq_len from run.data.seq_len); the MoE is matched to it on active parameters."""
    base_languages: list[str]
    """Languages of the pretraining phase."""
    new_languages: list[str]
    """Languages added in the continuation (validated on, not trained on, before it)."""
    num_experts: int = 8
    """Experts of the MoE."""
    top_k: int = 2
    """Top-k of the MoE."""
    continue_steps: int = 600
    """Optimizer steps of the continuation (the pretraining budget is run.train)."""
    continue_warmup: int = 20
    """Warmup steps of the continuation's fresh schedule."""
    grow_factor: int = 2
    """moe_grown: m, the MoE grows E -> m*E experts at the switch."""

    def __post_init__(self) -> None:
        for name in ("base_languages", "new_languages"):
            check.distinct(getattr(self, name), name, each=lambda v: isinstance(v, str), what="language codes")
        if set(self.base_languages) & set(self.new_languages):
            raise ConfigError("new_languages: must not repeat a base language")
        if self.dense.moe is not None:
            raise ConfigError("dense.moe: the dense model must be dense (moe: null)")

    @property
    def languages(self) -> list[str]:
        return [*self.base_languages, *self.new_languages]


DEFAULT_RUN = {"data": {"seq_len": 64, "batch_size": 16, "val_batches": 4}, "train": {"max_steps": 600}}
parse = check.parser(LanguageExpansionSpec, ("dense", "base_languages", "new_languages"))


def expand(spec: LanguageExpansionSpec, header) -> list[Point]:
    moe = matched_moe_config(spec.dense, spec.num_experts, spec.top_k, "active", balancing="bias")
    base_mix = {"languages": spec.languages, "language_weights": {lang: 1.0 for lang in spec.base_languages}}
    grow = Call.of(expand_experts, factor=spec.grow_factor, noise=0.0, balancing=None)
    measure, points = Call.of(measure_routing, new_languages=spec.new_languages), []
    for seed in header.seeds:
        pretrain = header.seeded_run(seed, header.run.replace(data=base_mix))
        train, optim = {"max_steps": spec.continue_steps}, {"warmup_steps": spec.continue_warmup}
        cont = pretrain.replace(data={"language_weights": None}, train=train, optim=optim)
        for family, model in (("dense", spec.dense), ("moe", moe)):
            points.append(header.point(f"{family}/base", seed, model, pretrain, {"phase": "base", "family": family}))
            base, start = header.point_name(f"{family}/base", seed), header.start(f"{family}/base", seed)
            for arm in ("dense",) if family == "dense" else ("moe", "moe_grown"):
                info = {"phase": "continued", "family": arm, "base_point": base}
                transform, measured = grow if arm == "moe_grown" else None, measure if family == "moe" else None
                points.append(header.point(f"{arm}/continued", seed, model, cont, info, start, transform, (), measured))
    return points


def measure_routing(point: Point, result: Any, run_dir: Path, new_languages: list[str]) -> dict[str, Any]:
    """The new languages' routing divergence (:func:`moe_lit.studies.measures.routing_divergence`)."""
    return routing_divergence(result.checkpoint, point.run, new_languages)


def _loss(record: dict[str, Any], languages: list[str]) -> float:
    per = record["val_loss_per_language"]
    return sum(per[lang] for lang in languages) / len(languages)


def per_arm(plan: dict[str, Any], records: list[dict[str, Any]]) -> Values:
    """arm -> measure (interference, gain, base, new, js) -> seed -> value, each continued run
    against its own base point."""
    base_langs, new_langs = plan["spec"]["base_languages"], plan["spec"]["new_languages"]
    ok, items = {r["name"]: r for r in select(records)}, []
    for record in select(records, phase="continued"):
        if (parent := ok.get(record.get("base_point") or "")) is None:
            continue
        values = {
            "interference": _loss(record, base_langs) - _loss(parent, base_langs),
            "gain": _loss(parent, new_langs) - _loss(record, new_langs),
            "base": _loss(record, base_langs),
            "new": _loss(record, new_langs),
        }
        if record.get("routing_js_new_vs_base"):
            values["js"] = sum(record["routing_js_new_vs_base"].values()) / len(new_langs)
        items.append((record["family"], record.get("seed", 0), values))
    return {arm: {} for arm in ARMS} | collect(items)  # type: ignore[return-value]


COLUMNS = {
    "interference (base-language loss change; < 0: improved)": "interference",
    "final loss, base languages": "base",
    "gain on new languages": "gain",
    "final loss, new languages": "new",
    "JS(new vs base usage), bits": "js",
}


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    values = per_arm(plan, records)
    rows = [{"arm": arm} | cells(values[arm], COLUMNS) for arm in ARMS if values[arm]]
    dense = values["dense"].get("interference", {})
    claims = [
        Claim(f"{arm}: {CLAIM}", "interference", (arm, "dense"), LOWER).on(mine, dense)
        for arm in ("moe", "moe_grown")
        if (mine := values[arm].get("interference")) and dense
    ]
    figure = interference_figure(values)
    return Analysis(
        claims=claims,
        tables={"Switch to the new languages (mean ± std over seeds)": rows},
        plots=[plots.save(figure, plots_dir, "interference")] if figure is not None else [],
    )


def interference_figure(values: Values):
    """Interference per arm (± std over seeds) and each MoE arm's minus dense's, paired by seed,
    both around a zero line; None when no arm finished."""
    arms = [arm for arm in ARMS if values.get(arm, {}).get("interference")]
    if not arms:
        return None
    fig, (ax_arm, ax_diff) = plots.panels(2, 4.75)
    stats = [summarize(list(values[arm]["interference"].values())) for arm in arms]
    dense = values.get("dense", {}).get("interference", {})
    others = {arm: minus(values[arm]["interference"], dense) for arm in arms if arm != "dense"}
    others = {arm: diffs for arm, diffs in others.items() if diffs}
    ylabel = "base-language val loss change, switch to end\n(< 0: improved)"
    plots.categories(ax_arm, arms, {None: stats}, ylabel, "interference per arm", zero=True)
    diffs = [summarize(list(d.values())) for d in others.values()]
    ylabel = "interference minus dense's\n(> 0: more interference than dense)"
    plots.categories(
        ax_diff, list(others), {None: diffs}, ylabel, "minus dense, paired by seed", zero=True, color="tab:red"
    )
    return fig


__all__ = ["LanguageExpansionSpec", "analyse", "expand", "interference_figure", "measure_routing", "parse", "per_arm"]
