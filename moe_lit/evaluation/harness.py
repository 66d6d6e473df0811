"""lm-evaluation-harness adapter: our checkpoints as the registered lm-eval model ``moe_lit``.

Shape legend: B batch, L sequence, V vocabulary, n scored tokens of one request.

``MoeLitLM`` subclasses lm-eval's ``TemplateLM``: TemplateLM turns ``loglikelihood`` requests into
token lists (empty contexts get the end-of-text token as prefix) and we score them in
``_loglikelihood_tokens``. Scoring is batched: requests are sorted by length (lm-eval's
``Collator``), right-padded and run through the model once per batch. Right padding is exact for a
causal decoder with a dropless MoE (every real token sees only real tokens before it); with token
dropping (``capacity_factor``) batch composition can change which assignments are dropped.

``loglikelihood_rolling`` scores a long document in windows of the model's ``seq_len``
(lm-eval's ``get_rolling_token_windows``: every token is predicted exactly once, the first one
from the end-of-text token) and sums them. ``generate_until`` decodes greedily with the KV cache
(``moe_lit.inference.generate``), stopping at the end-of-text token, at the first stop sequence
(cut off) or after ``max_gen_toks`` tokens; beyond ``max_length`` tokens the window slides.

Use it from Python (importing ``moe_lit.evaluation.harness`` registers it)::

    lm_eval.simple_evaluate(model="moe_lit", model_args="checkpoint=run.ckpt,batch_size=8", tasks=[...])
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator
from tqdm import tqdm

from moe_lit.data.tokenizer import load_tokenizer, model_tokenizer, resolve_eot_id
from moe_lit.errors import MoeLitError

Request = tuple[Any, list[int], list[int]]
"""``(cache key, context tokens, continuation tokens)`` as TemplateLM passes them."""


GENERIC_DIRS = ("checkpoints", "models")
"""Folder names that say nothing about the run; :func:`checkpoint_name` skips them."""


def checkpoint_name(checkpoint: str | Path) -> str:
    """A results folder name: ``<run dir>-<file stem or export dir>-<hash>``, e.g.
    ``demo-tiny-moe-1a2b3c4d`` for ``results/demo/models/tiny-moe`` and ``<run>-last-<hash>`` for
    ``<run>/checkpoints/last.ckpt``; the hash is of the absolute path, so two runs never share one."""
    checkpoint = Path(checkpoint).resolve()
    run = checkpoint.parent.parent if checkpoint.parent.name in GENERIC_DIRS else checkpoint.parent
    digest = hashlib.sha1(str(checkpoint).encode()).hexdigest()[:8]
    return f"{run.name}-{checkpoint.stem if checkpoint.is_file() else checkpoint.name}-{digest}"


RUNS_DIR = Path("runs")
"""Default root of what eval and analyze write (untracked; the repo's ``results/`` holds curated results)."""


def default_out(checkpoint: str | Path, kind: str) -> Path:
    """``runs/<kind>/<checkpoint_name>``: the default ``--out`` of ``eval`` and ``analyze``."""
    return RUNS_DIR / kind / checkpoint_name(checkpoint)


@register_model("moe_lit")
class MoeLitLM(TemplateLM):
    """A moe_lit Transformer + byte-level BPE tokenizer behind lm-eval's LM interface."""

    def __init__(
        self,
        checkpoint: str | Path | None = None,
        tokenizer: str | Path | Any | None = None,
        batch_size: int | str = 8,
        device: str = "auto",
        max_length: int | None = None,
        max_gen_toks: int = 256,
        eot_token: str | None = None,
        model: torch.nn.Module | None = None,
        max_batch_size: int | None = None,
        sparsity: float | str | None = None,
        sparsity_rule: str = "gate",
        sparsity_granularity: str = "layer",
        calibration: str | Path | None = None,
        precision: str | None = None,
    ) -> None:
        """
        Args:
            checkpoint: a Lightning ``.ckpt`` or an exported directory (or pass ``model``).
            tokenizer: ``tokenizer.json`` path or a loaded ``tokenizers.Tokenizer``; default: the
                one stored with the checkpoint.
            batch_size: requests scored per forward.
            device: torch device of the model; ``auto`` (default): CUDA when available, else CPU.
            max_length: context window in tokens; default the model's ``seq_len``.
            max_gen_toks: generation limit when a task does not set one.
            eot_token: end-of-text token (default: the first of ``data.tokenizer.EOT_CANDIDATES`` present).
            model: an in-memory Transformer instead of ``checkpoint``.
            max_batch_size: accepted for lm-eval's CLI; unused (no automatic batch size).
            sparsity: target intra-expert activation sparsity (``moe_lit.inference.sparsity``);
                default none (the dense model).
            sparsity_rule: ``gate`` or ``gate_up``.
            sparsity_granularity: thresholds per ``layer`` or per ``expert``.
            calibration: a text file the sparsity thresholds are calibrated on (needed with sparsity).
            precision: ``auto``, ``32-true`` or ``bf16-true`` (``moe_lit.inference.precision``), said in
                one line on stderr and kept as ``precision_choice``; default: the model's dtype as loaded.
        """
        super().__init__()
        del max_batch_size
        from moe_lit.checkpoint import load_model, resolve_device

        if (checkpoint is None) == (model is None):
            raise MoeLitError("moe_lit model: pass exactly one of checkpoint=PATH or model=")
        device = resolve_device(device)
        if model is None:
            model = load_model(checkpoint, map_location=device)
        elif tokenizer is None:
            raise MoeLitError("moe_lit model: a tokenizer is required with model=")
        tokenizer_name = f"tokenizer {tokenizer}" if isinstance(tokenizer, (str, Path)) else "tokenizer"
        if isinstance(tokenizer, (str, Path)):
            tokenizer = load_tokenizer(tokenizer, require_eos=False)
        self.tokenizer = model_tokenizer(checkpoint) if tokenizer is None else tokenizer
        self.model = model.to(device).eval()
        self._device = torch.device(device)
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks")
        self._max_length = _positive_int(max_length or self.model.config.seq_len, "max_length")
        if self._max_length > self.model.config.seq_len:
            raise MoeLitError(f"max_length: {self._max_length} exceeds the model's seq_len {self.model.config.seq_len}")
        if self.tokenizer.get_vocab_size() > self.model.config.vocab_size:
            raise MoeLitError(
                f"{tokenizer_name}: {self.tokenizer.get_vocab_size()} tokens do not fit the model's "
                f"vocab_size {self.model.config.vocab_size}; is it the checkpoint's tokenizer?"
            )
        self._eot_id = resolve_eot_id(self.tokenizer, eot_token)
        if sparsity is not None:
            self.model = self._sparse(float(sparsity), sparsity_rule, sparsity_granularity, calibration)
        self.precision_choice = None
        if precision is not None:
            from moe_lit.inference.precision import to_precision

            self.model, self.precision_choice = to_precision(self.model, precision, device)

    def _sparse(self, target: float, rule: str, granularity: str, calibration) -> torch.nn.Module:
        from moe_lit.inference.sparsity import SparsityConfig, sparse_model, text_calibration

        cfg = SparsityConfig(target=target, rule=rule, granularity=granularity)
        if calibration is None:
            raise MoeLitError("moe_lit model: sparsity= needs calibration=TEXT_FILE to fit its thresholds")
        batches = text_calibration(self.tokenizer, calibration, self.max_length, cfg.calibration_tokens)
        return sparse_model(self.model, cfg, batches)

    # ------------------------------------------------------------------ TemplateLM contract
    @property
    def eot_token_id(self) -> int:
        return self._eot_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # NOTE: our tokenizers add no BOS; the prefix token for empty contexts comes from TemplateLM.
        return self.tokenizer.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False, **kwargs) -> list:
        """``(sum of log p(continuation | context), continuation is the greedy output)`` per request.

        A continuation longer than the window is scored in chunks of ``max_length`` tokens, each
        with as much preceding context as fits (the same windows as ``loglikelihood_rolling``).
        """
        pieces, owners = [], []
        for owner, (_, context, continuation) in enumerate(requests):
            if not context:
                raise MoeLitError("loglikelihood: empty context tokens (TemplateLM prefixes end-of-text)")
            for start in range(0, len(continuation), self.max_length):
                pieces.append((context + continuation[:start], continuation[start : start + self.max_length]))
                owners.append(owner)
        totals = [(0.0, True)] * len(requests)
        for owner, (score, greedy) in zip(owners, self._score_pieces(pieces, disable_tqdm), strict=False):
            total, all_greedy = totals[owner]
            totals[owner] = (total + score, all_greedy and greedy)
        for (key, _, _), answer in zip(requests, totals, strict=False):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return totals

    def _score_pieces(self, pieces: list[tuple[list[int], list[int]]], disable_tqdm: bool) -> list:
        """Batched scores of ``(context, continuation)`` with ``len(continuation) <= max_length``."""
        collator = Collator(pieces, sort_fn=lambda piece: (-len(piece[0]) - len(piece[1]), tuple(piece[0] + piece[1])))
        scores: list[tuple[float, bool]] = []
        progress = tqdm(total=len(pieces), disable=disable_tqdm, desc="moe_lit loglikelihood")
        for batch in collator.get_batched(n=self.batch_size):
            # NOTE: keep the last max_length+1 tokens; the final token is only ever a target.
            inputs = [(context + continuation)[-(self.max_length + 1) :][:-1] for context, continuation in batch]
            logprobs_BLV = self._log_probs(inputs)
            for row, (_, continuation) in enumerate(batch):
                end = len(inputs[row])
                logprobs_nV = logprobs_BLV[row, end - len(continuation) : end]
                target_n = torch.tensor(continuation, device=logprobs_nV.device)
                score = float(logprobs_nV.gather(-1, target_n[:, None]).sum())
                scores.append((score, bool((logprobs_nV.argmax(dim=-1) == target_n).all())))
            progress.update(len(batch))
        progress.close()
        return collator.get_original(scores)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Full-document log-likelihood, in disjoint windows of ``max_length`` predicted tokens."""
        windows: list[Request] = []
        owners: list[int] = []
        for owner, (text,) in enumerate(req.args for req in requests):
            token_windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(lm_utils.make_disjoint_window, token_windows):
                windows.append((None, context, continuation))
                owners.append(owner)
        totals = [0.0] * len(requests)
        for owner, (score, _) in zip(
            owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm), strict=False
        ):
            totals[owner] += score
        for request, total in zip(requests, totals, strict=False):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context until a stop sequence, end-of-text or ``max_gen_toks``."""
        collator = Collator(
            [req.args for req in requests],
            sort_fn=lambda args: (-len(self.tok_encode(args[0])), args[0]),
            group_fn=lambda args: args[1],
            group_by="gen_kwargs",
        )
        outputs: list[str] = []
        for batch in tqdm(collator.get_batched(n=self.batch_size), disable=disable_tqdm, desc="moe_lit generate"):
            stops, max_new = self._generation_settings(batch[0][1])
            prompts = [self.tok_encode(context) or [self.prefix_token_id] for context, _ in batch]
            texts = self._greedy(prompts, max_new, stops)
            for args, text in zip(batch, texts, strict=False):
                self.cache_hook.add_partial("generate_until", args, text)
            outputs.extend(texts)
        return collator.get_original(outputs)

    # ------------------------------------------------------------------ model calls
    @torch.no_grad()
    def _log_probs(self, inputs: list[list[int]]) -> torch.Tensor:
        """Log-softmax ``(B, L, V)`` of right-padded inputs (padding positions are garbage)."""
        length = max(len(tokens) for tokens in inputs)
        idx_BL = torch.full((len(inputs), length), self.eot_token_id, dtype=torch.long)
        for row, tokens in enumerate(inputs):
            idx_BL[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logits_BLV = self.model(idx_BL.to(self._device)).logits_BLV
        return F.log_softmax(logits_BLV.float(), dim=-1)

    def _greedy(self, prompts: list[list[int]], max_new: int, stops: list[str]) -> list[str]:
        """Greedy KV-cache decoding (``moe_lit.inference``) over a window of ``max_length`` tokens."""
        from moe_lit.inference import generate

        def stopped(generated: list[int]) -> bool:
            return _cut_at_stop(self.tok_decode(generated), stops)[1]

        generated = generate(
            self.model,
            prompts,
            max_new,
            stop_tokens=[self.eot_token_id],
            stop=stopped if stops else None,
            window=self.max_length,
        )
        return [_cut_at_stop(self.tok_decode(tokens), stops)[0] for tokens in generated]

    def _generation_settings(self, gen_kwargs: dict) -> tuple[list[str], int]:
        if not isinstance(gen_kwargs, dict):
            raise MoeLitError(f"generate_until: gen_kwargs must be a dict, got {type(gen_kwargs).__name__}")
        if gen_kwargs.get("do_sample"):
            raise MoeLitError("generate_until: moe_lit decodes greedily; the task asks for do_sample=True")
        # NOTE: end-of-text always stops (as a token); 'until' adds text stop sequences.
        until = gen_kwargs.get("until", [])
        stops = [until] if isinstance(until, str) else list(until)
        if not all(isinstance(stop, str) for stop in stops):
            raise MoeLitError(f"generate_until: 'until' must be a string or a list of strings, got {until!r}")
        max_new = _positive_int(gen_kwargs.get("max_gen_toks", self.max_gen_toks), "max_gen_toks")
        return [stop for stop in stops if stop], max_new


def _cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to its earliest stop sequence, and whether one occurred."""
    cuts = [text.find(stop) for stop in stops if stop in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


def _positive_int(value: int | str, name: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number <= 0:
        raise MoeLitError(f"{name}: must be a positive integer, got {value!r}")
    return number


def _disabled_tqdm(*args: Any, **kwargs: Any) -> tqdm:
    return tqdm(*args, **{**kwargs, "disable": True})


@contextmanager
def scoring_bars_only() -> Iterator[None]:
    """Inside the block lm-eval shows only our scoring bars (one per request type), none per task.

    NOTE: per task, lm-eval draws a `datasets` bar ("Generating test split") and a tqdm bar while it
    builds the requests (``Task.build_all_requests``), then one while tokenizing
    (``TemplateLM.loglikelihood``); its API cannot turn them off, and with the local suite's 27 tasks
    they are most of the console. ``datasets`` has a switch (restored after the block); lm-eval's two
    module-level ``tqdm`` names are swapped for a disabled tqdm inside the block."""
    import datasets
    import lm_eval.api.model
    import lm_eval.api.task

    modules = (lm_eval.api.task, lm_eval.api.model)
    saved = [module.tqdm for module in modules]
    datasets_bars = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    for module in modules:
        module.tqdm = _disabled_tqdm
    try:
        yield
    finally:
        for module, original in zip(modules, saved, strict=True):
            module.tqdm = original
        if datasets_bars:
            datasets.enable_progress_bars()


@contextmanager
def reachable_datasets() -> Iterator[None]:
    """A task dataset that cannot be reached (offline, or no such hub dataset) -> one line naming ``--task-data``.

    NOTE: ``datasets`` raises the builtin ConnectionError offline; lm-eval passes it up as it is.
    """
    from datasets.exceptions import DatasetNotFoundError

    try:
        yield
    except (ConnectionError, DatasetNotFoundError) as exc:
        raise MoeLitError(
            f"--tasks: a task's dataset is not reachable ({exc}); offline, run the built-in task on a local "
            "JSONL in its schema: moe-lit eval --checkpoint CK --tasks TASK --task-data TASK=FILE"
        ) from exc


def git_commit_hash() -> str | None:
    """``git describe --always`` of the working directory, None outside a git checkout (quietly)."""
    import subprocess

    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip() or None


@contextmanager
def quiet_git_hash() -> Iterator[None]:
    """Inside the block lm-eval records the git hash with :func:`git_commit_hash`.

    NOTE: lm-eval's own runs ``git describe`` with the terminal as its stderr, so outside a
    checkout every ``moe-lit eval`` printed ``fatal: not a git repository``. Its module-level name
    is swapped inside the block, as :func:`scoring_bars_only` swaps ``tqdm``."""
    import lm_eval.evaluator

    saved = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = git_commit_hash
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = saved


def evaluate(lm: MoeLitLM, tasks: list[str], task_manager, **options: Any) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` on ``lm``; ``options`` go to it (limit, bootstrap_iters, ...).

    Returns the harness's results dict (``results``, ``configs``, ``n-samples``, ...).
    """
    import lm_eval

    options.setdefault("log_samples", False)
    with reachable_datasets(), scoring_bars_only(), quiet_git_hash():
        results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=task_manager, **options)
    if results is None:  # only non-zero ranks of a distributed run get None
        raise MoeLitError("evaluate: lm-eval returned no results")
    return results


def result_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (task, metric) of a harness results dict: value, stderr and sample count."""
    rows = []
    for task, metrics in results["results"].items():
        samples = results.get("n-samples", {}).get(task, {}).get("effective", "")
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if metric in ("alias", "sample_len") or "_stderr" in metric or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filter_name}", "")
            rows.append({"task": task, "metric": metric, "value": value, "stderr": stderr, "n": samples})
    return rows


__all__ = [
    "MoeLitLM",
    "checkpoint_name",
    "default_out",
    "evaluate",
    "result_rows",
    "scoring_bars_only",
]
