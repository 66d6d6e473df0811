"""Per-language routing analysis over a parallel test set (Marco-MoE style).

Shape legend: G languages, M MoE layers, E experts, K top-k.

From one :class:`~moe_lit.evaluation.routing_trace.RoutingTrace` labelled with ``language``:

* usage ``usage_GME``: each language's distribution of routed assignments over the experts of a layer;
* similarity: Jensen-Shannon divergence (base 2, in [0, 1]) between the usage of two languages,
  per layer (``js_MGG``) and averaged over layers (``js_GG``);
* specialisation: entropy of each expert's language distribution ``p(language | expert)``, computed
  from the per-language usage (so languages with more tokens do not dominate), normalised by
  ``log2(G)``: 0 = used by one language only, 1 = used equally by all;
* shared vs language-specific experts: an expert is *used* by a language when it gets at least
  ``used_fraction / E`` of that language's assignments (``used_fraction`` of a uniform share);
  it is *shared* when every language uses it, *specific* when exactly one does;
* families: mean JS within a language family vs across families, with a permutation test that
  shuffles family labels across languages (is "related languages route more alike" chance?);
  each language's mean JS to the others says which languages route most distinctly.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moe_lit.errors import MoeLitError
from moe_lit.evaluation.routing_trace import RoutingTrace, find_transformer, routing_trace

LANGUAGE_FAMILIES: dict[str, str] = {
    **dict.fromkeys(("en", "de", "nl", "sv", "da", "nb", "nn", "no", "is", "af", "lb", "fy"), "Germanic"),
    **dict.fromkeys(("fr", "es", "it", "pt", "pt-br", "pt_br", "pt-pt", "ro", "ca", "gl", "oc", "ast"), "Romance"),
    **dict.fromkeys(("pl", "ru", "cs", "sk", "uk", "be", "bg", "sl", "hr", "sr", "bs", "mk"), "Slavic"),
    **dict.fromkeys(("lt", "lv"), "Baltic"),
    **dict.fromkeys(("fi", "et", "hu"), "Uralic"),
    **dict.fromkeys(("ga", "gd", "cy", "br"), "Celtic"),
    **dict.fromkeys(("hi", "bn", "mr", "gu", "pa", "ne", "si"), "Indo-Aryan"),
    **dict.fromkeys(("fa", "ku"), "Iranian"),
    **dict.fromkeys(("ar", "he", "mt", "am"), "Semitic"),
    **dict.fromkeys(("tr", "az", "kk", "uz", "ky"), "Turkic"),
    **dict.fromkeys(("zh", "zh-cn", "zh_cn", "zh-tw", "zh_tw"), "Sinitic"),
    **dict.fromkeys(("ta", "te", "kn", "ml"), "Dravidian"),
    "el": "Hellenic",
    "ja": "Japonic",
    "ko": "Koreanic",
    "eu": "Basque (isolate)",
    "sq": "Albanian",
    "hy": "Armenian",
    "ka": "Kartvelian",
    "vi": "Austroasiatic",
    "th": "Kra-Dai",
    "id": "Austronesian",
}
"""Language family of each language code; a code not listed is its own family."""


@dataclass
class RoutingAnalysisConfig:
    """Settings of the per-language routing analysis."""

    max_tokens: int = 20_000
    """Token budget per language: whole test documents are taken in order until the first
    language reaches it; every language gets the same documents."""
    batch_size: int = 8
    """Windows of ``seq_len`` tokens per forward."""
    used_fraction: float = 0.5
    """A language uses an expert when it gets >= used_fraction / E of the language's assignments."""
    permutations: int = 2000
    """Label shuffles of the within- vs across-family permutation test."""
    seed: int = 0
    """Seed of the permutation test."""

    def __post_init__(self) -> None:
        for name in ("max_tokens", "batch_size", "permutations"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MoeLitError(f"analysis.{name}: must be a positive integer, got {value!r}")
        if not 0 < self.used_fraction <= 1:
            raise MoeLitError(f"analysis.used_fraction: must be in (0, 1], got {self.used_fraction}")


def family_of(lang: str) -> str:
    return LANGUAGE_FAMILIES.get(lang, LANGUAGE_FAMILIES.get(lang.split("-")[0].split("_")[0], lang))


# ---------------------------------------------------------------------- tracing
def document_windows(token_ids: list[int], seq_len: int) -> list[list[int]]:
    """Consecutive windows of at most ``seq_len`` tokens."""
    return [token_ids[start : start + seq_len] for start in range(0, len(token_ids), seq_len)]


def tokenize_documents(parallel: dict[str, list[dict]], tokenizer, eos_id: int, max_tokens: int) -> dict:
    """``{lang: {doc: tokens}}``, paragraphs each followed by EOS (the training stream format).

    Whole documents are taken in order while the first language stays under ``max_tokens``.
    """
    from moe_lit.evaluation.tasks import documents

    reference = next(iter(parallel.values()))
    chosen: dict[str, dict[Any, list[int]]] = {lang: {} for lang in parallel}
    budget = 0
    for doc, positions in documents(reference).items():
        for lang, paras in parallel.items():
            encoded = tokenizer.encode_batch([paras[p]["text"] for p in positions], add_special_tokens=False)
            chosen[lang][doc] = [token for enc in encoded for token in (*enc.ids, eos_id)]
        budget += len(chosen[next(iter(parallel))][doc])
        if budget >= max_tokens:
            break
    return chosen


@torch.no_grad()
def trace_languages(
    model, token_docs: dict[str, dict[Any, list[int]]], batch_size: int, record_inputs: bool = False
) -> RoutingTrace:
    """Route every document window of every language; labels ``language`` and ``doc`` per window.

    ``record_inputs`` also keeps each MoE layer's input (the pruning scores REAP and NAEE need it)."""
    seq_len = find_transformer(model).config.seq_len
    rows = [
        (lang, doc, window)
        for lang, docs in token_docs.items()
        for doc, tokens in docs.items()
        for window in document_windows(tokens, seq_len)
    ]
    device = next(model.parameters()).device
    with routing_trace(model, record_inputs=record_inputs) as recorder:
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            length = max(len(window) for _, _, window in batch)
            # NOTE: right padding never changes the routing of earlier (real) tokens of a causal,
            # dropless model; padded positions are removed below via the 'length' label.
            idx_BL = torch.zeros(len(batch), length, dtype=torch.long)
            for row, (_, _, window) in enumerate(batch):
                idx_BL[row, : len(window)] = torch.tensor(window)
            recorder.set_labels(
                language=[lang for lang, _, _ in batch],
                doc=[str(doc) for _, doc, _ in batch],
                length=[len(window) for _, _, window in batch],
            )
            model(idx_BL.to(device))
    trace = recorder.trace()
    if not trace.num_layers:
        raise MoeLitError("analyze routing: the model has no MoE layer to analyse")
    lengths_S = torch.tensor(trace.labels["length"])
    return trace.select(trace.pos_N < lengths_S[trace.seq_N])


# ---------------------------------------------------------------------- statistics
def usage_by_language(trace: RoutingTrace, languages: Sequence[str]) -> torch.Tensor:
    """``usage_GME``: per language and layer, the fraction of assignments each expert gets."""
    counts = [trace.where(language=lang).counts_ME().double() for lang in languages]
    counts_GME = torch.stack(counts)
    totals = counts_GME.sum(dim=-1, keepdim=True)
    if (totals == 0).any():
        raise MoeLitError("analyze routing: a language has no traced tokens")
    return counts_GME / totals


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence in bits over the last axis (0 = identical, 1 = disjoint)."""
    mid = (p + q) / 2
    return (_kl_bits(p, mid) + _kl_bits(q, mid)) / 2


def _kl_bits(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    terms = torch.where(p > 0, p * torch.log2(p / q.clamp_min(1e-300)), torch.zeros_like(p))
    return terms.sum(dim=-1)


def language_js(usage_GME: torch.Tensor) -> torch.Tensor:
    """``js_MGG``: JS divergence between every pair of languages, per layer."""
    p = usage_GME.permute(1, 0, 2)[:, :, None, :]
    q = usage_GME.permute(1, 0, 2)[:, None, :, :]
    return js_divergence(p, q).clamp(0.0, 1.0)


def expert_language_entropy(usage_GME: torch.Tensor) -> torch.Tensor:
    """``entropy_ME``: entropy of p(language | expert), normalised by log2(G); NaN for unused experts."""
    mass_ME = usage_GME.sum(dim=0)
    share_GME = usage_GME / mass_ME.clamp_min(1e-300)
    terms = torch.where(share_GME > 0, -share_GME * torch.log2(share_GME), torch.zeros_like(share_GME))
    groups = usage_GME.shape[0]
    entropy_ME = terms.sum(dim=0) / (math.log2(groups) if groups > 1 else 1.0)
    return torch.where(mass_ME > 0, entropy_ME, torch.full_like(entropy_ME, float("nan")))


def classify_experts(usage_GME: torch.Tensor, languages: Sequence[str], used_fraction: float) -> list[dict]:
    """Per layer: shared / language-specific / partly shared / unused experts."""
    num_experts = usage_GME.shape[-1]
    used_GME = usage_GME >= used_fraction / num_experts
    layers = []
    for m in range(usage_GME.shape[1]):
        users_E = used_GME[:, m].sum(dim=0)
        specific = {
            str(e): languages[int(used_GME[:, m, e].nonzero()[0])] for e in range(num_experts) if users_E[e] == 1
        }
        layers.append(
            {
                "shared": [e for e in range(num_experts) if users_E[e] == len(languages)],
                "specific": specific,
                "partial": [e for e in range(num_experts) if 1 < users_E[e] < len(languages)],
                "unused": [e for e in range(num_experts) if users_E[e] == 0],
            }
        )
    return layers


def family_comparison(js_GG: torch.Tensor, languages: Sequence[str], permutations: int, seed: int) -> dict:
    """Mean JS within vs across families and a one-sided permutation p-value for within < across."""
    families = [family_of(lang) for lang in languages]
    pairs = list(itertools.combinations(range(len(languages)), 2))

    def within_across(labels: Sequence[str]) -> tuple[float | None, float | None]:
        within = [float(js_GG[i, j]) for i, j in pairs if labels[i] == labels[j]]
        across = [float(js_GG[i, j]) for i, j in pairs if labels[i] != labels[j]]
        return _mean(within), _mean(across)

    within, across = within_across(families)
    result: dict[str, Any] = {
        "families": dict(zip(languages, families, strict=False)),
        "within_js": within,
        "across_js": across,
    }
    if within is None or across is None:
        result.update(gap=None, p_value=None)
        return result
    rng = random.Random(seed)
    observed = across - within
    shuffled_labels = list(families)
    at_least = 0
    for _ in range(permutations):
        rng.shuffle(shuffled_labels)
        w, a = within_across(shuffled_labels)
        at_least += (a - w) >= observed - 1e-12
    result.update(gap=observed, p_value=(at_least + 1) / (permutations + 1))
    return result


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def cluster_order(js_GG: torch.Tensor) -> list[int]:
    """Leaf order of an average-linkage hierarchical clustering on JS divergence (scipy)."""
    from scipy.cluster.hierarchy import leaves_list, linkage
    from scipy.spatial.distance import squareform

    if js_GG.shape[0] < 3:
        return list(range(js_GG.shape[0]))
    distances = js_GG.double().clone()
    distances.fill_diagonal_(0.0)
    distances = (distances + distances.T) / 2
    return [int(i) for i in leaves_list(linkage(squareform(distances.numpy(), checks=False), method="average"))]


def analyse_routing(trace: RoutingTrace, cfg: RoutingAnalysisConfig, languages: Sequence[str] | None = None) -> dict:
    """Every statistic of the module docstring, as plain JSON-ready data."""
    languages = list(languages or dict.fromkeys(trace.labels["language"]))
    usage_GME = usage_by_language(trace, languages)
    js_MGG = language_js(usage_GME)
    js_GG = js_MGG.mean(dim=0)
    entropy_ME = expert_language_entropy(usage_GME)
    tokens = {lang: trace.where(language=lang).num_tokens for lang in languages}
    return {
        "languages": languages,
        "layer_ids": list(trace.layer_ids),
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "tokens": tokens,
        "usage": {lang: usage_GME[g].tolist() for g, lang in enumerate(languages)},
        "js_divergence": {"per_layer": js_MGG.tolist(), "mean": js_GG.tolist()},
        "cluster_order": [languages[i] for i in cluster_order(js_GG)],
        "mean_js_to_others": dict(
            zip(languages, (js_GG.sum(dim=1) / max(len(languages) - 1, 1)).tolist(), strict=False)
        ),
        "expert_language_entropy": [[None if math.isnan(x) else x for x in row] for row in entropy_ME.tolist()],
        "experts": classify_experts(usage_GME, languages, cfg.used_fraction),
        "family_comparison": family_comparison(js_GG, languages, cfg.permutations, cfg.seed),
        "settings": {"used_fraction": cfg.used_fraction, "permutations": cfg.permutations, "seed": cfg.seed},
    }


# ---------------------------------------------------------------------- report
def routing_summary_markdown(report: dict, title: str) -> str:
    """A short markdown summary: verdict on language families, then per-layer expert tables."""
    from moe_lit.accounting import markdown_table

    fam = report["family_comparison"]
    lines = [f"# Routing analysis: {title}", ""]
    lines.append(
        f"{sum(report['tokens'].values()):,} tokens of the parallel test set "
        f"({', '.join(f'{k} {v:,}' for k, v in report['tokens'].items())}); "
        f"{len(report['layer_ids'])} MoE layers x {report['num_experts']} experts, top-{report['top_k']}."
    )
    lines += ["", "**" + verdict(fam) + "**", ""]
    lines += [f"Clustering order (average linkage on JS): {' '.join(report['cluster_order'])}.", ""]
    isolation = sorted(report["mean_js_to_others"].items(), key=lambda item: -item[1])
    lines.append(
        "Mean JS to the other languages (most distinct routing first): "
        + ", ".join(f"{lang} {js:.3f}" for lang, js in isolation)
        + "."
    )
    lines.append("")
    # NOTE: with one language every used expert is both shared and specific: no split is shown.
    several = len(report["tokens"]) > 1
    rows = []
    for m, layer in enumerate(report["layer_ids"]):
        js = torch.tensor(report["js_divergence"]["per_layer"][m])
        entropies = [x for x in report["expert_language_entropy"][m] if x is not None]
        experts = report["experts"][m]
        row = {
            "layer": layer,
            "mean JS": float(js.sum() / max(js.numel() - js.shape[0], 1)),
            "mean expert language entropy": sum(entropies) / len(entropies) if entropies else float("nan"),
        }
        if several:
            row["shared"] = len(experts["shared"])
            row["partial"] = len(experts["partial"])
            row["specific"] = ", ".join(f"{e}:{lang}" for e, lang in experts["specific"].items()) or "-"
        rows.append({**row, "unused": len(experts["unused"])})
    lines += [markdown_table(rows), ""]
    used = f"{report['settings']['used_fraction']} of a uniform share"
    split = (
        f"; shared = used by every language, specific = by one (used: >= {used})."
        if several
        else (f"; unused = below {used}.")
    )
    lines.append(
        "JS: Jensen-Shannon divergence (bits) between two languages' expert-usage distributions, averaged "
        "over language pairs; entropy of p(language | expert) normalised to [0, 1] (1 = used equally by all "
        "languages)" + split
    )
    return "\n".join(lines) + "\n"


MIN_LANGUAGES = 4
"""Fewer languages than this: the family test is reported *not detected* whatever its p (three
languages have three family labellings, so no permutation p falls below 1/3)."""
ALPHA = 0.05
"""Significance level of the family test."""


def verdict(fam: dict) -> str:
    """One sentence in the studies' verdict vocabulary (*detected* only where the permutation test
    is significant at :data:`ALPHA` with at least :data:`MIN_LANGUAGES` languages; else *not
    detected*, never "do not route more alike"; *untestable here* without two families or a
    family of two), with the test and its n."""
    claim = "Related languages route more alike"
    n = len(fam.get("families") or {})
    if fam["within_js"] is None or fam["across_js"] is None:
        return (
            f"{claim}: untestable here (the permutation test needs two languages of one family and two "
            f"families; n = {n} languages)."
        )
    test = (
        f"mean within-family JS {fam['within_js']:.4f} vs across-family {fam['across_js']:.4f}; one-sided "
        f"permutation test over family labels, n = {n} languages, p = {fam['p_value']:.3f}"
    )
    if n >= MIN_LANGUAGES and fam["p_value"] < ALPHA:
        return f"{claim}: detected ({test})."
    reason = f"; fewer than {MIN_LANGUAGES} languages cannot show it" if n < MIN_LANGUAGES else ""
    return f"{claim}: not detected ({test}{reason})."


__all__ = [
    "LANGUAGE_FAMILIES",
    "RoutingAnalysisConfig",
    "analyse_routing",
    "cluster_order",
    "expert_language_entropy",
    "family_comparison",
    "js_divergence",
    "language_js",
    "routing_summary_markdown",
    "trace_languages",
    "tokenize_documents",
    "usage_by_language",
]
