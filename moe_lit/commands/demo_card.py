"""The card's steps of ``moe-lit demo`` on its trained models, and the page they make.

Each step runs the command a user would (its ``configure`` and ``run``, :func:`run_command`) into
its own folder of ``--work-dir``, which the command writes atomically: with ``--resume`` a folder
that exists is a finished step and is not run again.

* ``eval/<name>/``: ``moe-lit eval --tasks moe_lit_suite --limit N --precision 32-true`` of the dense
  model, the MoE and the upcycled MoE (the local multilingual suite through lm-eval, N items per
  task; fp32, so that the scores do not follow a speed probe of the machine),
* ``analysis/<name>/``: ``moe-lit analyze routing`` of both MoEs (per-language expert usage),
* ``hf/<name>/`` and ``hf/<name>.json``: ``moe-lit export --format mixtral`` of the MoE with the lower
  validation loss, loaded back with ``AutoModelForCausalLM``: its logits against ours and one
  greedy line (:func:`check_transformers`).

:func:`write_results` writes ``--out`` in one atomic step: ``README.md`` (the page),
``results.json``, ``val_loss.png``, ``suite_scores.png``, ``routing_similarity.png``, the suite and
routing reports, and the models (``models/``, git-ignored).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from moe_lit.accounting import markdown_table
from moe_lit.checkpoint import export_model, load_model
from moe_lit.io import atomic_directory, atomic_write_json, atomic_write_text

if TYPE_CHECKING:
    from moe_lit.lit.run import RunResult

PAGE, RESULTS_JSON = "README.md", "results.json"
LOSS_PLOT, SCORES_PLOT, ROUTING_PLOT = "val_loss.png", "suite_scores.png", "routing_similarity.png"
MODELS_DIR = "models"
CARD_MODELS = ("dense", "moe", "upcycled")
"""The three models of the card (the first seed's)."""
MOES = ("moe", "upcycled")
PAGE_SUITE_COLUMNS = ("bits/byte", "next-paragraph acc", "minimal-pairs acc")
"""The columns of ``moe-lit eval``'s suite table that the page averages over languages."""
MODELS_SEEDED = ("dense", "moe")
"""The models trained for every seed of ``--seeds``."""
HF_FORMAT = "mixtral"
EVAL_BATCH = 32
"""Requests lm-eval scores per forward (``make eval``'s ``--batch-size``)."""
GENERATED_TOKENS = 24
"""Greedy tokens the transformers model generates after the prompt."""
PROMPT_WORDS = 8
"""The prompt: the first words of the first test paragraph of the first language."""


@dataclasses.dataclass
class CardSteps:
    """Where the card's steps wrote their outputs (folders of ``--work-dir``)."""

    evals: dict[str, Path]
    """Model name -> its ``moe-lit eval`` folder (results.json, results.md)."""
    analyses: dict[str, Path]
    """MoE name -> its ``moe-lit analyze routing`` folder (routing.json, summary.md, plots)."""
    best_moe: str
    """The MoE with the lower validation loss: the one exported to transformers."""
    hf_dir: Path
    """Its transformers export."""
    hf_check: dict[str, Any]
    """:func:`check_transformers`'s measurements of the export."""


def run_command(module: ModuleType, argv: list[object]) -> None:
    """``module``'s command (a ``moe_lit.commands`` module) with ``argv``, as ``moe-lit`` runs it."""
    parser = argparse.ArgumentParser(prog=f"moe-lit {module.__name__.rpartition('.')[2]}", allow_abbrev=False)
    module.configure(parser)
    module.run(parser.parse_args([str(word) for word in argv]))


def _step(out: Path, done: Path, resume: bool, what: str) -> bool:
    """Whether the step that writes ``out`` must run (not when resuming and ``done`` exists)."""
    if resume and done.exists():
        print(f"demo: {what} was done ({out})", flush=True)
        return False
    print(f"demo: {what}", flush=True)
    return True


def card_steps(trained: dict[str, RunResult], data_dir: Path, args: argparse.Namespace) -> CardSteps:
    """The suite of the three models, the routing of the two MoEs, the export of the better MoE."""
    evals = {name: evaluate_card_model(name, trained[name].checkpoint, data_dir, args) for name in CARD_MODELS}
    analyses = {name: analyse_card_routing(name, trained[name].checkpoint, data_dir, args) for name in MOES}
    best = min(MOES, key=lambda name: trained[name].val_loss)
    hf_dir, check_file = export_best(best, trained[best].checkpoint, data_dir, args)
    return CardSteps(evals, analyses, best, hf_dir, json.loads(check_file.read_text()))


def evaluate_card_model(name: str, checkpoint: str, data_dir: Path, args: argparse.Namespace) -> Path:
    """``moe-lit eval`` of the local suite (``--eval-limit`` items per task, fp32) into ``eval/<name>``."""
    from moe_lit.commands import eval as eval_command
    from moe_lit.data.layout import tokenizer_file

    out = args.work_dir / "eval" / name
    if _step(out, out / "results.json", args.resume, f"moe-lit eval of {name} (local suite, limit {args.eval_limit})"):
        run_command(
            eval_command,
            ["--checkpoint", checkpoint, "--tasks", "moe_lit_suite", "--limit", args.eval_limit, "--data", data_dir,
             "--tokenizer", tokenizer_file(data_dir), "--batch-size", EVAL_BATCH, "--precision", "32-true",
             "--bootstrap-iters", 0, "--out", out, "--force"],
        )  # fmt: skip
    return out


def analyse_card_routing(name: str, checkpoint: str, data_dir: Path, args: argparse.Namespace) -> Path:
    """``moe-lit analyze routing`` of an MoE into ``analysis/<name>``."""
    from moe_lit.commands import analyze
    from moe_lit.data.layout import tokenizer_file

    out = args.work_dir / "analysis" / name
    if _step(out, out / "routing.json", args.resume, f"moe-lit analyze routing of {name}"):
        run_command(
            analyze,
            ["routing", "--checkpoint", checkpoint, "--data", data_dir, "--tokenizer", tokenizer_file(data_dir),
             "--out", out, "--force"],
        )  # fmt: skip
    return out


def export_best(name: str, checkpoint: str, data_dir: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """``moe-lit export --format mixtral`` of an MoE into ``hf/<name>``, and its
    :func:`check_transformers` in ``hf/<name>.json``: (the export, the check)."""
    from moe_lit.commands import export
    from moe_lit.data.layout import tokenizer_file

    hf_dir, check_file = args.work_dir / "hf" / name, args.work_dir / "hf" / f"{name}.json"
    if _step(hf_dir, check_file, args.resume, f"moe-lit export of {name} to transformers ({HF_FORMAT})"):
        run_command(
            export,
            ["--checkpoint", checkpoint, "--format", HF_FORMAT, "--tokenizer", tokenizer_file(data_dir), "--out",
             hf_dir, "--force"],
        )  # fmt: skip
        atomic_write_json(check_file, check_transformers(hf_dir, Path(checkpoint), prompt(data_dir)))
    return hf_dir, check_file


def prompt(data_dir: Path) -> str:
    """The first :data:`PROMPT_WORDS` words of the first parallel test paragraph of the first language."""
    from moe_lit.evaluation.tasks import read_parallel

    first = next(iter(read_parallel(data_dir, "test").values()))[0]
    return " ".join(first["text"].split()[:PROMPT_WORDS])


def check_transformers(hf_dir: Path, checkpoint: Path, text: str) -> dict[str, Any]:
    """Load ``hf_dir`` with ``AutoModelForCausalLM`` / ``AutoTokenizer``: the largest logit
    difference to our model of ``checkpoint`` on ``text``, and the greedy continuation of ``text``."""
    import torch

    from moe_lit.convert.hf.core import load_hf_model, require_transformers

    transformers = require_transformers(moe=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    hf_model, ours = load_hf_model(hf_dir).eval(), load_model(checkpoint).eval()
    ids_1L = tokenizer(text, return_tensors="pt").input_ids[:, : ours.config.seq_len]  # within our RoPE table
    text = tokenizer.decode(ids_1L[0])
    with torch.no_grad():
        diff = (hf_model(ids_1L).logits - ours(ids_1L).logits_BLV).abs().max().item()
        generated_1T = hf_model.generate(
            ids_1L, max_new_tokens=GENERATED_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    line = tokenizer.decode(generated_1T[0, ids_1L.shape[1] :], skip_special_tokens=True)
    return {"prompt": text, "generated": line, "prompt_tokens": ids_1L.shape[1], "max_abs_logit_diff": diff}


# ---------------------------------------------------------------------------------------------
# the page
# ---------------------------------------------------------------------------------------------


def per_language_suite(eval_dir: Path) -> list[dict[str, object]]:
    """The local suite of one ``moe-lit eval`` folder, one row per language (``moe-lit eval``'s table)."""
    from moe_lit.commands.eval import suite_by_language, task_languages
    from moe_lit.evaluation.harness import result_rows

    results = json.loads((eval_dir / "results.json").read_text())
    return suite_by_language(result_rows(results), task_languages(results))


def _mean(rows: list[dict[str, object]], column: str) -> float:
    values = [float(row[column]) for row in rows if isinstance(row[column], (int, float))]  # type: ignore[arg-type]
    return sum(values) / len(values) if values else float("nan")


def results_rows(
    results: dict[str, RunResult],
    scores: dict[str, list[dict]] | None = None,
    steps_timed: dict[str, dict] | None = None,
) -> list[dict[str, object]]:
    """One table row per model: params, tokens, final validation loss, the suite's means over
    languages (when evaluated), load imbalance, tok/s of the run and, when timed, of its step."""
    rows = []
    for name, result in results.items():
        row: dict[str, object] = {
            "model": name,
            "total params": result.total_params,
            "active params": result.active_params,
            "tokens": result.tokens,
            "val loss": f"{result.val_loss:.4f}",
        }
        if scores and name in scores:
            row |= {f"mean {column}": f"{_mean(scores[name], column):.4f}" for column in PAGE_SUITE_COLUMNS}
        row["imbalance"] = round(result.load_imbalance, 2)
        row["tokens/s"] = round(result.tokens_per_s)
        if steps_timed and name in steps_timed:
            timed = steps_timed[name]
            row["step tok/s eager"] = round(timed["eager_tokens_per_s"])
            row["step tok/s compiled"] = round(timed["compiled_tokens_per_s"])
            row["compiled speedup"] = round(timed["compiled_speedup"], 3)
            row["compile s"] = round(timed["compile_s"], 1)
        rows.append(row)
    return rows


def seed_spread(results: dict[str, RunResult]) -> dict[str, Any] | None:
    """The final validation loss of every seed of ``dense`` and ``moe`` (``moe-seed1``, ...), their
    mean ± sd, and the paired MoE - dense difference; None with one seed."""
    from moe_lit.stats import paired_difference, summarize

    losses = {
        name: [r.val_loss for key, r in results.items() if key.partition("-seed")[0] == name] for name in MODELS_SEEDED
    }
    if len(losses["dense"]) < 2:
        return None
    summaries = {name: summarize(values) for name, values in losses.items()}
    diff = paired_difference(losses["moe"], losses["dense"])
    return {
        "losses": losses,
        "mean": {name: s.mean for name, s in summaries.items()},
        "sd": {name: s.std for name, s in summaries.items()},
        "difference": dataclasses.asdict(diff),
        "sd_ratio": summaries["moe"].std / summaries["dense"].std if summaries["dense"].std else float("nan"),
    }


def spread_markdown(spread: dict[str, Any]) -> str:
    from moe_lit.stats import Difference, format_difference, format_values

    rows = [
        {
            "model": name,
            "final val loss per seed": ", ".join(f"{v:.4f}" for v in values),
            "mean ± sd": format_values(values),
        }
        for name, values in spread["losses"].items()
    ]
    diff = Difference(**spread["difference"])
    return (
        f"{markdown_table(rows)}\n\nMoE - dense, paired by seed: {format_difference(diff)}; "
        f"sd of the differences {diff.sd:.4f}; sd(MoE) / sd(dense) = {spread['sd_ratio']:.2f}.\n"
    )


def plot_val_loss(results: dict[str, RunResult], swap_step: int | None, path: Path) -> None:
    from moe_lit.plotting import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=100)
    for name, result in results.items():
        tokens_per_step = result.tokens // max(1, result.steps)
        tokens = [p["step"] * tokens_per_step for p in result.curve]
        label = f"{name} ({result.total_params / 1e6:.1f}M total, {result.active_params / 1e6:.2f}M active)"
        ax.plot(tokens, [p["val_loss"] for p in result.curve], marker="o", label=label)
        if name == "upcycled" and swap_step is not None:
            ax.axvline(swap_step * tokens_per_step, color="grey", linestyle=":", label="dense -> MoE (upcycled)")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("moe-lit demo: dense, active-matched MoE, upcycled MoE")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def plot_suite_scores(scores: dict[str, list[dict]], path: Path) -> None:
    """Bits per byte (lower is better) and minimal-pairs accuracy per language, a bar per model."""
    from moe_lit.plotting import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    names = list(scores)
    languages = [row["language"] for row in scores[names[0]]]
    width = 0.8 / len(names)
    for ax, column in zip(axes, ("bits/byte", "minimal-pairs acc"), strict=True):
        for i, name in enumerate(names):
            by_language = {row["language"]: row[column] for row in scores[name]}
            values = [
                by_language.get(lang) if isinstance(by_language.get(lang), (int, float)) else 0 for lang in languages
            ]
            ax.bar([j + i * width for j in range(len(languages))], values, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(languages))], languages)
        ax.set_title(f"local suite: {column}")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def write_results(
    results: dict[str, RunResult],
    settings: dict[str, object],
    tokenizer: Path,
    out: Path,
    steps_timed: dict[str, dict] | None = None,
    steps: CardSteps | None = None,
    swap_step: int | None = None,
) -> None:
    """``out`` all or nothing: the page, ``results.json``, the plots, the step reports and ``models/``."""
    from moe_lit.callbacks.preemption import command_line

    card = {name: results[name] for name in (CARD_MODELS if steps else results) if name in results}
    scores = {name: per_language_suite(path) for name, path in steps.evals.items()} if steps else {}
    spread = seed_spread(results)
    with atomic_directory(out) as tmp:
        doc = {
            "command": command_line(),
            "settings": settings,
            "runs": {name: dataclasses.asdict(result) for name, result in results.items()},
            "suite": scores,
            "seed_spread": spread,
            "transformers": steps.hf_check if steps else None,
            "step_throughput": steps_timed or {},
        }
        atomic_write_json(tmp / RESULTS_JSON, doc)
        plot_val_loss(card, swap_step, tmp / LOSS_PLOT)
        if steps:
            plot_suite_scores(scores, tmp / SCORES_PLOT)
            shutil.copy(steps.analyses[steps.best_moe] / "similarity.png", tmp / ROUTING_PLOT)
            for name, path in steps.evals.items():
                shutil.copytree(path, tmp / "eval" / name, ignore=shutil.ignore_patterns("results.json"))
            for name, path in steps.analyses.items():
                shutil.copytree(path, tmp / "analysis" / name)
            shutil.copytree(steps.hf_dir, tmp / MODELS_DIR / f"hf-{steps.best_moe}")
        text = page(card, doc["command"], scores, spread, steps, steps_timed)
        atomic_write_text(tmp / PAGE, text + _notes(settings, swap_step, steps))
        for name, result in card.items():
            export_model(load_model(result.checkpoint), tmp / MODELS_DIR / name, tokenizer)


def page(
    card: dict[str, RunResult],
    command: str,
    scores: dict[str, list[dict]],
    spread: dict[str, Any] | None,
    steps: CardSteps | None,
    steps_timed: dict[str, dict] | None,
) -> str:
    """The page of ``results/demo/``: the table, the spread, the three plots, the export check."""
    lines = [
        "# moe-lit demo",
        "",
        f"Made by `{command}` (see [docs/demo.md](../../docs/demo.md) for what each step is).",
        "",
        markdown_table(results_rows(card, scores, steps_timed)),
        "",
        "`val loss`: final validation cross-entropy (nats/token, all languages); `mean ...`: the local",
        "multilingual suite (`moe-lit eval --tasks moe_lit_suite`) averaged over languages; `imbalance`:",
        "max/mean tokens per expert in the second half of training.",
        "",
        f"![validation loss]({LOSS_PLOT})",
        "",
    ]
    if spread:
        lines += ["## Seed spread", "", spread_markdown(spread)]
    if steps is None:
        return "\n".join(lines)
    check = steps.hf_check
    lines += [
        "## Local multilingual suite per language",
        "",
        f"![suite scores]({SCORES_PLOT})",
        "",
        *(f"- {name}: [eval/{name}/results.md](eval/{name}/results.md)" for name in steps.evals),
        "",
        f"## Routing similarity of languages ({steps.best_moe})",
        "",
        f"![routing similarity]({ROUTING_PLOT})",
        "",
        *(f"- {name}: [analysis/{name}/summary.md](analysis/{name}/summary.md)" for name in steps.analyses),
        "",
        f"## {steps.best_moe} in transformers",
        "",
        f"`moe-lit export --format {HF_FORMAT}` (`models/hf-{steps.best_moe}/`, git-ignored), loaded with",
        f"`AutoModelForCausalLM`: largest |logit difference| to ours on the prompt {check['max_abs_logit_diff']:.2e};",
        f"greedy continuation of {check['prompt']!r}:",
        "",
        f"> {check['generated']!r}",
        "",
    ]
    return "\n".join(lines)


def _notes(settings: dict[str, object], swap_step: int | None, steps: CardSteps | None) -> str:
    """What the table's rows are: the upcycling step, the suite's size, the seeds."""
    lines = ["", "## Notes", ""]
    if swap_step is not None:
        lines.append(f"- `upcycled`: the dense model's run, grown into the MoE's layout after step {swap_step}.")
    if steps is not None:
        lines.append(f"- The suite scored {settings.get('eval_limit')} items per task (`--eval-limit`), fp32.")
    lines.append(f"- Seeds: {settings.get('seeds', 1)} (`--seeds`); the table and the plots are the first seed's.")
    return "\n".join(lines) + "\n"
