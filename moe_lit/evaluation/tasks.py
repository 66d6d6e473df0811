"""Task building for lm-eval: the local multilingual suite and offline copies of built-in tasks.

Local suite (``moe_lit_suite``), built from the parallel test split of a prepared data dir
(``meta.json`` + ``text/<split>/<lang>.jsonl`` with one ``{"id", "doc", "text"}`` per paragraph):

* ``moe_lit_ppl_<lang>``: perplexity and bits-per-byte of each test document (loglikelihood_rolling);
* ``moe_lit_next_<lang>``: multiple choice: after a paragraph, the test paragraph that truly
  follows it in the document vs other test paragraphs of that document. With ``pos`` in the
  records the context is the document's previous paragraph from any split (a split drawn per
  paragraph keeps only some paragraphs of a document in test; the answer and the distractors are
  always unseen test paragraphs); without, the previous test paragraph;
* ``moe_lit_pairs_<lang>``: minimal pairs, a real sentence vs the same sentence with its words
  after the first shuffled (the same tokens, so chance is 50%).

Only paragraph ids present in every language are used and an item is kept only when it is valid
in every language, so every language answers the same items (choice order included) and scores
compare across languages. Item randomness is seeded by ``(seed, item id)``.

Task YAMLs are templates in the repository's ``eval/templates``; :func:`render_suite` writes the
items as JSONL and the rendered YAMLs (absolute data paths) into a work dir that lm-eval reads via
``TaskManager(include_path=...)``. :func:`render_builtin_local` points a built-in task at a local
JSONL in the task's own schema while keeping its prompt (``include:`` of the built-in YAML).
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_lit.errors import MoeLitError

TEMPLATES_DIR = Path(__file__).parent / "templates"
"""``eval/templates`` of the checkout (a symlink there), package data in an installed wheel."""
SUITE_PREFIX = "moe_lit_"
SUITE_KINDS = {"ppl": "ppl.yaml.in", "next": "next_paragraph.yaml.in", "pairs": "minimal_pairs.yaml.in"}
SUITE_TAGS = ("moe_lit_suite", *(f"{SUITE_PREFIX}{kind}" for kind in SUITE_KINDS))
LOCAL_SUFFIX = "_local"
SUITE_MANIFEST = "suite.json"
_SENTENCE_END = re.compile(r"(?<=[.!?。！？])\s+")


@dataclass
class SuiteConfig:
    """How the local suite is built from the parallel test split."""

    split: str = "test"
    """Split of the prepared dir to read (``text/<split>/<lang>.jsonl``)."""
    languages: list[str] | None = None
    """Languages to build; null = all of ``meta.json``'s languages that have a file."""
    num_distractors: int = 3
    """Distractor paragraphs per next-paragraph item (fewer when the document is short)."""
    max_chars: int = 300
    """Next-paragraph and minimal-pair items whose texts exceed this many characters in any
    language are skipped (their continuations must fit the model's window)."""
    seed: int = 1234
    """Seed of distractor choice, choice order and shuffles (combined with each item id)."""

    def __post_init__(self) -> None:
        for name in ("num_distractors", "max_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MoeLitError(f"suite.{name}: must be a positive integer, got {value!r}")


# ---------------------------------------------------------------------- parallel text
def resolve_data_dir(checkpoint: Path, data: Path | None = None) -> Path:
    """``data``, else the data dir a ``.ckpt`` was trained on, else the default prepared dir."""
    if data is None:
        data = _trained_on(Path(checkpoint))
    if data is None:
        from moe_lit.data.layout import default_data_dir

        data = default_data_dir()
    if not (Path(data) / "meta.json").is_file():
        raise MoeLitError(f"--data: {data} is not a prepared data dir (no meta.json); pass --data DIR")
    return Path(data)


def _trained_on(checkpoint: Path) -> Path | None:
    if not checkpoint.is_file():
        return None
    from moe_lit.checkpoint import read_lightning_checkpoint

    data_dir = read_lightning_checkpoint(checkpoint).get("datamodule_hyper_parameters", {}).get("data_dir")
    return Path(data_dir) if data_dir else None


def read_parallel(data_dir: Path, split: str = "test", languages: Sequence[str] | None = None) -> dict[str, list]:
    """Per language, the paragraphs whose id exists in every language, in the first language's order."""
    data_dir = Path(data_dir)
    if languages is None:
        languages = _meta_languages(data_dir)
    text_dir = data_dir / "text" / split
    missing = [lang for lang in languages if not (text_dir / f"{lang}.jsonl").is_file()]
    if missing or not languages:
        raise MoeLitError(f"--data: no parallel text for {missing or 'any language'} under {text_dir}")
    records = {lang: _read_jsonl(text_dir / f"{lang}.jsonl") for lang in languages}
    common = set.intersection(*({r["id"] for r in recs} for recs in records.values()))
    if not common:
        raise MoeLitError(f"--data: the {split} split has no paragraph id shared by {list(languages)}")
    order = [r["id"] for r in records[languages[0]] if r["id"] in common]
    by_id = {lang: {r["id"]: r for r in recs} for lang, recs in records.items()}
    return {lang: [by_id[lang][pid] for pid in order] for lang in languages}


def _meta_languages(data_dir: Path) -> list[str]:
    meta = data_dir / "meta.json"
    if not meta.is_file():
        raise MoeLitError(f"--data: {data_dir} has no meta.json; is it a prepared data dir?")
    return list(json.loads(meta.read_text())["languages"])


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            record = json.loads(line)
            if not {"id", "doc", "text"} <= set(record):
                raise MoeLitError(f"{path}:{number}: a record needs the keys id, doc, text")
            records.append(record)
    return records


def documents(paragraphs: list[dict[str, Any]]) -> dict[Any, list[int]]:
    """Paragraph positions grouped by document (first appearance), in document order (``pos``)."""
    docs: dict[Any, list[int]] = {}
    for position, record in enumerate(paragraphs):
        docs.setdefault(record["doc"], []).append(position)
    return {doc: sorted(positions, key=lambda p: paragraphs[p].get("pos", p)) for doc, positions in docs.items()}


# ---------------------------------------------------------------------- items
def build_items(
    parallel: dict[str, list], cfg: SuiteConfig, index: ParagraphIndex | None = None
) -> dict[str, dict[str, list[dict]]]:
    """``{kind: {lang: items}}`` for kinds ppl / next / pairs; the same items in every language.

    ``index`` (all splits' paragraphs) gives next-paragraph items their true previous paragraph.
    """
    reference = next(iter(parallel.values()))
    docs = documents(reference)
    return {
        "ppl": _ppl_items(parallel, docs),
        "next": _next_items(parallel, docs, cfg, index),
        "pairs": _pair_items(parallel, cfg),
    }


def _ppl_items(parallel: dict[str, list], docs: dict[Any, list[int]]) -> dict[str, list[dict]]:
    def joined(paras: list[dict], positions: list[int]) -> str:
        return "\n".join(paras[p]["text"] for p in positions)

    return {
        lang: [{"id": str(doc), "text": joined(paras, positions)} for doc, positions in docs.items()]
        for lang, paras in parallel.items()
    }


@dataclass
class ParagraphIndex:
    """Every paragraph of every split, to find the paragraph right before a test paragraph."""

    id_at: dict[tuple[Any, int], Any]
    """``(doc, pos) -> paragraph id`` in the reference (first) language."""
    text: dict[str, dict[Any, str]]
    """Per language, ``paragraph id -> text``."""


def paragraph_index(data_dir: Path, languages: Sequence[str]) -> ParagraphIndex | None:
    """Index of all splits' paragraphs; None when the records carry no ``pos`` (document order)."""
    index = ParagraphIndex({}, {lang: {} for lang in languages})
    for split_dir in sorted(p for p in (Path(data_dir) / "text").iterdir() if p.is_dir()):
        for lang in languages:
            path = split_dir / f"{lang}.jsonl"
            for record in _read_jsonl(path) if path.is_file() else []:
                if "pos" not in record:
                    return None
                index.text[lang][record["id"]] = record["text"].strip()
                if lang == languages[0]:
                    index.id_at[(record["doc"], record["pos"])] = record["id"]
    return index


def _contexts(parallel: dict[str, list], positions: list[int], j: int, index: ParagraphIndex | None):
    """Per language, the paragraph right before test paragraph ``positions[j]``; None if unknown.

    With ``pos`` it is the document's previous paragraph (any split, the same id in every
    language); without, the previous test paragraph of the document.
    """
    if index is None:
        return {lang: paras[positions[j - 1]]["text"].strip() for lang, paras in parallel.items()} if j else None
    answer = next(iter(parallel.values()))[positions[j]]
    previous_id = index.id_at.get((answer["doc"], answer["pos"] - 1))
    texts = {lang: index.text[lang].get(previous_id) for lang in parallel}
    return texts if previous_id is not None and all(texts.values()) else None


def _next_items(
    parallel: dict[str, list], docs: dict[Any, list[int]], cfg: SuiteConfig, index: ParagraphIndex | None
) -> dict[str, list[dict]]:
    items: dict[str, list[dict]] = {lang: [] for lang in parallel}
    texts = {lang: [r["text"].strip() for r in paras] for lang, paras in parallel.items()}
    reference = next(iter(parallel.values()))
    for positions in docs.values():
        for j, answer in enumerate(positions):
            context = _contexts(parallel, positions, j, index)
            if context is None:
                continue
            item_id = reference[answer]["id"]
            rng = random.Random(f"{cfg.seed}:next:{item_id}")
            others = [p for p in positions if p != answer and all(t[p] != context[lang] for lang, t in texts.items())]
            picked = rng.sample(others, min(cfg.num_distractors, len(others)))
            # NOTE: a distractor identical to the answer (repeated headings) is no distractor.
            picked = [p for p in picked if all(t[p] and t[p] != t[answer] for t in texts.values())]
            too_long = any(
                max(len(context[lang]), *(len(t[p]) for p in (answer, *picked))) > cfg.max_chars
                for lang, t in texts.items()
            )
            if not picked or too_long:
                continue
            order = [answer, *picked]
            rng.shuffle(order)
            for lang, t in texts.items():
                item = {"id": item_id, "context": context[lang], "choices": [t[p] for p in order]}
                items[lang].append({**item, "label": order.index(answer)})
    return items


def first_sentence(text: str) -> str:
    return _SENTENCE_END.split(text.strip(), maxsplit=1)[0]


def shuffled(sentence: str, rng: random.Random) -> str | None:
    """The sentence with all words but the first shuffled; None when no other order exists.

    NOTE: keeping the first word in place keeps the multiset of byte-level BPE pre-tokens
    (every moved word keeps its leading space, punctuation splits off), so both sentences have
    the same number of tokens and a length bias cannot decide the pair. Text without spaces
    falls back to shuffling characters (after the first), where token counts may differ.
    """
    words = sentence.split()
    units, joiner = (words, " ") if len(words) >= 2 else (list(sentence), "")
    head, tail = units[:1], units[1:]
    for _ in range(10):
        candidate = list(tail)
        rng.shuffle(candidate)
        if candidate != tail:
            return joiner.join(head + candidate)
    return None


def _pair_items(parallel: dict[str, list], cfg: SuiteConfig) -> dict[str, list[dict]]:
    items: dict[str, list[dict]] = {lang: [] for lang in parallel}
    reference = next(iter(parallel.values()))
    for position, record in enumerate(reference):
        pairs = {}
        for lang, paras in parallel.items():
            good = first_sentence(paras[position]["text"])
            bad = shuffled(good, random.Random(f"{cfg.seed}:pairs:{record['id']}:{lang}"))
            if bad is None or len(good) > cfg.max_chars:
                break
            pairs[lang] = {"id": record["id"], "good": good, "bad": bad}
        else:
            for lang, pair in pairs.items():
                items[lang].append(pair)
    return items


# ---------------------------------------------------------------------- rendering
def lang_key(lang: str) -> str:
    """A language code usable in a task name (``pt-br`` -> ``pt_br``)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", lang).lower()


def render_template(template: str, out_file: Path, **values: str) -> Path:
    """Substitute ``values`` (JSON-quoted, so any path is valid YAML) into ``eval/templates/<template>``."""
    source = TEMPLATES_DIR / template
    if not source.is_file():
        raise MoeLitError(f"eval templates: {source} is missing (a broken install: reinstall moe_lit)")
    quoted = {k: (v if k in ("lang_key", "task") else json.dumps(v)) for k, v in values.items()}
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(string.Template(source.read_text()).substitute(quoted))
    return out_file


def render_suite(data_dir: str | Path, work_dir: str | Path, cfg: SuiteConfig | None = None) -> dict[str, Any]:
    """Write the local suite's items and task YAMLs under ``work_dir``; returns (and writes as
    ``suite.json``) a manifest: languages, items per kind, chance accuracy per kind, task names."""
    data_dir, work_dir = Path(data_dir), Path(work_dir)
    cfg = cfg or SuiteConfig()
    parallel = read_parallel(data_dir, cfg.split, cfg.languages)
    items = build_items(parallel, cfg, paragraph_index(data_dir, list(parallel)))
    manifest: dict[str, Any] = {"languages": list(parallel), "items": {}, "chance_acc": {}, "tasks": []}
    for kind, per_lang in items.items():
        manifest["items"][kind] = len(next(iter(per_lang.values())))
        if not manifest["items"][kind]:
            continue  # e.g. no document with three paragraphs: nothing to ask
        for lang, lang_items in per_lang.items():
            data_file = work_dir / "data" / f"{kind}_{lang_key(lang)}.jsonl"
            data_file.parent.mkdir(parents=True, exist_ok=True)
            data_file.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in lang_items))
            render_template(
                SUITE_KINDS[kind],
                work_dir / f"{SUITE_PREFIX}{kind}_{lang_key(lang)}.yaml",
                lang=lang,
                lang_key=lang_key(lang),
                data_file=str(data_file.resolve()),
            )
            manifest["tasks"].append(f"{SUITE_PREFIX}{kind}_{lang_key(lang)}")
    first = {kind: next(iter(per_lang.values())) for kind, per_lang in items.items()}
    if first["next"]:
        manifest["chance_acc"]["next"] = sum(1 / len(item["choices"]) for item in first["next"]) / len(first["next"])
    if first["pairs"]:
        manifest["chance_acc"]["pairs"] = 0.5
    (work_dir / SUITE_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _builtin_yaml_texts():
    """``(path, text)`` of every built-in lm-eval task YAML."""
    import lm_eval.tasks

    for path in sorted(Path(lm_eval.tasks.__file__).parent.rglob("*.yaml")):
        yield path, path.read_text(encoding="utf-8", errors="ignore")


def builtin_task_yaml(name: str) -> Path:
    """The built-in lm-eval YAML that defines task ``name`` (a leaf task, not a group)."""
    from moe_lit._compat import load_task_yaml

    # NOTE: a text scan of lm-eval's task dir, because TaskManager's full index parses every task (slow).
    pattern = re.compile(rf"^task:\s*['\"]?{re.escape(name)}['\"]?\s*$", re.MULTILINE)
    for path, text in _builtin_yaml_texts():
        if pattern.search(text) and load_task_yaml(path).get("task") == name:
            return path
    raise MoeLitError(f"--task-data: {name!r} is not a built-in lm-eval task (a leaf task such as xcopa_it)")


def _mentioned_builtin(names: Sequence[str]) -> set[str]:
    """The names that occur as a word in some built-in YAML (a cheap necessary test for existence)."""
    patterns = {name: re.compile(rf"(?<![\w-]){re.escape(name)}(?![\w-])") for name in names}
    found: set[str] = set()
    for _, text in _builtin_yaml_texts():
        found.update(name for name, pattern in patterns.items() if name not in found and pattern.search(text))
    return found


def render_builtin_local(name: str, data_file: Path, work_dir: Path) -> str:
    """A copy of built-in task ``name`` reading ``data_file`` (JSONL, the task's schema); returns its name."""
    data_file = Path(data_file)
    if not data_file.is_file():
        raise MoeLitError(f"--task-data: no such file {data_file}")
    local_name = f"{name}{LOCAL_SUFFIX}"
    render_template(
        "builtin_local.yaml.in",
        work_dir / f"{local_name}.yaml",
        builtin_yaml=str(builtin_task_yaml(name)),
        task=local_name,
        data_file=str(data_file.resolve()),
    )
    return local_name


def resolve_tasks(
    requested: Sequence[str],
    work_dir: Path,
    data_dir: Path | None = None,
    task_data: dict[str, Path] | None = None,
    suite: SuiteConfig | None = None,
):
    """Render what the requested tasks need into ``work_dir``; returns ``(task names, TaskManager)``.

    Built-in names are looked up in lm-eval's full task index only when some name is not local.
    """
    from lm_eval.tasks import TaskManager

    task_data = dict(task_data or {})
    unused = sorted(set(task_data) - set(requested))
    if unused:
        raise MoeLitError(f"--task-data: {unused} not among --tasks {list(requested)}")
    names = [render_builtin_local(n, task_data[n], work_dir) if n in task_data else n for n in requested]
    if any(name.startswith(SUITE_PREFIX) for name in names):
        if data_dir is None:
            raise MoeLitError("--data: the local suite (moe_lit_* tasks) needs a prepared data dir")
        render_suite(Path(data_dir), work_dir, suite)
    manager = TaskManager(include_path=str(work_dir), include_defaults=False)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        mentioned = _mentioned_builtin(unknown)
        unknown = [name for name in unknown if name not in mentioned]
    if not unknown and not all(name in manager.all_tasks for name in names):
        manager = TaskManager(include_path=str(work_dir))
        unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise MoeLitError(
            f"--tasks: unknown task {unknown[0]!r}; use the local suite ({', '.join(SUITE_TAGS)}, "
            f"{SUITE_PREFIX}<kind>_<lang>) or an lm-eval task, group or tag (`lm-eval ls tasks`)"
        )
    return names, manager


__all__ = [
    "SUITE_TAGS",
    "SuiteConfig",
    "build_items",
    "builtin_task_yaml",
    "read_parallel",
    "render_builtin_local",
    "render_suite",
    "resolve_data_dir",
    "resolve_tasks",
]
