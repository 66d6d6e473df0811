"""The expert-upcycling compute study: is growing E -> mE experts mid-run cheaper than training mE?

Arms, all with the same total step budget T, the same data stream, seed and LR schedule:

* ``fixed_E``: E experts for T steps;
* ``fixed_mE``: m*E experts from scratch for T steps;
* ``up_<selection>_<optimizer_state>``: E experts until step tau, then :class:`ExpertUpcycling`
  grows them to m*E (uniform or utility selection; AdamW moments copied or reset) for the rest.

The upcycled arms share their first steps with ``fixed_E``: they resume from its checkpoint at
step ``tau - utility_batches`` (so the utility window is trained in the arm itself), which saves
recomputing the common prefix. For each arm the study records the validation loss every
``val_every`` steps and the median wall time of its training steps. The step times that enter the
compute estimate, s_E and s_mE, are measured once more at the end by alternating training steps
of the E and the mE model in one process (``interleaved_step_times``): arms trained minutes apart
on a machine shared with other jobs do not see the same load.

Results (``results/upcycling/``): ``runs/<arm>.json`` (resumable: a finished arm is not run again),
``step_times.json``, ``results.json``, ``summary.md`` and ``val_loss.png`` (validation loss
against training FLOPs and against measured compute). Then:

* compute ``C_fixed = T * s_mE`` and ``C_up = tau * s_E + (T - tau) * s_mE``, saving ``1 - C_up/C_fixed``;
* gap closure ``eta = (L_fixedE - L_up) / (L_fixedE - L_fixedmE)`` on the final validation loss;
* the loss jump at the expansion: validation loss of the model right before and right after the
  swap (same weights, no step in between: depends on the selection only), and the change over the
  first ``val_every`` steps after it (where the optimizer-state choice shows).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from moe_lit.accounting import markdown_table, training_flops_per_token
from moe_lit.config import ConfigError, ModelConfig, MoEConfig
from moe_lit.errors import MoeLitError
from moe_lit.convert.expand import SELECTIONS
from moe_lit.io import atomic_write_json, atomic_write_text
from moe_lit.lit.optim import OptimConfig

OPTIMIZER_STATES = ("copy", "reset")
FIXED_E, FIXED_ME = "fixed_E", "fixed_mE"
FORK_CKPT = "fork.ckpt"
Log = Callable[[str], None]


def _default_model() -> ModelConfig:
    return ModelConfig(
        vocab_size=8192, d_model=128, n_layers=2, n_heads=4, seq_len=64, d_ff=512,
        moe=MoEConfig(num_experts=4, expert_size=128, top_k=2, balancing="bias"),
    )


@dataclass
class UpcyclingStudySpec:
    """The upcycling study: the E-expert model, the growth, the training budget."""

    name: str = "upcycling"
    """Results go to results/<name>/ unless --out says otherwise."""
    data_dir: Optional[str] = None
    """Prepared data directory (moe-lit data prepare); null = $MOE_LIT_DATA or data_cache/default."""
    model: ModelConfig = field(default_factory=_default_model)
    """The E-expert MoE (vocab_size is taken from the data; seq_len is the training length)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3, warmup_steps=30))
    """AdamW and LR schedule of every arm (the schedule spans total_steps)."""
    factor: int = 2
    """m: the grown model has m*E experts (top-k unchanged)."""
    total_steps: int = 400
    """T: optimizer steps of every arm."""
    expand_at: int = 200
    """tau: the optimizer step after which the upcycled arms grow (a multiple of val_every)."""
    selections: list[str] = field(default_factory=lambda: list(SELECTIONS))
    """Copy selections to compare: uniform | utility."""
    optimizer_states: list[str] = field(default_factory=lambda: list(OPTIMIZER_STATES))
    """Optimizer-state choices at the expansion to compare: copy | reset."""
    utility_batches: int = 10
    """Steps before tau whose gradients make the expert utility."""
    batch_size: int = 16
    """Sequences per step."""
    val_every: int = 40
    """Validate every this many steps."""
    val_batches: int = 2
    """Validation batches per language."""
    languages: Optional[list[str]] = None
    """Languages to train and validate on (default: all prepared ones)."""
    timing_rounds: int = 20
    """Rounds of interleaved E / mE training steps that measure s_E and s_mE for the compute estimate."""
    seed: int = 0
    """Seed of the model initialisation and of the data stream."""
    accelerator: str = "auto"
    """Lightning accelerator (auto | cpu | gpu)."""

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            self.model = ModelConfig.from_dict(self.model)
        if isinstance(self.optim, dict):
            self.optim = OptimConfig(**self.optim)
        if self.model.moe is None:
            raise ConfigError("upcycling.model.moe: the study grows an MoE; set model.moe")
        positive = (
            "factor", "total_steps", "expand_at", "utility_batches", "batch_size", "val_every", "val_batches",
            "timing_rounds",
        )
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ConfigError(f"upcycling.{name}: must be a positive integer, got {value!r}")
        if self.factor < 2:
            raise ConfigError(f"upcycling.factor: must be >= 2, got {self.factor}")
        if not self.utility_batches < self.expand_at < self.total_steps:
            raise ConfigError(
                f"upcycling.expand_at: must lie between utility_batches={self.utility_batches} and "
                f"total_steps={self.total_steps} (exclusive), got {self.expand_at}"
            )
        if self.expand_at % self.val_every:
            raise ConfigError(f"upcycling.expand_at: must be a multiple of val_every={self.val_every}")
        for name, allowed in (("selections", SELECTIONS), ("optimizer_states", OPTIMIZER_STATES)):
            values = getattr(self, name)
            if not values or any(v not in allowed for v in values):
                raise ConfigError(f"upcycling.{name}: got {values!r}, allowed values: {', '.join(allowed)}")

    @classmethod
    def from_yaml(cls, path: Path) -> "UpcyclingStudySpec":
        data = yaml.safe_load(Path(path).read_text()) or {}
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known)) if isinstance(data, dict) else None
        if unknown is None or unknown:
            raise ConfigError(f"upcycling: unknown key(s) {unknown}, allowed keys: {known}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def fork_step(self) -> int:
        return self.expand_at - self.utility_batches

    def arms(self) -> list[str]:
        # NOTE: the optimizer-state choice is the outer loop: on a slow machine the selections
        # with copied moments (the recipe) finish first.
        upcycled = [f"up_{s}_{o}" for o in self.optimizer_states for s in self.selections]
        return [FIXED_E, FIXED_ME, *upcycled]


# ----------------------------------------------------------------------------- training
def _callbacks():
    """Lightning callbacks of the study (imported with Lightning only when a run starts)."""
    import lightning.pytorch as pl
    import torch
    from typing_extensions import override

    from moe_lit.convert.common import next_token_loss

    class Recorder(pl.Callback):
        """Validation loss per step and wall time per training step (swap excluded)."""

        def __init__(self) -> None:
            self.curve: list[dict[str, float]] = []
            self.step_seconds: list[float] = []
            self._start = 0.0

        @override
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._start = time.perf_counter()

        @override
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.step_seconds.append(time.perf_counter() - self._start)

        @override
        def on_validation_end(self, trainer, pl_module) -> None:
            if not trainer.sanity_checking and "val/loss" in trainer.callback_metrics:
                self.curve.append({"step": trainer.global_step, "val_loss": float(trainer.callback_metrics["val/loss"])})

    class SaveAt(pl.Callback):
        """Save a checkpoint after ``step`` optimizer steps."""

        def __init__(self, step: int, path: Path) -> None:
            self.step, self.path = step, path

        @override
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == self.step:
                trainer.save_checkpoint(self.path)

    class ValProbe(pl.Callback):
        """Validation loss of the current network at the start of step ``step`` (put around the swap)."""

        def __init__(self, step: int, into: dict, key: str) -> None:
            self.step, self.into, self.key = step, into, key

        @override
        @torch.no_grad()
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step != self.step or self.key in self.into:
                return
            model = pl_module.model
            model.eval()
            total = tokens = 0.0
            for loader in trainer.datamodule.val_dataloader():
                for batch_BL1 in loader:
                    n = batch_BL1[:, 1:].numel()
                    total += next_token_loss(model, batch_BL1.to(pl_module.device)).item() * n
                    tokens += n
            model.train()
            self.into[self.key] = total / tokens

    return Recorder, SaveAt, ValProbe


def _arm_config(spec: UpcyclingStudySpec, arm: str, vocab_size: int) -> ModelConfig:
    cfg = spec.model.replace(vocab_size=vocab_size)
    if arm == FIXED_ME:
        moe = cfg.moe
        sizes = list(moe.expert_sizes) * spec.factor
        return cfg.replace(moe={"num_experts": moe.num_experts * spec.factor,
                                "expert_size": sizes[0] if moe.uniform else sizes})
    return cfg


def run_arm(spec: UpcyclingStudySpec, arm: str, data_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Train one arm; returns its record (curve, step times, expansion events)."""
    import lightning.pytorch as pl

    from moe_lit.callbacks.expert_upcycling import ExpertUpcycling
    from moe_lit.lit.datamodule import MoEDataModule
    from moe_lit.lit.module import MoELitModule

    Recorder, SaveAt, ValProbe = _callbacks()
    pl.seed_everything(spec.seed, verbose=False)
    data = MoEDataModule(
        str(data_dir), seq_len=spec.model.seq_len, batch_size=spec.batch_size, languages=spec.languages,
        val_batches=spec.val_batches, seed=spec.seed,
    )
    module = MoELitModule(_arm_config(spec, arm, data.vocab_size), spec.optim)
    recorder, probes, ckpt_path, grow = Recorder(), {}, None, None
    callbacks: list[pl.Callback] = []
    fork = out_dir / FIXED_E / FORK_CKPT
    if arm == FIXED_E:
        fork.parent.mkdir(parents=True, exist_ok=True)
        callbacks.append(SaveAt(spec.fork_step, fork))
    elif arm != FIXED_ME:
        _, selection, optimizer_state = arm.split("_", 2)
        grow = ExpertUpcycling(
            at_steps=[spec.expand_at], factor=spec.factor, selection=selection, optimizer_state=optimizer_state,
            utility_batches=spec.utility_batches, seed=spec.seed,
        )
        callbacks += [ValProbe(spec.expand_at, probes, "before"), grow, ValProbe(spec.expand_at, probes, "after")]
        ckpt_path = fork
    trainer = pl.Trainer(
        max_steps=spec.total_steps, accelerator=spec.accelerator, devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        val_check_interval=spec.val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        callbacks=[*callbacks, recorder],
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    tokens_per_step = spec.batch_size * spec.model.seq_len
    return {
        "arm": arm,
        "num_experts_final": module.model.config.moe.num_experts,
        "flops_per_step": {
            "E": training_flops_per_token(_arm_config(spec, FIXED_E, data.vocab_size)) * tokens_per_step,
            "mE": training_flops_per_token(_arm_config(spec, FIXED_ME, data.vocab_size)) * tokens_per_step,
        },
        "curve": recorder.curve,
        "step_seconds_median": statistics.median(recorder.step_seconds[5:] or recorder.step_seconds),
        "steps_trained": len(recorder.step_seconds),
        "wall_s": time.perf_counter() - start,
        "events": [{k: v for k, v in e.items() if k != "row_sources"} for e in (grow.events if grow else [])],
        "val_probe": probes,
    }


def interleaved_step_times(spec: UpcyclingStudySpec, vocab_size: int) -> dict[str, float]:
    """Median seconds of one training step (forward, backward, AdamW) of the E and the mE model.

    NOTE: the steps of the two models alternate in one process on the same batch, so a machine
    shared with other jobs slows both alike; the in-run medians of the arms, measured minutes
    apart, are kept in the records but are not comparable on a shared machine.
    """
    import torch

    from moe_lit.convert.common import next_token_loss
    from moe_lit.model import Transformer

    use_cuda = spec.accelerator in ("auto", "gpu") and torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    torch.manual_seed(spec.seed)
    setups = {}
    for key, arm in (("E", FIXED_E), ("mE", FIXED_ME)):
        model = Transformer(_arm_config(spec, arm, vocab_size)).to(device).train()
        setups[key] = (model, torch.optim.AdamW(model.parameters(), lr=spec.optim.lr))
    batch_BL1 = torch.randint(0, vocab_size, (spec.batch_size, spec.model.seq_len + 1), device=device)
    seconds: dict[str, list[float]] = {key: [] for key in setups}
    warmup = 2
    for round_index in range(warmup + spec.timing_rounds):
        for key, (model, optimizer) in setups.items():
            if use_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            next_token_loss(model, batch_BL1).backward()
            optimizer.step()
            optimizer.zero_grad()
            model.update_router_biases()
            if use_cuda:
                torch.cuda.synchronize()
            if round_index >= warmup:
                seconds[key].append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in seconds.items()}


# ----------------------------------------------------------------------------- analysis
def analyse(spec: UpcyclingStudySpec, records: dict[str, dict[str, Any]], step_times: dict[str, float]) -> dict[str, Any]:
    """Compute, savings, gap closure and jumps from the arm records and the step times s_E, s_mE."""
    tau, total = spec.expand_at, spec.total_steps
    s_e, s_me = step_times["E"], step_times["mE"]
    final = {arm: rec["curve"][-1]["val_loss"] for arm, rec in records.items() if rec["curve"]}
    c_fixed, c_up = total * s_me, tau * s_e + (total - tau) * s_me
    gap = final[FIXED_E] - final[FIXED_ME]
    rows = []
    for arm in spec.arms():
        if arm not in records:
            continue
        rec, upcycled = records[arm], arm not in (FIXED_E, FIXED_ME)
        compute = c_up if upcycled else total * (s_e if arm == FIXED_E else s_me)
        row = {
            "arm": arm,
            "experts": rec["num_experts_final"],
            "final val loss": final.get(arm, float("nan")),
            "compute (s)": compute,
            "saving vs fixed_mE %": 100 * (1 - compute / c_fixed),
            "gap closure eta": (final[FIXED_E] - final[arm]) / gap if upcycled and gap else float("nan"),
        }
        rows.append(row)
    return {
        "s_E": s_e, "s_mE": s_me, "C_fixed": c_fixed, "C_up": c_up, "saving_pct": 100 * (1 - c_up / c_fixed),
        "gap_fixedE_minus_fixedmE": gap, "rows": rows, "jumps": _jumps(spec, records),
    }


def _val_at(record: dict[str, Any], step: int) -> float:
    return next((p["val_loss"] for p in record["curve"] if p["step"] == step), float("nan"))


def _jumps(spec: UpcyclingStudySpec, records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    tau, after = spec.expand_at, spec.expand_at + spec.val_every
    reference = _val_at(records[FIXED_E], after) - _val_at(records[FIXED_E], tau)
    rows = []
    for arm, rec in records.items():
        if not rec["events"]:
            continue
        event, probe = rec["events"][0], rec["val_probe"]
        rows.append({
            "arm": arm,
            "copies per source (block 0)": ",".join(map(str, next(iter(event.get("copies", {}).values()), []))),
            "batch loss before": event["loss_before"],
            "batch loss after": event["loss_after"],
            "val before": probe.get("before", float("nan")),
            "val after": probe.get("after", float("nan")),
            "val jump": probe.get("after", float("nan")) - probe.get("before", float("nan")),
            f"val change over next {spec.val_every} steps": _val_at(rec, after) - _val_at(rec, tau),
            "same for fixed_E": reference,
        })
    return rows


def _curve_xy(spec: UpcyclingStudySpec, arm: str, records, analysis) -> tuple[list, list, list]:
    """(FLOPs, seconds, val loss) of an arm; the upcycled arms share fixed_E's points up to tau."""
    rec = records[arm]
    f_e, f_me = rec["flops_per_step"]["E"], rec["flops_per_step"]["mE"]
    s_e, s_me, tau = analysis["s_E"], analysis["s_mE"], spec.expand_at
    points = rec["curve"]
    if arm not in (FIXED_E, FIXED_ME):
        points = [p for p in records[FIXED_E]["curve"] if p["step"] <= tau] + [p for p in points if p["step"] > tau]
    flops, seconds, losses = [], [], []
    for p in points:
        step = p["step"]
        if arm == FIXED_E:
            f, s = step * f_e, step * s_e
        elif arm == FIXED_ME:
            f, s = step * f_me, step * s_me
        else:
            f = min(step, tau) * f_e + max(0, step - tau) * f_me
            s = min(step, tau) * s_e + max(0, step - tau) * s_me
        flops.append(f)
        seconds.append(s)
        losses.append(p["val_loss"])
    return flops, seconds, losses


def plot(spec: UpcyclingStudySpec, records, analysis, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_f, ax_s) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for arm in spec.arms():
        if arm not in records:
            continue
        flops, seconds, losses = _curve_xy(spec, arm, records, analysis)
        style = "-" if arm.startswith("fixed") else "--"
        ax_f.plot(flops, losses, style, marker=".", label=arm)
        ax_s.plot(seconds, losses, style, marker=".", label=arm)
    for ax, xlabel in ((ax_f, "training FLOPs (analytic)"), (ax_s, "compute (s): steps x measured step time s_E or s_mE")):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    ax_f.set_ylabel("validation loss")
    ax_s.legend(fontsize=8)
    fig.suptitle(f"expert upcycling: E={spec.model.moe.num_experts} -> {spec.factor * spec.model.moe.num_experts} "
                 f"at step {spec.expand_at} of {spec.total_steps}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def summary_markdown(spec: UpcyclingStudySpec, analysis: dict[str, Any], command: str) -> str:
    moe = spec.model.moe
    lines = [
        f"# Expert upcycling study (`{command}`)",
        "",
        f"E={moe.num_experts} -> mE={spec.factor * moe.num_experts} experts (top-{moe.top_k}), "
        f"T={spec.total_steps} steps of {spec.batch_size}x{spec.model.seq_len} tokens, tau={spec.expand_at}.",
        f"Step time (median of {spec.timing_rounds} interleaved E/mE training steps in one process) "
        f"s_E={analysis['s_E']:.4f} s, s_mE={analysis['s_mE']:.4f} s; "
        f"C_fixed=T*s_mE={analysis['C_fixed']:.1f} s, C_up=tau*s_E+(T-tau)*s_mE={analysis['C_up']:.1f} s "
        f"(saving {analysis['saving_pct']:.1f}%). L_fixedE - L_fixedmE = {analysis['gap_fixedE_minus_fixedmE']:.4f}.",
        "",
        markdown_table(analysis["rows"]),
        "",
        "Loss at the expansion (val: the whole validation set, same weights just before/after the swap):",
        "",
        markdown_table(analysis["jumps"]),
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver
def run_study(
    spec: UpcyclingStudySpec, out_dir: Path, data_dir: Optional[Path] = None, command: str = "", log: Log = print
) -> dict[str, Path]:
    """Run every unfinished arm (fixed_E first: the others fork from it), then write the report."""
    data_dir = _data_dir(spec, data_dir)
    runs = out_dir / "runs"
    for arm in spec.arms():
        path = runs / f"{arm}.json"
        if path.is_file():
            log(f"{arm}: done before, skipped")
            continue
        if arm not in (FIXED_E, FIXED_ME) and not (runs / FIXED_E / FORK_CKPT).is_file():
            raise ConfigError(f"upcycling: {runs / FIXED_E / FORK_CKPT} is missing; delete {runs / (FIXED_E + '.json')} to rerun fixed_E")
        log(f"{arm}: training ...")
        record = run_arm(spec, arm, data_dir, runs)
        atomic_write_json(path, record)
        log(f"{arm}: final val loss {record['curve'][-1]['val_loss']:.4f}, {record['wall_s']:.0f} s")
    # NOTE: every arm is finished; the fork checkpoint (weights + AdamW state) is not a result.
    (runs / FIXED_E / FORK_CKPT).unlink(missing_ok=True)
    if (runs / FIXED_E).is_dir() and not any((runs / FIXED_E).iterdir()):
        (runs / FIXED_E).rmdir()
    return write_report(spec, out_dir, data_dir, command, log)


def _data_dir(spec: UpcyclingStudySpec, data_dir: Optional[Path]) -> Path:
    from moe_lit.data.layout import default_data_dir

    return Path(data_dir or spec.data_dir or default_data_dir())


def write_report(
    spec: UpcyclingStudySpec, out_dir: Path, data_dir: Optional[Path] = None, command: str = "", log: Log = print
) -> dict[str, Path]:
    """Report the finished arms (fixed_E and fixed_mE needed); measures the step times once."""
    records = {p.stem: json.loads(p.read_text()) for p in sorted((out_dir / "runs").glob("*.json"))}
    missing = [arm for arm in (FIXED_E, FIXED_ME) if arm not in records]
    if missing:
        raise MoeLitError(f"study upcycling: arm(s) {missing} not finished under {out_dir / 'runs'}; run the study")
    times_path = out_dir / "step_times.json"
    if times_path.is_file():
        step_times = json.loads(times_path.read_text())
    else:
        from moe_lit.lit.datamodule import MoEDataModule

        log("measuring step times (interleaved E / mE steps) ...")
        data = MoEDataModule(str(_data_dir(spec, data_dir)), seq_len=spec.model.seq_len, languages=spec.languages)
        step_times = interleaved_step_times(spec, data.vocab_size)
        atomic_write_json(times_path, step_times)
    analysis = analyse(spec, records, step_times)
    results = atomic_write_json(out_dir / "results.json", {"spec": spec.to_dict(), "analysis": analysis, "arms": records})
    summary = atomic_write_text(out_dir / "summary.md", summary_markdown(spec, analysis, command))
    return {"results": results, "summary": summary, "plot": plot(spec, records, analysis, out_dir / "val_loss.png")}


__all__ = ["UpcyclingStudySpec", "analyse", "interleaved_step_times", "run_arm", "run_study", "write_report"]
