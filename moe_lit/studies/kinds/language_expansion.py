"""Study kind ``language_expansion``: does an MoE add languages without the interference of a dense model?

Per seed: a dense model and its active-matched MoE pretrain on the base languages (the new ones
are validated on, never trained on); each then continues from its weights (fresh optimizer and
schedule) on a mix that adds the new languages, with the same token budget: ``dense``, ``moe`` and
``moe_grown`` (the MoE grown E -> m*E experts at the switch by :func:`moe_lit.convert.expand.expand_experts`).
Interference = change in val loss on the base languages from the switch to the end; gain = the drop
on the new languages; routing: the JS divergence of each new language's expert usage from the base
languages' mean (0 = same experts, 1 = disjoint), measured on validation tokens after the continuation.
Plot ``plots/interference.png``: the interference per arm and each MoE arm minus dense, paired by
seed (± std over seeds).
Built only from the engine's parts: parent links (``init``), a transform, a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_lit.accounting import matched_moe_config
from moe_lit.config import ConfigError, ModelConfig
from moe_lit.plotting import pyplot, save_figure, seed_errorbar, spread_note, zero_line
from moe_lit.studies.engine import Call, Point, Start
from moe_lit.studies.kinds import Analysis, check_fields
from moe_lit.studies.stats import compare_paired, format_comparison, format_summary, summarize

ARMS = ("dense", "moe", "moe_grown")


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
            value = getattr(self, name)
            if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{name}: must be a non-empty list of language codes, got {value!r}")
        if set(self.base_languages) & set(self.new_languages):
            raise ConfigError("new_languages: must not repeat a base language")
        if self.dense.moe is not None:
            raise ConfigError("dense.moe: the dense model must be dense (moe: null)")

    @property
    def languages(self) -> list[str]:
        return [*self.base_languages, *self.new_languages]


def default_run() -> dict[str, Any]:
    return {"data": {"seq_len": 64, "batch_size": 16, "val_batches": 4}, "train": {"max_steps": 600}}


def parse(fields: dict[str, Any], header) -> LanguageExpansionSpec:
    check_fields(LanguageExpansionSpec, fields, ("dense", "base_languages", "new_languages"))
    dense = ModelConfig.from_dict(dict(fields["dense"])).replace(seq_len=header.run.data.seq_len)
    return LanguageExpansionSpec(**{**fields, "dense": dense})


def expand(spec: LanguageExpansionSpec, header) -> list[Point]:
    moe = matched_moe_config(spec.dense, spec.num_experts, spec.top_k, "active", balancing="bias")
    base_mix = {"languages": spec.languages, "language_weights": {lang: 1.0 for lang in spec.base_languages}}
    grow = Call("moe_lit.convert.expand:expand_experts", {"factor": spec.grow_factor, "noise": 0.0, "balancing": None})
    measure = Call("moe_lit.studies.kinds.language_expansion:measure_routing", {"new_languages": spec.new_languages})
    points = []
    for seed in header.seeds:
        pretrain = header.seeded_run(seed, header.run.replace(data=base_mix))
        cont = pretrain.replace(
            data={"language_weights": None},
            train={"max_steps": spec.continue_steps},
            optim={"warmup_steps": spec.continue_warmup},
        )
        for model_name, model in (("dense", spec.dense), ("moe", moe)):
            parent = header.point_name(f"{model_name}/base", seed)
            info = {"phase": "base", "family": model_name}
            points.append(Point(parent, f"{model_name}/base", seed, model, pretrain, info=info))
            arms = [("dense", None)] if model_name == "dense" else [("moe", None), ("moe_grown", grow)]
            for arm, transform in arms:
                points.append(
                    Point(
                        header.point_name(f"{arm}/continued", seed),
                        f"{arm}/continued",
                        seed,
                        model,
                        cont,
                        info={"phase": "continued", "family": arm, "base_point": parent},
                        start=Start(parent=parent, mode="init"),
                        transform=transform,
                        measure=measure if model_name == "moe" else None,
                    )
                )
    return points


def measure_routing(point: Point, result: Any, run_dir: Path, new_languages: list[str]) -> dict[str, Any]:
    """JS divergence (bits, mean over MoE layers) of each new language's expert usage from the
    mean usage of the base languages, on the run's validation tokens."""
    import torch

    from moe_lit.analysis.routing import js_divergence, usage_by_language
    from moe_lit.checkpoint import load_model
    from moe_lit.evaluation.routing_trace import routing_trace
    from moe_lit.lit.datamodule import MoEDataModule

    data = point.run.data
    model = load_model(result.checkpoint).eval()
    datamodule = MoEDataModule(
        data.resolved_dir(),
        seq_len=data.seq_len,
        batch_size=data.batch_size,
        languages=data.languages,
        val_batches=data.val_batches,
        seed=point.seed,
    )
    languages = datamodule.languages
    with torch.no_grad(), routing_trace(model) as recorder:
        for lang, loader in zip(languages, datamodule.val_dataloader(), strict=False):
            for batch_BL1 in loader:
                recorder.set_labels(language=lang)
                model(batch_BL1[:, :-1])
    usage_GME = usage_by_language(recorder.trace(), languages)
    base = [i for i, lang in enumerate(languages) if lang not in new_languages]
    base_ME = usage_GME[base].mean(dim=0)
    js = {lang: float(js_divergence(usage_GME[languages.index(lang)], base_ME).mean()) for lang in new_languages}
    return {"routing_js_new_vs_base": js}


def _losses(record: dict[str, Any], languages: list[str]) -> float:
    per = record["val_loss_per_language"]
    return sum(per[lang] for lang in languages) / len(languages)


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    spec = plan["spec"]
    base_langs, new_langs = spec["base_languages"], spec["new_languages"]
    ok = {r["name"]: r for r in records if r["status"] == "ok"}
    # arm -> measure -> seed -> value (paired by seed: the arms of one seed read the same data stream)
    per_arm: dict[str, dict[str, dict[int, float]]] = {arm: {} for arm in ARMS}
    for record in ok.values():
        parent = ok.get(record.get("base_point") or "")
        if record["phase"] != "continued" or parent is None:
            continue
        values = {
            "interference": _losses(record, base_langs) - _losses(parent, base_langs),
            "gain": _losses(parent, new_langs) - _losses(record, new_langs),
            "base": _losses(record, base_langs),
            "new": _losses(record, new_langs),
        }
        if record.get("routing_js_new_vs_base"):
            values["js"] = sum(record["routing_js_new_vs_base"].values()) / len(new_langs)
        for key, value in values.items():
            per_arm[record["family"]].setdefault(key, {})[record.get("seed", 0)] = value

    def cell(arm: str, key: str) -> str:
        values = per_arm[arm].get(key)
        return format_summary(summarize(list(values.values()))) if values else ""

    rows = [
        {
            "arm": arm,
            "interference (base-language loss change; < 0: improved)": cell(arm, "interference"),
            "final loss, base languages": cell(arm, "base"),
            "gain on new languages": cell(arm, "gain"),
            "final loss, new languages": cell(arm, "new"),
            "JS(new vs base usage), bits": cell(arm, "js"),
        }
        for arm in ARMS
        if per_arm[arm]
    ]
    findings = []
    dense = per_arm["dense"].get("interference", {})
    for arm in ("moe", "moe_grown"):
        mine = per_arm[arm].get("interference", {})
        seeds = sorted(set(mine) & set(dense))
        if seeds:
            verdict = compare_paired([mine[s] for s in seeds], [dense[s] for s in seeds])
            findings.append(
                f"- **Interference, {arm} minus dense** (Marco-MoE: an MoE adds languages without the dense "
                f"model's interference; paired by seed): {format_comparison(verdict)}; "
                f"**{'reproduced' if verdict.significant and verdict.diff < 0 else 'not reproduced'}**."
            )
    figure = interference_figure(per_arm)
    plots = [save_figure(figure, Path(plots_dir) / "interference.png")] if figure is not None else []
    return Analysis(
        findings=findings, tables={"Switch to the new languages (mean ± std over seeds)": rows}, plots=plots
    )


def interference_figure(per_arm: dict[str, dict[str, dict[int, float]]]):
    """Interference per arm (± std over seeds) and each MoE arm's minus dense's, paired by seed,
    both around a zero line; None when no arm finished."""
    arms = [arm for arm in ARMS if per_arm.get(arm, {}).get("interference")]
    if not arms:
        return None
    plt = pyplot()
    fig, (ax_arm, ax_diff) = plt.subplots(1, 2, figsize=(9.5, 4))
    stats = [summarize(list(per_arm[arm]["interference"].values())) for arm in arms]
    seed_errorbar(ax_arm, range(len(arms)), stats, linestyle="none")
    dense = per_arm.get("dense", {}).get("interference", {})
    others = [arm for arm in arms if arm != "dense" and set(per_arm[arm]["interference"]) & set(dense)]
    diffs = [
        summarize([mine[s] - dense[s] for s in sorted(set(mine) & set(dense))])
        for mine in (per_arm[arm]["interference"] for arm in others)
    ]
    seed_errorbar(ax_diff, range(len(others)), diffs, linestyle="none", color="tab:red")
    for ax, names, title, ylabel in (
        (
            ax_arm,
            arms,
            f"interference per arm ({spread_note(s.n for s in stats)})",
            "base-language val loss change, switch to end\n(< 0: improved)",
        ),
        (
            ax_diff,
            others,
            f"minus dense, paired by seed ({spread_note(s.n for s in diffs)})",
            "interference minus dense's\n(> 0: more interference than dense)",
        ),
    ):
        zero_line(ax)
        ax.set_xticks(range(len(names)), names)
        ax.set_xlim(-0.6, max(1, len(names)) - 0.4)
        ax.set(ylabel=ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    return fig


__all__ = ["LanguageExpansionSpec", "analyse", "expand", "interference_figure", "measure_routing", "parse"]
