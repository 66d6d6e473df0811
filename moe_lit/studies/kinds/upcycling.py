"""Study kind ``upcycling``: is growing E -> mE experts mid-run cheaper than training mE experts?

Points per seed, all with the same step budget T, data stream and LR schedule:

* ``fixed_E``: the E-expert model for T steps; it keeps a checkpoint at ``tau - utility_batches``;
* ``fixed_mE``: m*E experts from scratch for T steps; it also measures the step times s_E, s_mE
  (interleaved in one process, :mod:`moe_lit.timing`: runs minutes apart on a shared machine do
  not see the same load);
* ``up_<arm>``: a child of ``fixed_E`` that resumes its checkpoint (the shared prefix is never
  retrained) and grows at step tau (:class:`~moe_lit.callbacks.expert_upcycling.ExpertUpcycling`:
  selection, AdamW moments copied or reset, symmetry breaking by router-row noise or by
  drop-upcycling the copies), with validation probes right before and after the swap and the
  copies' cosine similarity to their sources over the steps after it
  (:class:`~moe_lit.callbacks.study.CopySeparation`).

Findings: the gap closure ``eta = (L_E - L_up) / (L_E - L_mE)`` per seed (mean ± std), the
upcycled arm against fixed_E with the paired t-test over seeds (an arm forks from its own seed's
fixed_E), and the compute saving both ways: measured
(``C_up = tau s_E + (T - tau) s_mE`` vs ``C_fixed = T s_mE`` from the measured step times) and from
a cost model where ``r = s_mE / s_E`` is a stated parameter (``saving = tau/T (1 - 1/r)``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lit.config import ConfigError, ModelConfig
from moe_lit.plotting import pyplot, save_figure, seed_band, seed_errorbar, spread_note, zero_line
from moe_lit.studies.engine import Call, Point, Start, stable_dict
from moe_lit.studies.kinds import Analysis, check_fields
from moe_lit.studies.stats import Summary, compare_paired, format_comparison, format_summary, summarize

FIXED_E, FIXED_ME = "fixed_E", "fixed_mE"
OPTIMIZER_STATES = ("copy", "reset")


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

    def __post_init__(self) -> None:
        from moe_lit.convert.expand import SELECTIONS

        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ConfigError(f"arms.name: must be a non-empty string without '/', got {self.name!r}")
        if self.selection not in SELECTIONS:
            raise ConfigError(f"arms[{self.name}].selection: got {self.selection!r}, allowed: {SELECTIONS}")
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise ConfigError(
                f"arms[{self.name}].optimizer_state: got {self.optimizer_state!r}, allowed: {OPTIMIZER_STATES}"
            )


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


def default_run() -> dict[str, Any]:
    return {"data": {"seq_len": 64, "batch_size": 16, "val_batches": 2}, "train": {"max_steps": 1500}}


def parse(fields: dict[str, Any], header) -> UpcyclingSpec:
    check_fields(UpcyclingSpec, fields, ("model", "expand_at", "arms"))
    arms = fields["arms"]
    if not isinstance(arms, list) or not arms or not all(isinstance(a, dict) for a in arms):
        raise ConfigError(f"arms: must be a non-empty list of mappings, got {arms!r}")
    model = ModelConfig.from_dict(dict(fields["model"])).replace(seq_len=header.run.data.seq_len)
    spec = UpcyclingSpec(**{**fields, "model": model, "arms": [ArmSpec(**a) for a in arms]})
    _validate(spec, header)
    return spec


def _validate(spec: UpcyclingSpec, header) -> None:
    run = header.run
    if spec.model.moe is None or spec.model.moe.balancing != "bias":
        raise ConfigError("model.moe: the study grows an MoE with balancing: bias (the expanded model's balancing)")
    if not isinstance(spec.factor, int) or spec.factor < 2:
        raise ConfigError(f"factor: must be an integer >= 2, got {spec.factor!r}")
    if not spec.utility_batches < spec.expand_at < run.steps:
        raise ConfigError(
            f"expand_at: must lie between utility_batches={spec.utility_batches} and the run's {run.steps} steps "
            f"(exclusive), got {spec.expand_at}"
        )
    if spec.expand_at % run.eval_every:
        raise ConfigError(
            f"expand_at: must be a multiple of run.train.val_every={run.eval_every}, got {spec.expand_at}"
        )

    names = [a.name for a in spec.arms]
    if len(set(names)) != len(names):
        raise ConfigError(f"arms: names must be unique, got {names}")
    if not spec.cost_ratios or not all(isinstance(r, (int, float)) and r > 0 for r in spec.cost_ratios):
        raise ConfigError(f"cost_ratios: must be positive numbers, got {spec.cost_ratios!r}")


def _grow_callbacks(spec: UpcyclingSpec, arm: ArmSpec, seed: int) -> tuple[Call, ...]:
    probe = "moe_lit.callbacks.study:ValidationProbe"
    grow = {
        "at_steps": [spec.expand_at],
        "factor": spec.factor,
        "selection": arm.selection,
        "optimizer_state": arm.optimizer_state,
        "utility_batches": spec.utility_batches,
        "noise": arm.noise,
        "router_noise": arm.router_noise,
        "drop_fraction": arm.drop_fraction,
        "seed": seed,
    }
    return (
        Call(probe, {"step": spec.expand_at, "key": "before"}),
        Call("moe_lit.callbacks.expert_upcycling:ExpertUpcycling", grow),
        Call(probe, {"step": spec.expand_at, "key": "after"}),
        Call("moe_lit.callbacks.study:CopySeparation", {"every": spec.separation_every}),
    )


def expand(spec: UpcyclingSpec, header) -> list[Point]:
    points = []
    for seed in header.seeds:
        run = header.seeded_run(seed)
        parent = header.point_name(FIXED_E, seed)
        common = {"seed": seed, "run": run}
        info = {"expand_at": spec.expand_at, "total_steps": run.steps, "factor": spec.factor}
        timing = Call(
            "moe_lit.studies.kinds.upcycling:measure_step_times",
            {"source": stable_dict(spec.model), "rounds": spec.timing_rounds},  # defaults left out: a stable hash
        )
        points += [
            Point(name=parent, config_name=FIXED_E, model=spec.model, info={"arm": FIXED_E, **info}, **common),
            Point(
                name=header.point_name(FIXED_ME, seed),
                config_name=FIXED_ME,
                model=spec.grown_model(),
                info={"arm": FIXED_ME, **info},
                measure=timing,
                **common,
            ),
        ]
        for arm in spec.arms:
            name = f"up_{arm.name}"
            points.append(
                Point(
                    name=header.point_name(name, seed),
                    config_name=name,
                    model=spec.model,
                    info={"arm": name, **info, **dataclasses.asdict(arm)},
                    start=Start(parent=parent, step=spec.fork_step, mode="resume"),
                    callbacks=_grow_callbacks(spec, arm, seed),
                    **common,
                )
            )
    return points


def measure_step_times(point: Point, result: Any, run_dir: Path, source: dict[str, Any], rounds: int) -> dict:
    """Median seconds of one training step (forward, backward, AdamW, bias update) of the source
    (E) and the grown (mE) model, interleaved in this process on the same batch."""
    import torch

    from moe_lit.convert.common import next_token_loss
    from moe_lit.model import Transformer
    from moe_lit.timing import interleaved_times, median

    torch.manual_seed(point.seed)
    shape = (point.run.data.batch_size, point.run.data.seq_len + 1)
    batch_BL1 = torch.randint(0, point.model.vocab_size, shape)
    cases = {}
    for key, cfg in (("E", ModelConfig.from_dict(source)), ("mE", point.model)):
        model = Transformer(cfg).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=point.run.optim.lr)

        def step(model=model, optimizer=optimizer) -> None:
            next_token_loss(model, batch_BL1).backward()
            optimizer.step()
            optimizer.zero_grad()
            model.update_router_biases()

        cases[key] = step
    times = interleaved_times(cases, rounds=rounds, warmup=2)
    return {"step_times": {key: median(values) for key, values in times.items()}}


# ----------------------------------------------------------------------------- analysis
def _final(record: dict[str, Any]) -> float:
    return record["val_loss"]


def _by_arm(records: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """arm -> seed -> record (ok records only)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for record in records:
        if record["status"] == "ok":
            out.setdefault(record["arm"], {})[record["seed"]] = record
    return out


def _eta(arms, arm: str) -> list[float]:
    """Gap closure per seed (paired: the seed's own fixed_E and fixed_mE)."""
    values = []
    for seed, record in arms.get(arm, {}).items():
        e, me = arms.get(FIXED_E, {}).get(seed), arms.get(FIXED_ME, {}).get(seed)
        if e and me and _final(e) != _final(me):
            values.append((_final(e) - _final(record)) / (_final(e) - _final(me)))
    return values


def _step_times(arms) -> tuple[float, float] | None:
    times = [r["step_times"] for r in arms.get(FIXED_ME, {}).values() if r.get("step_times")]
    if not times:
        return None
    return summarize([t["E"] for t in times]).mean, summarize([t["mE"] for t in times]).mean


def _separation(record: dict[str, Any]) -> tuple[float, float]:
    """(mean cosine of the copies to their sources, fraction of copies still > 0.99) at the last measurement."""
    series = record.get("copy_separation") or []
    if not series:
        return float("nan"), float("nan")
    cosines = [c for layer in series[-1]["layers"].values() for c in layer["cosine"]]
    return sum(cosines) / len(cosines), sum(c > 0.99 for c in cosines) / len(cosines)


def _paired(arms, arm: str, other: str) -> tuple[list[float], list[float]]:
    """Final losses of ``arm`` and ``other`` for the seeds both finished, seed by seed."""
    seeds = sorted(set(arms.get(arm, {})) & set(arms.get(other, {})))
    return [_final(arms[arm][s]) for s in seeds], [_final(arms[other][s]) for s in seeds]


def _copy_token_share(record: dict[str, Any]) -> float:
    """Share of the last measured step's routed tokens that went to copies (0.5 = as many as the sources)."""
    series = record.get("copy_separation") or []
    if not series:
        return float("nan")
    shares = []
    for layer in series[-1]["layers"].values():
        tokens, copies = layer["tokens"], len(layer["cosine"])
        shares.append(sum(tokens[len(tokens) - copies :]) / max(1.0, sum(tokens)))
    return sum(shares) / len(shares)


def analyse(plan: dict[str, Any], records: list[dict[str, Any]], plots_dir: Path) -> Analysis:
    arms = _by_arm(records)
    if FIXED_E not in arms or FIXED_ME not in arms:
        return Analysis(findings=["(fixed_E and fixed_mE must finish first)"])
    some = next(iter(arms[FIXED_E].values()))
    tau, total = some["expand_at"], some["total_steps"]
    gap = compare_paired(*_paired(arms, FIXED_E, FIXED_ME))
    findings = [
        f"- **The gap to close**, L_fixedE - L_fixedmE (paired by seed): {format_comparison(gap)}; eta divides "
        "by this gap, so eta is only meaningful when the gap itself is significant."
    ]
    rows = []
    for arm, by_seed in arms.items():
        upcycled = arm.startswith("up_")
        losses = [_final(r) for r in by_seed.values()]
        eta = _eta(arms, arm) if upcycled else []
        runs = list(by_seed.values()) if upcycled else []
        jump = [r["probe_after"] - r["probe_before"] for r in runs if r.get("probe_before") is not None]
        versus = compare_paired(*_paired(arms, arm, FIXED_E)) if arm != FIXED_E else None
        rows.append(
            {
                "arm": arm,
                "experts": runs[0]["num_experts"] * some["factor"]
                if upcycled
                else by_seed[next(iter(by_seed))]["num_experts"],
                "final val loss": format_summary(summarize(losses)),
                "eta": format_summary(summarize(eta)) if eta else "",
                "minus fixed_E (paired)": format_comparison(versus) if versus else "",
                "val jump at swap": format_summary(summarize(jump)) if jump else "",
                "copy cosine (last)": format_summary(summarize([_separation(r)[0] for r in runs])) if runs else "",
                "copies > 0.99": format_summary(summarize([_separation(r)[1] for r in runs]), 2) if runs else "",
                "copy token share": format_summary(summarize([_copy_token_share(r) for r in runs]), 2) if runs else "",
            }
        )
        if eta:
            findings.append(_eta_finding(arm, eta, versus))
    findings += _compute_findings(plan, tau, total, _step_times(arms))
    figures = {"val_loss": curves_figure(arms, tau), "copy_separation": separation_figure(arms, tau)}
    plots = [save_figure(fig, Path(plots_dir) / f"{name}.png") for name, fig in figures.items() if fig is not None]
    return Analysis(findings=findings, tables={"Arms (mean ± std over seeds)": rows}, plots=plots)


def _eta_finding(arm: str, eta: list[float], versus) -> str:
    sign = "better than" if versus.diff < 0 else "worse than"
    return (
        f"- **{arm}**: gap closure eta = {format_summary(summarize(eta))}; final loss {sign} fixed_E "
        f"(paired by seed): {format_comparison(versus)}."
    )


def _compute_findings(plan, tau: int, total: int, times: tuple[float, float] | None) -> list[str]:
    lines = []
    if times:
        s_e, s_me = times
        c_fixed, c_up = total * s_me, tau * s_e + (total - tau) * s_me
        lines.append(
            f"- **Compute, measured** (s_E={s_e:.4f} s, s_mE={s_me:.4f} s per step, r = {s_me / s_e:.2f}, "
            f"interleaved in one process): C_up/C_fixed = {c_up / c_fixed:.3f}, "
            f"saving {100 * (1 - c_up / c_fixed):.1f}%."
        )
    ratios = plan["spec"]["cost_ratios"]
    lines.append(
        "- **Compute, cost model** (r = s_mE/s_E stated, saving = tau/T (1 - 1/r), tau/T = "
        f"{tau / total:.3f}): " + ", ".join(f"r={r:g}: {100 * tau / total * (1 - 1 / r):.1f}%" for r in ratios) + "."
    )
    return lines


def _curves(arms, arm: str) -> dict[int, dict[int, float]]:
    """seed -> step -> val loss of one arm; an upcycled arm's curve before tau is its own seed's
    fixed_E (the prefix it resumed), and a seed whose fixed_E is missing is left out."""
    out = {}
    for seed, record in arms[arm].items():
        points = {}
        if arm.startswith("up_"):
            parent = arms.get(FIXED_E, {}).get(seed)
            if parent is None:
                continue
            tau = record["expand_at"]
            points = {p["step"]: p["val_loss"] for p in parent["curve"] if p["step"] < tau}
        points.update({p["step"]: p["val_loss"] for p in record["curve"]})
        out[seed] = points
    return out


def _per_step(curves: dict[int, dict[int, float]], since: int = 0) -> tuple[list[int], list[Summary]]:
    """(steps >= since that every seed measured, the values over the seeds at each)."""
    steps = sorted(s for s in set.intersection(*(set(c) for c in curves.values())) if s >= since)
    return steps, [summarize([c[s] for c in curves.values()]) for s in steps]


def _minus_fixed_e(arms, arm: str) -> dict[int, dict[int, float]]:
    """seed -> step -> the arm's val loss minus its own seed's fixed_E at the same step."""
    mine, base = _curves(arms, arm), _curves(arms, FIXED_E)
    return {
        seed: {step: loss - base[seed][step] for step, loss in curve.items() if step in base[seed]}
        for seed, curve in mine.items()
        if seed in base
    }


def _colour(arms, arm: str) -> str:
    """One colour per arm across the kind's plots."""
    return f"C{list(arms).index(arm) % 10}"


def curves_figure(arms, tau: int):
    """Validation curves (mean, ± std band over seeds) with the expansion step marked: the whole
    run, the region after tau, and each arm minus fixed_E paired by seed after tau."""
    plt = pyplot()
    fig, (ax_all, ax_after, ax_diff) = plt.subplots(1, 3, figsize=(16, 4.4))
    counts = []
    for arm in arms:
        curves = _curves(arms, arm)
        if not curves:
            continue
        counts.append(len(curves))
        style = {"linestyle": "--" if arm.startswith("up_") else "-", "marker": ".", "color": _colour(arms, arm)}
        for ax, since, alpha in ((ax_all, 0, 0.2), (ax_after, tau, 0.1)):
            steps, stats = _per_step(curves, since)
            label = f"{arm} (n={len(curves)})" if ax is ax_all else None
            seed_band(ax, steps, stats, alpha=alpha, label=label, **style)
        paired = _minus_fixed_e(arms, arm) if arm != FIXED_E else {}
        if paired:
            seed_band(ax_diff, *_per_step(paired, tau), **style)
    zero_line(ax_diff)
    note = spread_note(counts, "band")
    for ax, title, ylabel in (
        (ax_all, f"validation loss ({note})", "validation loss"),
        (ax_after, f"after the expansion (step >= {tau})", "validation loss"),
        (ax_diff, f"minus fixed_E, paired by seed (step >= {tau})", "val loss minus fixed_E (< 0: better)"),
    ):
        ax.axvline(tau, color="grey", linestyle=":", label=f"expansion (tau = {tau})" if ax is ax_all else None)
        ax.set(xlabel="optimizer step", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
    ax_all.legend(fontsize=7)
    return fig


def separation_figure(arms, tau: int):
    """Mean cosine of the copies to their sources over the steps after tau (± std over seeds);
    None when no arm measured it."""
    series = {
        arm: [r.get("copy_separation") or [] for r in by_seed.values()]
        for arm, by_seed in arms.items()
        if arm.startswith("up_")
    }
    if not any(s for runs in series.values() for s in runs):
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    counts = []
    for arm, runs in series.items():
        by_step: dict[int, list[float]] = {}
        for run in runs:
            for entry in run:
                cosines = [c for layer in entry["layers"].values() for c in layer["cosine"]]
                by_step.setdefault(entry["step"], []).append(sum(cosines) / len(cosines))
        steps = sorted(by_step)
        stats = [summarize(by_step[s]) for s in steps]
        counts += [s.n for s in stats]
        seed_errorbar(ax, steps, stats, marker=".", capsize=2, label=arm, color=_colour(arms, arm))
    ax.set(
        xlabel="optimizer step",
        ylabel="mean cosine(copy, source)",
        title=f"do the copies separate? (expansion at {tau}; 1 = identical)\n({spread_note(counts)})",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


__all__ = [
    "ArmSpec",
    "UpcyclingSpec",
    "analyse",
    "curves_figure",
    "expand",
    "measure_step_times",
    "parse",
    "separation_figure",
]
