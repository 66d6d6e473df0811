"""Study kind ``upcycling``: is growing E -> mE experts mid-run cheaper than training mE experts?

Per seed, one step budget T, data stream and LR schedule: ``fixed_E`` (E experts; keeps a
checkpoint at ``tau - utility_batches``), ``fixed_mE`` (m*E experts from scratch; measures the step
times s_E, s_mE interleaved in one process, :mod:`moe_lit.timing`), and per arm ``up_<arm>``: a
child resuming fixed_E's checkpoint (the prefix is never retrained) that grows at step tau
(:class:`~moe_lit.callbacks.expert_upcycling.ExpertUpcycling`: selection, AdamW moments copied or
reset, router-row noise or drop-upcycling of the copies), with validation probes around the swap
and the copies' cosine to their sources after it (:class:`~moe_lit.callbacks.study.CopySeparation`).
Claims, paired by seed: m*E beats E at the same steps (the gap to close); each arm beats fixed_E
and, given ``margin``, matches fixed_mE; a utility arm closes more of the gap
``eta = (L_E - L_up) / (L_E - L_mE)`` than its uniform twin (paper: more than 3x; tested only where
the twin's eta is shown above 0); the compute
saving is the GPU's (untestable on a CPU). Findings: eta and the compute, measured and from a cost
model with a stated ``r = s_mE / s_E`` (``saving = tau/T (1 - 1/r)``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lit.callbacks.expert_upcycling import ExpertUpcycling
from moe_lit.callbacks.study import CopySeparation, ValidationProbe
from moe_lit.config import ConfigError, ModelConfig
from moe_lit.convert.expand import MAX_COPIES, SELECTIONS, ExpansionConfig
from moe_lit.plotting import seed_band, seed_errorbar, spread_note, zero_line
from moe_lit.stats import (
    ALPHA,
    POWER,
    Difference,
    format_difference,
    format_estimate,
    format_p,
    format_values,
    paired_difference,
    seeds_needed,
    summarize,
)
from moe_lit.studies import plots
from moe_lit.studies import spec as check
from moe_lit.studies.identity import Call, Point, stable_dict
from moe_lit.studies.kinds import Analysis
from moe_lit.studies.measures import step_times
from moe_lit.studies.records import by_seed, group, minus, paired
from moe_lit.studies.verdicts import EQUIVALENT, HIGHER, LOWER, SCRATCH, Claim, Subject, about

FIXED_E, FIXED_ME = "fixed_E", "fixed_mE"
LOSS = "final val loss"
OPTIMIZER_STATES = ("copy", "reset")
GAP_ALPHA = 0.01
"""eta is computed only where the gap L_fixedE - L_fixedmE is shown at this p (it divides by the gap)."""
GPU_SAVING = "the saving comes from the GPU step-time ratio r = s_mE / s_E (paper: about 1.9); here r = {r:.2f}"


@dataclass
class ArmSpec:
    """One way to grow: an upcycled arm."""

    name: str
    """Label of the arm (the point is up_<name>)."""
    selection: str = "uniform"
    """uniform | utility (see moe_lit.convert.expand)."""
    optimizer_state: str = "copy"
    """copy (copies inherit their source's AdamW moments) | reset."""
    noise: float = 1e-3
    """U(-noise, noise) on the copies' selection bias."""
    router_noise: float = 0.0
    """Relative Gaussian noise on the copies' router rows (symmetry breaking)."""
    drop_fraction: float = 0.0
    """Fraction of each copy's neurons re-initialised (drop-upcycling the copies)."""
    max_copies: int | None = None
    """Utility selection: at most this many copies of one expert; null: moe_lit.convert.expand.MAX_COPIES."""

    def __post_init__(self) -> None:
        check.label(self.name, "name")
        check.choice(self.selection, "selection", SELECTIONS)
        check.choice(self.optimizer_state, "optimizer_state", OPTIMIZER_STATES)
        check.positive_int(self.max_copies, "max_copies", optional=True)


@dataclass
class UpcyclingSpec:
    """The kind's own fields."""

    model: ModelConfig
    """The E-expert MoE (balancing: bias, as after the expansion; seq_len from run.data.seq_len)."""
    expand_at: int
    """tau: the optimizer step at which the upcycled arms grow (a multiple of run.train.val_every)."""
    arms: list[ArmSpec]
    """The upcycled arms."""
    factor: int = 2
    """m: the grown model has m*E experts (top-k unchanged)."""
    utility_batches: int = 10
    """Steps before tau whose gradients make the expert utility (the arms fork there)."""
    separation_every: int = 25
    """Steps between measurements of the copies' cosine similarity to their sources."""
    timing_rounds: int = 20
    """Rounds of interleaved E / mE training steps that measure s_E and s_mE."""
    cost_ratios: list[float] = field(default_factory=lambda: [1.9])
    """Stated step-time ratios r = s_mE / s_E for the cost model (the paper's GPU ratio is about 1.9)."""
    margin: float | None = None
    """Largest |L_up - L_fixedmE| (val loss) that counts as an upcycled arm matching fixed_mE, stated
    before the study runs (analysis only); null: that claim is untestable."""
    rewarm: bool = False
    """Every arm's LR schedule starts again at tau (``optim.rewarm_at``): the E model's schedule has
    decayed by then and the continued pretraining gets a warmup and decay of its own."""

    def __post_init__(self) -> None:
        if self.model.moe is None or self.model.moe.balancing != "bias":
            raise ConfigError("model.moe: the study grows an MoE with balancing: bias (the expanded model's balancing)")
        check.integer(self.factor, "factor", 2)
        check.distinct([a.name for a in self.arms], "arms", what="arm names")
        check.numbers(self.cost_ratios, "cost_ratios", 0)
        check.number(self.margin, "margin", 0, optional=True)
        check.boolean(self.rewarm, "rewarm")
        for arm in (a for a in self.arms if a.selection == "utility"):
            # NOTE: with at most m-1 copies an expert, m-1 copies of every expert is the only allocation.
            cap = arm.max_copies or MAX_COPIES
            why = f"must be >= factor={self.factor} for utility selection to copy unevenly, got {cap}"
            check.require(cap >= self.factor, f"arms[{arm.name}].max_copies", why)

    @property
    def fork_step(self) -> int:
        """The step the arms resume fixed_E at (the utility window is trained in the arm itself)."""
        return self.expand_at - self.utility_batches

    def grown_model(self) -> ModelConfig:
        moe = self.model.moe
        sizes = list(moe.expert_sizes) * self.factor
        return self.model.replace(
            moe={"num_experts": moe.num_experts * self.factor, "expert_size": sizes[0] if moe.uniform else sizes}
        )


DEFAULT_RUN = {"data": {"seq_len": 64, "batch_size": 16, "val_batches": 2}, "train": {"max_steps": 1500}}
PAPER, HERE = (
    Subject(SCRATCH, "the paper's MoE LMs grown mid-training at its scale"),
    "scale and budget in the description above",
)
"""What the paper tested its claims on, and the study's scale (its object: :func:`analyse`)."""
_parse = check.parser(UpcyclingSpec, ("model", "expand_at", "arms"))


def parse(fields: dict[str, Any], header) -> UpcyclingSpec:
    spec, run, tau = _parse(fields, header), header.run, fields["expand_at"]
    why = f"must be in (utility_batches={spec.utility_batches}, {run.steps} steps), got {tau}"
    check.require(spec.utility_batches < tau < run.steps, "expand_at", why)
    why = f"must be a multiple of run.train.val_every={run.eval_every}, got {tau}"
    check.require(tau % run.eval_every == 0, "expand_at", why)
    return spec


def _grow(spec: UpcyclingSpec, arm: ArmSpec, seed: int) -> tuple[Call, ...]:
    expansion = ExpansionConfig(
        factor=spec.factor,
        selection=arm.selection,
        max_copies=arm.max_copies or MAX_COPIES,
        noise=arm.noise,
        seed=seed,
        router_noise=arm.router_noise,
        drop_fraction=arm.drop_fraction,
    )
    grow = {"at_steps": [spec.expand_at], "expansion": stable_dict(expansion), "utility_batches": spec.utility_batches}
    return (
        Call.of(ValidationProbe, step=spec.expand_at, key="before"),
        Call.of(ExpertUpcycling, **grow, optimizer_state=arm.optimizer_state),
        Call.of(ValidationProbe, step=spec.expand_at, key="after"),
        Call.of(CopySeparation, every=spec.separation_every),
    )


def expand(spec: UpcyclingSpec, header) -> list[Point]:
    points = []
    # NOTE: the source model as a stable dict (defaults left out), as a point's own model is hashed.
    timing = Call.of(measure_step_times, source=stable_dict(spec.model), rounds=spec.timing_rounds)
    grown = spec.grown_model()
    for seed in header.seeds:
        run, start = _run_of(spec, header, seed), header.start(FIXED_E, seed, "resume", spec.fork_step)
        info = {"expand_at": spec.expand_at, "total_steps": run.steps, "factor": spec.factor}
        points.append(header.point(FIXED_E, seed, spec.model, run, {"arm": FIXED_E, **info}))
        points.append(header.point(FIXED_ME, seed, grown, run, {"arm": FIXED_ME, **info}, measure=timing))
        for arm, name in ((arm, f"up_{arm.name}") for arm in spec.arms):
            arm_info, callbacks = {"arm": name, **info, **dataclasses.asdict(arm)}, _grow(spec, arm, seed)
            points.append(header.point(name, seed, spec.model, run, arm_info, start, None, callbacks))
    return points


def _run_of(spec: UpcyclingSpec, header, seed: int):
    """The seed's run; with ``rewarm`` its schedule starts again at tau (every arm the same)."""
    run = header.seeded_run(seed)
    return run.replace(optim={"rewarm_at": spec.expand_at}) if spec.rewarm else run


def measure_step_times(point: Point, result: Any, run_dir: Path, source: dict[str, Any], rounds: int) -> dict:
    """The step times of the source (E) and the grown (mE) model (:func:`moe_lit.studies.measures.step_times`)."""
    run = point.run
    return step_times(ModelConfig.from_dict(source), point.model, run.data.batch_size, run.optim.lr, point.seed, rounds)


# ----------------------------------------------------------------------------- analysis
Arms = dict[str, dict[int, dict[str, Any]]]
"""arm -> seed -> record."""


def _by_arm(records: list[dict[str, Any]]) -> Arms:
    return {arm: {r["seed"]: r for r in rs} for arm, rs in group(records, lambda r: r.get("arm")).items()}


def _eta(arms: Arms, arm: str) -> dict[int, float]:
    """seed -> gap closure (paired: the seed's own fixed_E and fixed_mE)."""
    e, me = arms.get(FIXED_E, {}), arms.get(FIXED_ME, {})
    return {
        s: (e[s]["val_loss"] - r["val_loss"]) / (e[s]["val_loss"] - me[s]["val_loss"])
        for s, r in arms.get(arm, {}).items()
        if s in e and s in me and e[s]["val_loss"] != me[s]["val_loss"]
    }


def _twins(specs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(utility arm, uniform arm) pairs that differ only in the selection: the utility claim's contrasts."""
    same = ("optimizer_state", "noise", "router_noise", "drop_fraction")
    utility, uniform = ([a for a in specs if a["selection"] == kind] for kind in ("utility", "uniform"))
    pairs = ((u, v) for u in utility for v in uniform if all(u[k] == v[k] for k in same))
    return [(f"up_{u['name']}", f"up_{v['name']}") for u, v in pairs]


def _eta_cell(arms: Arms, arm: str) -> str:
    """eta's mean over seeds with its 95% CI (a one-sample t over the per-seed values)."""
    values = list(_eta(arms, arm).values())
    return format_estimate(paired_difference(values, 0.0)).lstrip("+") + f" (n={len(values)})" if values else ""


def _copies(record: dict[str, Any]) -> str:
    """Copies per source expert of the first grown block, and how many blocks were allocated unevenly."""
    events = record.get("events") or []
    if not events or not events[0].get("copies"):
        return ""
    by_block = list(events[0]["copies"].values())
    uneven = sum(len(set(c)) > 1 for c in by_block)
    return f"{by_block[0]}; uneven in {uneven}/{len(by_block)} blocks"


def _arm_row(arms: Arms, arm: str, factor: int, eta_shown: bool) -> dict[str, Any]:
    runs = list(arms[arm].values())
    upcycled = arm.startswith("up_")
    versus = paired_difference(*paired(by_seed(runs, "val_loss"), by_seed(arms[FIXED_E].values(), "val_loss")))
    jump = [r["probe_after"] - r["probe_before"] for r in runs if r.get("probe_before") is not None]
    separation = [CopySeparation.last(r.get("copy_separation") or []) for r in runs] if upcycled else []
    return {
        "arm": arm,
        "experts": runs[0]["num_experts"] * (factor if upcycled else 1),
        "final val loss": format_values([r["val_loss"] for r in runs]),
        "eta [95% CI]": _eta_cell(arms, arm) if upcycled and eta_shown else "",
        "copies (seed 0)": _copies(arms[arm][min(arms[arm])]) if upcycled else "",
        "minus fixed_E (paired)": format_difference(versus) if arm != FIXED_E else "",
        "val jump at swap": format_values(jump),
        "copy cosine (last)": format_values([s[0] for s in separation]),
        "copies > 0.99": format_values([s[1] for s in separation], 2),
        "copy token share": format_values([s[2] for s in separation], 2),
    }


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    arms = _by_arm(records)
    if FIXED_E not in arms or FIXED_ME not in arms:
        return Analysis(findings=["(fixed_E and fixed_mE must finish first)"])
    some = next(iter(arms[FIXED_E].values()))
    tau, total = some["expand_at"], some["total_steps"]
    ups, margin = [a for a in arms if a.startswith("up_")], plan["spec"].get("margin")
    claims = [Claim("m*E experts beat E at the same steps (the gap to close)", LOSS, (FIXED_ME, FIXED_E), LOWER)]
    for arm in ups:
        claims.append(Claim(f"{arm}: growing at tau beats staying at E", LOSS, (arm, FIXED_E), LOWER))
        matches = f"{arm}: growing at tau matches m*E from scratch"
        claims.append(Claim(matches, LOSS, (arm, FIXED_ME), EQUIVALENT, margin))
    tested = [claim.on_records(records, "val_loss", by="arm") for claim in claims]
    times = [r["step_times"] for r in arms[FIXED_ME].values() if r.get("step_times")]
    ratio = summarize([t["mE"] for t in times]).mean / summarize([t["E"] for t in times]).mean if times else math.nan
    saving = Claim("upcycling saves compute at equal quality", "compute", ("up", FIXED_ME), LOWER)
    tested.append(saving.missing(GPU_SAVING.format(r=ratio)))
    gap = tested[0].difference
    eta_shown = gap is not None and gap.testable and gap.estimate < 0 and gap.p < GAP_ALPHA
    twins = _twins(plan["spec"].get("arms", []))
    tested[-1:-1] = [_utility_claim(arms, utility, uniform, eta_shown) for utility, uniform in twins]  # before compute
    findings = [f"- **{arm}**: gap closure eta = {_eta_cell(arms, arm)}." for arm in ups if eta_shown]
    if not eta_shown:
        p = format_p(gap.p) if gap is not None else "n/a"
        findings.append(f"- eta is not computed: the gap L_E - L_mE is not shown at p < {GAP_ALPHA} (p = {p}).")
    findings += _compute_findings(plan["spec"]["cost_ratios"], tau, total, times)
    table = {"Arms (mean ± std over seeds)": [_arm_row(arms, arm, some["factor"], eta_shown) for arm in arms]}
    plot = plots.save(curves_figure(arms, tau), plots_dir, "val_loss")
    tested = about(tested, PAPER, Subject(SCRATCH, HERE))
    return Analysis(claims=tested, findings=findings, tables=table, plots=[plot])


def _utility_claim(arms: Arms, utility: str, uniform: str, eta_shown: bool):
    """Utility selection "more than triples gap closure", judged by its registered design: eta_utility -
    eta_uniform, paired by seed (the paper's effect on eta: 2 x the uniform arm's).

    A rule added after the 8-seed result (a multiple of the uniform closure has a size only where that
    closure is shown above 0) is kept as a second analysis (``Evidence.also``), never the verdict.
    """
    util, uni = _eta(arms, utility), _eta(arms, uniform)
    text = f"{utility}: utility selection closes more of the gap than {uniform}"
    claim = Claim(text, "eta", (utility, uniform), HIGHER, paper=2 * sum(uni.values()) / len(uni) if uni else None)
    if not eta_shown:
        return claim.missing(f"eta needs the gap L_fixedE - L_fixedmE shown at p < {GAP_ALPHA}")
    tested = claim.on(util, uni)
    closure = paired_difference(list(uni.values()), 0.0)
    if closure.testable and closure.estimate > 0 and closure.p < ALPHA:
        return tested
    later = Claim(text, "eta, rule added after the 8-seed result", claim.arms, HIGHER)
    reason = _no_base_closure(uniform, closure, tested.difference, claim.paper)
    return dataclasses.replace(tested, also=later.missing(f"untestable here under it: {reason}"))


def _no_base_closure(uniform: str, closure: Difference, contrast: Difference | None, paper: float | None) -> str:
    """Why a "3x the uniform closure" claim has no size: the uniform eta, the contrast, the seeds it would need."""
    reason = f"3x of {uniform}'s eta has no size: that eta is {format_estimate(closure)} (p = {format_p(closure.p)})"
    if paper is None or paper <= 0 or contrast is None or not contrast.testable:
        return reason
    return (
        f"{reason}; the contrast measured {format_estimate(contrast)} (sd {contrast.sd:.4f}), and the paper's "
        f"effect on eta (2 x {uniform}'s, {paper:+.4f}) would need about {seeds_needed(contrast.sd, paper)} seeds "
        f"(power {POWER})"
    )


def _compute_findings(ratios: list[float], tau: int, total: int, times: list[dict[str, float]]) -> list[str]:
    lines = []
    if times:
        s_e, s_me = summarize([t["E"] for t in times]).mean, summarize([t["mE"] for t in times]).mean
        up = (tau * s_e + (total - tau) * s_me) / (total * s_me)
        lines.append(
            f"- **Compute, measured** (s_E={s_e:.4f} s, s_mE={s_me:.4f} s per step, r = {s_me / s_e:.2f}, "
            f"interleaved in one process): C_up/C_fixed = {up:.3f}, saving {100 * (1 - up):.1f}%."
        )
    model = ", ".join(f"r={r:g}: {100 * tau / total * (1 - 1 / r):.1f}%" for r in ratios)
    stated = f"r = s_mE/s_E stated, saving = tau/T (1 - 1/r), tau/T = {tau / total:.3f}"
    return [*lines, f"- **Compute, cost model** ({stated}): {model}."]


def _curves(arms: Arms, arm: str) -> dict[int, dict[int, float]]:
    """seed -> step -> val loss of one arm; an upcycled arm's curve before tau is its own seed's
    fixed_E (the prefix it resumed), and a seed whose fixed_E is missing is left out."""
    out = {}
    for seed, record in arms[arm].items():
        points = {}
        if arm.startswith("up_"):
            if seed not in arms.get(FIXED_E, {}):
                continue
            points = {p["step"]: p["val_loss"] for p in arms[FIXED_E][seed]["curve"] if p["step"] < record["expand_at"]}
        out[seed] = points | {p["step"]: p["val_loss"] for p in record["curve"]}
    return out


def curves_figure(arms: Arms, tau: int):
    """Validation curves (mean, ± std band over seeds) with the expansion step marked: the whole
    run, the region after tau, each arm minus fixed_E paired by seed after tau, and the mean cosine
    of the copies to their sources (± std over seeds; 1 = identical)."""
    fig, (ax_all, ax_after, ax_diff, ax_copy) = plots.panels(4, 5.0, 4.4)
    base, counts = _curves(arms, FIXED_E), []
    for i, arm in enumerate(arms):
        curves = _curves(arms, arm)
        if not curves:
            continue
        counts.append(len(curves))
        style = {"linestyle": "--" if arm.startswith("up_") else "-", "marker": ".", "color": f"C{i % 10}"}
        seed_band(ax_all, *plots.per_step(curves), alpha=0.2, label=f"{arm} (n={len(curves)})", **style)
        seed_band(ax_after, *plots.per_step(curves, tau), alpha=0.1, **style)
        diffs = {s: minus(c, base[s]) for s, c in curves.items() if s in base} if arm != FIXED_E else {}
        if diffs:
            seed_band(ax_diff, *plots.per_step(diffs, tau), **style)
        cosines = {
            s: CopySeparation.cosines(r["copy_separation"]) for s, r in arms[arm].items() if r.get("copy_separation")
        }
        if cosines:
            seed_errorbar(ax_copy, *plots.per_step(cosines), marker=".", capsize=2, color=style["color"])
    zero_line(ax_diff)
    for ax, title, ylabel in (
        (ax_all, f"validation loss ({spread_note(counts, 'band')})", "validation loss"),
        (ax_after, f"after the expansion (step >= {tau})", "validation loss"),
        (ax_diff, f"minus fixed_E, paired by seed (step >= {tau})", "val loss minus fixed_E (< 0: better)"),
        (ax_copy, "do the copies separate? (1 = identical)", "mean cosine(copy, source)"),
    ):
        ax.axvline(tau, color="grey", linestyle=":", label=f"expansion (tau = {tau})" if ax is ax_all else None)
        ax.set(xlabel="optimizer step", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
    ax_all.legend(fontsize=7)
    return fig


__all__ = ["UpcyclingSpec", "analyse", "curves_figure", "expand", "measure_step_times", "parse"]
