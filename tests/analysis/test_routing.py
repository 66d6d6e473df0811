import json
import math

import pytest
import torch
from scipy.spatial.distance import jensenshannon

from moe_lit.analysis.routing import (
    RoutingAnalysisConfig,
    analyse_routing,
    family_of,
    js_divergence,
    routing_summary_markdown,
    verdict,
)
from moe_lit.console_script import main
from moe_lit.evaluation.routing_trace import RoutingTrace
from tests.helpers.corpus import LANGUAGES, PARAGRAPHS


def test_js_divergence_matches_scipy_and_its_bounds():
    p = torch.tensor([0.7, 0.2, 0.1, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.1, 0.4, 0.4], dtype=torch.float64)
    assert float(js_divergence(p, q)) == pytest.approx(jensenshannon(p, q, base=2) ** 2, rel=1e-9)
    assert float(js_divergence(p, p)) == 0.0
    assert float(js_divergence(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))) == pytest.approx(1.0)


def synthetic_trace(expert_sets: dict[str, tuple[int, int]], tokens_per_language: int = 12) -> RoutingTrace:
    """One layer, 6 experts, top-2: each language always routes to its pair of experts."""
    langs = list(expert_sets)
    indices = torch.cat([torch.tensor(expert_sets[lang]).repeat(tokens_per_language, 1) for lang in langs])
    n = indices.shape[0]
    return RoutingTrace(
        layer_ids=(0,),
        num_experts=6,
        indices_MNK=indices[None],
        weights_MNK=torch.full((1, n, 2), 0.5),
        seq_N=torch.arange(len(langs)).repeat_interleave(tokens_per_language),
        pos_N=torch.arange(tokens_per_language).repeat(len(langs)),
        tokens_N=torch.zeros(n, dtype=torch.long),
        labels={"language": langs},
    )


def test_related_languages_sharing_experts_are_detected():
    trace = synthetic_trace({"en": (0, 1), "de": (0, 1), "fr": (2, 3), "es": (2, 3), "ru": (4, 0)})
    report = analyse_routing(trace, RoutingAnalysisConfig(permutations=500))
    js = torch.tensor(report["js_divergence"]["mean"])
    assert js[0, 1] == 0 and js[2, 3] == 0 and js[0, 2] == pytest.approx(1.0)
    assert js[0, 4] == pytest.approx(jensenshannon([0.5, 0.5, 0, 0, 0, 0], [0.5, 0, 0, 0, 0.5, 0], base=2) ** 2)
    assert report["usage"]["ru"] == [[0.5, 0.0, 0.0, 0.0, 0.5, 0.0]]
    fam = report["family_comparison"]
    assert fam["within_js"] == 0.0 and fam["across_js"] > 0.5
    assert fam["p_value"] < 0.05
    assert verdict(fam) == (
        "Related languages route more alike: detected (mean within-family JS 0.0000 vs across-family "
        f"{fam['across_js']:.4f}; one-sided permutation test over family labels, n = 5 languages, "
        f"p = {fam['p_value']:.3f})."
    )
    experts = report["experts"][0]
    assert experts["specific"] == {"4": "ru"} and experts["unused"] == [5] and experts["shared"] == []
    assert sorted(experts["partial"]) == [0, 1, 2, 3]
    # expert 0: en, de, ru use it equally -> entropy log2(3)/log2(5); expert 4 only ru -> 0; expert 5 unused
    entropy = report["expert_language_entropy"][0]
    assert entropy[0] == pytest.approx(math.log2(3) / math.log2(5)) and entropy[4] == 0.0 and entropy[5] is None
    mean_js = report["mean_js_to_others"]
    assert mean_js["fr"] == pytest.approx(0.75) and mean_js["ru"] == pytest.approx((2 * float(js[0, 4]) + 2) / 4)
    order = report["cluster_order"]
    assert abs(order.index("en") - order.index("de")) == 1 and abs(order.index("fr") - order.index("es")) == 1


def test_no_family_structure_is_reported_as_such():
    trace = synthetic_trace({"en": (0, 1), "de": (2, 3), "fr": (0, 1), "es": (2, 3)})
    fam = analyse_routing(trace, RoutingAnalysisConfig(permutations=200))["family_comparison"]
    assert fam["within_js"] > fam["across_js"]
    assert verdict(fam).startswith("Related languages route more alike: not detected (mean within-family JS")
    two = synthetic_trace({"en": (0, 1), "fr": (2, 3)})
    single = analyse_routing(two, RoutingAnalysisConfig())["family_comparison"]
    assert verdict(single) == (
        "Related languages route more alike: untestable here (the permutation test needs two languages of one "
        "family and two families; n = 2 languages)."
    )
    assert family_of("pt-br") == "Romance" and family_of("xx") == "xx"


def test_analyze_routing_command_writes_the_report(tmp_path, exported, prepared_dir, tiny_moe):
    from tokenizers import Tokenizer

    args = ["analyze", "routing", "--checkpoint", str(exported), "--data", str(prepared_dir)]
    out = tmp_path / "tiny"
    assert main([*args, "--out", str(out), "--save-trace"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["routing.json", "similarity.png", "summary.md", "trace.pt", "usage_layer0.png", "usage_layer1.png"]
    report = json.loads((out / "routing.json").read_text())
    tokenizer = Tokenizer.from_file(str(prepared_dir / "tokenizer.json"))
    for lang in LANGUAGES:  # every paragraph + EOS, no padding
        assert report["tokens"][lang] == sum(len(tokenizer.encode(t).ids) + 1 for t in PARAGRAPHS[lang])
    trace = RoutingTrace.load(out / "trace.pt")
    assert trace.num_tokens == sum(report["tokens"].values())
    usage_en = trace.where(language="en").counts_ME().double()
    assert torch.allclose(usage_en / usage_en.sum(-1, keepdim=True), torch.tensor(report["usage"]["en"]).double())
    summary = (out / "summary.md").read_text()
    assert "within-family JS" in summary and "moe-lit analyze routing" in summary


def test_missing_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    assert main(["analyze", "routing", "--checkpoint", str(tmp_path / "none.ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no such file" in err


def test_three_languages_are_never_detected_and_one_language_has_no_shared_specific_split():
    three = synthetic_trace({"en": (0, 1), "de": (0, 1), "ru": (2, 3)})  # related ones alike, as it can be
    fam = analyse_routing(three, RoutingAnalysisConfig(permutations=200))["family_comparison"]
    assert fam["within_js"] == 0.0 and fam["across_js"] == pytest.approx(1.0) and fam["p_value"] > 0.3
    line = verdict(fam)
    assert line.startswith("Related languages route more alike: not detected (") and "n = 3 languages" in line
    assert line.endswith("; fewer than 4 languages cannot show it).") and "do not" not in line
    report = analyse_routing(synthetic_trace({"en": (0, 1)}), RoutingAnalysisConfig())
    summary = routing_summary_markdown(report, "one")
    assert "untestable here" in summary and "n = 1 languages" in summary
    header = next(line for line in summary.splitlines() if line.startswith("| layer"))
    assert "shared" not in header and "specific" not in header and "unused" in header
    assert "shared = used by every language" not in summary
