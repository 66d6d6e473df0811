"""Study kind ``language_expansion``: does an MoE add languages without the interference of a dense model?

Per seed a dense model and its active-matched MoE pretrain on the base languages (the new ones are validated on,
never trained on); each arm then continues from its weights twice (fresh optimizer and schedule): on a mix that adds
the new languages (``<arm>/continued``) and on the base languages alone (``<arm>/control``, ``control_steps`` steps:
as many as the continuation, or its base-language tokens). Arms: ``dense``, ``moe``, ``moe_grown`` (grown E -> m*E
experts at the switch by :func:`moe_lit.convert.expand.expand_experts`, in both runs). Interference = the base
languages' final val loss with the new languages minus without them (paired by seed: one seed's runs read one data
stream); gain = the drop on the new languages. Routing, after the continuation: the JS divergence of each new
language's expert usage from the base languages' mean, and for every pair of languages the JS divergence of their
expert usage beside that of their token-unigram distributions on the same text (shared subwords and scripts explain
part of any sharing).
Claims (Marco-MoE): dense interferes; each MoE arm interferes less than dense and, given ``margin``, not at all;
related languages (``families``) share experts beyond their shared tokens: the residual of routing JS after a
linear fit on unigram JS over all pairs is lower for related pairs than for unrelated ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lit.accounting import matched_moe_config
from moe_lit.config import ConfigError, ModelConfig
from moe_lit.convert.expand import expand_experts
from moe_lit.stats import format_values, summarize
from moe_lit.studies import plots
from moe_lit.studies import spec as check
from moe_lit.studies.identity import Call, Point
from moe_lit.studies.kinds import Analysis
from moe_lit.studies.measures import routing_divergence
from moe_lit.studies.records import cells, collect, minus, select
from moe_lit.studies.verdicts import EQUIVALENT, HIGHER, INDEPENDENT, LOWER, SCRATCH, Claim, Evidence, Subject, about

ARMS = ("dense", "moe", "moe_grown")
MOE_ARMS = ("moe", "moe_grown")
Values = dict[str, dict[str, dict[int, Any]]]
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
    """Optimizer steps of each continuation, with and without the new languages (pretraining: run.train)."""
    continue_warmup: int = 20
    """Warmup steps of the continuation's fresh schedule."""
    control_steps: int | None = None
    """Optimizer steps of the base-only control; null: ``continue_steps`` (the same token budget). Set it to
    ``continue_steps`` times the base languages' share of the continued mix to give the control the same
    base-language tokens, so that interference does not count the dilution of the base languages."""
    grow_factor: int = 2
    """moe_grown: m, the MoE grows E -> m*E experts at the switch."""
    margin: float | None = None
    """Largest |interference| (nats of base-language val loss) that counts as none, stated before the
    study runs (analysis only); null: the no-interference claims are untestable."""
    families: dict[str, list[str]] = field(default_factory=dict)
    """Groups of related languages (``romance: [fr, es, it, pt-br]``): pairs inside a group are
    related, all other pairs unrelated (analysis only); empty: the sharing claims are untestable."""

    def __post_init__(self) -> None:
        for name in ("base_languages", "new_languages"):
            check.distinct(getattr(self, name), name, each=lambda v: isinstance(v, str), what="language codes")
        if set(self.base_languages) & set(self.new_languages):
            raise ConfigError("new_languages: must not repeat a base language")
        if self.dense.moe is not None:
            raise ConfigError("dense.moe: the dense model must be dense (moe: null)")
        check.number(self.margin, "margin", 0, optional=True)
        check.positive_fields(self, "continue_steps", "grow_factor")
        check.positive_int(self.control_steps, "control_steps", optional=True)
        check.require(isinstance(self.families, dict), "families", "must map a group name to its languages")
        grouped = [lang for langs in self.families.values() for lang in langs]
        if grouped:
            check.distinct(grouped, "families", self.languages, what="languages (each in at most one group)")

    @property
    def languages(self) -> list[str]:
        return [*self.base_languages, *self.new_languages]


DEFAULT_RUN = {"data": {"seq_len": 64, "batch_size": 16, "val_batches": 4}, "train": {"max_steps": 600}}
PAPER, HERE = (
    Subject(SCRATCH, "the papers' LMs trained from scratch, then continued on new languages"),
    "scale and budget in the description above",
)
"""What the paper tested its claims on, and the study's scale (its object: :func:`analyse`)."""
parse = check.parser(LanguageExpansionSpec, ("dense", "base_languages", "new_languages"))


def expand(spec: LanguageExpansionSpec, header) -> list[Point]:
    moe = matched_moe_config(spec.dense, spec.num_experts, spec.top_k, "active", balancing="bias")
    base_mix = {"languages": spec.languages, "language_weights": {lang: 1.0 for lang in spec.base_languages}}
    grow = Call.of(expand_experts, factor=spec.grow_factor, noise=0.0, balancing=None)
    measure, points = Call.of(measure_routing, new_languages=spec.new_languages), []
    for seed in header.seeds:
        pretrain = header.seeded_run(seed, header.run.replace(data=base_mix))
        train, optim = {"max_steps": spec.continue_steps}, {"warmup_steps": spec.continue_warmup}
        runs = {"continued": pretrain.replace(data={"language_weights": None}, train=train, optim=optim)}
        control = {"max_steps": spec.control_steps or spec.continue_steps}
        runs["control"] = pretrain.replace(train=control, optim=optim)  # base languages only
        for family, model in (("dense", spec.dense), ("moe", moe)):
            points.append(header.point(f"{family}/base", seed, model, pretrain, {"phase": "base", "family": family}))
            base, start = header.point_name(f"{family}/base", seed), header.start(f"{family}/base", seed)
            for arm in ("dense",) if family == "dense" else MOE_ARMS:
                transform = grow if arm == "moe_grown" else None
                for phase, run in runs.items():
                    info = {"phase": phase, "family": arm, "base_point": base}
                    measured = measure if family == "moe" and phase == "continued" else None
                    points.append(
                        header.point(f"{arm}/{phase}", seed, model, run, info, start, transform, (), measured)
                    )
    return points


def measure_routing(point: Point, result: Any, run_dir: Path, new_languages: list[str]) -> dict[str, Any]:
    """The routing and token-unigram divergences (:func:`moe_lit.studies.measures.routing_divergence`)."""
    return routing_divergence(result.checkpoint, point.run, new_languages)


def _loss(record: dict[str, Any], languages: list[str]) -> float:
    per = record["val_loss_per_language"]
    return sum(per[lang] for lang in languages) / len(languages)


def per_arm(plan: dict[str, Any], records: list[dict[str, Any]]) -> Values:
    """arm -> measure (interference, gain, base, control, new, js, residuals) -> seed -> value, each
    continued run against its own base point and its seed's base-only control."""
    spec = plan["spec"]
    base_langs, new_langs = spec["base_languages"], spec["new_languages"]
    ok, items = {r["name"]: r for r in select(records)}, []
    controls = {(r["family"], r.get("seed", 0)): r for r in select(records, phase="control")}
    for record in select(records, phase="continued"):
        if (parent := ok.get(record.get("base_point") or "")) is None:
            continue
        values = {
            "gain": _loss(parent, new_langs) - _loss(record, new_langs),
            "base": _loss(record, base_langs),
            "new": _loss(record, new_langs),
        }
        if (control := controls.get((record["family"], record.get("seed", 0)))) is not None:
            values |= {
                "control": _loss(control, base_langs),
                "interference": values["base"] - _loss(control, base_langs),
            }
        if record.get("routing_js_new_vs_base"):
            values["js"] = sum(record["routing_js_new_vs_base"].values()) / len(new_langs)
        if record.get("routing_js_pairs"):
            values["pairs"] = {p: (record["unigram_js_pairs"][p], js) for p, js in record["routing_js_pairs"].items()}
            values |= _residuals(values["pairs"], spec.get("families") or {})
        items.append((record["family"], record.get("seed", 0), values))
    return {arm: {} for arm in ARMS} | collect(items)  # type: ignore[return-value]


def related(pair: str, families: dict[str, list[str]]) -> bool:
    """Whether the two languages of ``pair`` ("a|b") are in one group of ``families``."""
    a, b = pair.split("|")
    return any(a in langs and b in langs for langs in families.values())


def _residuals(pairs: dict[str, tuple[float, float]], families: dict[str, list[str]]) -> dict[str, Any]:
    """Mean residual of routing JS after a least-squares line on unigram JS, over related and over
    unrelated pairs, and each pair's residual (none where a side has no pair)."""
    import numpy as np

    names = list(pairs)
    uni, js = np.array([pairs[p][0] for p in names]), np.array([pairs[p][1] for p in names])
    sides: dict[bool, list[float]] = {True: [], False: []}
    residuals: dict[str, float] = {}
    if len(names) >= 3:
        slope, intercept = np.polyfit(uni, js, 1)
        for name, residual in zip(names, js - (slope * uni + intercept), strict=True):
            sides[related(name, families)].append(float(residual))
            residuals[name] = float(residual)
    if not sides[True] or not sides[False]:
        return {}
    means = {"related_residual": float(np.mean(sides[True])), "unrelated_residual": float(np.mean(sides[False]))}
    return means | {"pair_residuals": residuals}


COLUMNS = {
    "interference (with new languages minus without; > 0: interferes)": "interference",
    "final loss, base languages": "base",
    "base languages, base-only control": "control",
    "gain on new languages": "gain",
    "final loss, new languages": "new",
    "JS(new vs base usage), bits": "js",
}


def _claims(values: Values, spec: dict[str, Any]) -> list:
    interference = {arm: values[arm].get("interference", {}) for arm in ARMS}
    dense, margin = interference["dense"], spec.get("margin")
    claims = [
        Claim("dense: adding languages interferes (typical of dense models)", "interference", ("dense", "0"), HIGHER)
    ]
    tested = [claims[0].on(dense, 0.0) if dense else claims[0].missing("dense/continued or dense/control missing")]
    for arm in (a for a in MOE_ARMS if interference[a]):
        less = Claim(f"{arm}: adds languages with less interference than dense", "interference", (arm, "dense"), LOWER)
        none = Claim(f"{arm}: adds languages without interference", "interference", (arm, "0"), EQUIVALENT, margin)
        tested += [less.on(interference[arm], dense), none.on(interference[arm], 0.0)]  # no margin: untestable
    for arm in (a for a in MOE_ARMS if values[a].get("js")):
        text = f"{arm}: related languages share experts beyond their shared tokens"
        sharing = Claim(text, "routing JS residual", ("related pairs", "unrelated pairs"), LOWER)
        rel, unrel = values[arm].get("related_residual", {}), values[arm].get("unrelated_residual", {})
        why = "families: no related and unrelated pairs of measured languages"
        tested.append(_conservative(text, values[arm], spec) if rel and unrel else sharing.missing(why))
    return tested


def _conservative(text: str, values: dict[str, Any], spec: dict[str, Any]) -> Evidence:
    """The sharing claim by both units, its verdict on the larger p: seeds (each seed's related minus unrelated
    mean residual, paired) and language pairs (each pair's residual averaged over seeds; Welch, related vs
    unrelated), the fixed pairs being what a claim about languages generalises over."""
    by_seeds = Claim(text, "routing JS residual (seeds)", ("related pairs", "unrelated pairs"), LOWER)
    seeds = by_seeds.on(values["related_residual"], values["unrelated_residual"])
    per_pair: dict[str, list[float]] = {}
    for residuals in values.get("pair_residuals", {}).values():
        for pair, residual in residuals.items():
            per_pair.setdefault(pair, []).append(residual)
    families, means = spec.get("families") or {}, {pair: sum(v) / len(v) for pair, v in per_pair.items()}
    sides = {side: [m for pair, m in means.items() if related(pair, families) == side] for side in (True, False)}
    unit = "routing JS residual (language pairs, seeds averaged)"
    by_pairs = Claim(text, unit, ("related pairs", "unrelated pairs"), LOWER, pairing=INDEPENDENT)
    pairs = by_pairs.on(dict(enumerate(sides[True])), dict(enumerate(sides[False])))
    if not pairs.decides:
        return seeds
    verdict, other = (pairs, seeds) if not seeds.decides or pairs.p >= seeds.p else (seeds, pairs)
    return dataclasses.replace(verdict, also=other)


def _pair_rows(values: Values, families: dict[str, list[str]]) -> list[dict[str, Any]]:
    """Per language pair: related or not, unigram JS and each MoE arm's routing JS (mean ± std over seeds)."""
    names = next((list(p) for a in MOE_ARMS for p in values[a].get("pairs", {}).values()), [])
    rows = []
    for pair in names:
        row = {"pair": pair, "related": "yes" if related(pair, families) else "no"}
        for arm in MOE_ARMS:
            measured = [p[pair] for p in values[arm].get("pairs", {}).values() if pair in p]
            if measured:
                row["unigram JS, bits"] = format_values([u for u, _ in measured])
                row[f"routing JS {arm}, bits"] = format_values([js for _, js in measured])
        rows.append(row)
    return rows


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    values, spec = per_arm(plan, records), plan["spec"]
    rows = [{"arm": arm} | cells(values[arm], COLUMNS) for arm in ARMS if values[arm]]
    tables = {"Switch to the new languages (mean ± std over seeds)": rows}
    if pairs := _pair_rows(values, spec.get("families") or {}):
        tables["Language pairs after the continuation (mean ± std over seeds)"] = pairs
    figure = interference_figure(values, spec.get("families") or {})
    return Analysis(
        claims=about(_claims(values, spec), PAPER, Subject(SCRATCH, HERE)),
        tables=tables,
        plots=[plots.save(figure, plots_dir, "interference")] if figure is not None else [],
    )


def interference_figure(values: Values, families: dict[str, list[str]] | None = None):
    """Interference per arm (± std over seeds), each MoE arm's minus dense's (paired by seed), both
    around a zero line, and the moe arm's routing JS against unigram JS per language pair (related
    pairs filled); None when no arm has an interference."""
    arms = [arm for arm in ARMS if values.get(arm, {}).get("interference")]
    if not arms:
        return None
    fig, (ax_arm, ax_diff, ax_pairs) = plots.panels(3, 4.75)
    stats = [summarize(list(values[arm]["interference"].values())) for arm in arms]
    dense = values.get("dense", {}).get("interference", {})
    others = {arm: minus(values[arm]["interference"], dense) for arm in arms if arm != "dense"}
    others = {arm: diffs for arm, diffs in others.items() if diffs}
    ylabel = "base-language val loss, with new languages\nminus without (> 0: interference)"
    plots.categories(ax_arm, arms, {None: stats}, ylabel, "interference per arm", zero=True)
    diffs = [summarize(list(d.values())) for d in others.values()]
    ylabel = "interference minus dense's\n(< 0: less interference than dense)"
    plots.categories(
        ax_diff, list(others), {None: diffs}, ylabel, "minus dense, paired by seed", zero=True, color="tab:red"
    )
    for seed, pairs in values.get("moe", {}).get("pairs", {}).items():
        for name, (unigram, js) in pairs.items():
            color = f"C{seed % 10}"
            face = color if related(name, families or {}) else "none"
            ax_pairs.scatter(unigram, js, s=18, edgecolors=color, facecolors=face)
    ax_pairs.set(
        xlabel="token-unigram JS, bits", ylabel="routing JS (moe), bits", title="language pairs (filled: related)"
    )
    ax_pairs.grid(alpha=0.3)
    return fig


__all__ = [
    "LanguageExpansionSpec",
    "analyse",
    "expand",
    "interference_figure",
    "measure_routing",
    "parse",
    "per_arm",
    "related",
]
