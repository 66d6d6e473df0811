from moe_lit.data.corpus import Paragraph, cap, clean, local_paragraphs, normalize, split_of, split_paragraphs
from moe_lit.data.debian import page_paragraphs

PAGE = """<!DOCTYPE html><html><body><div id="DisplayArea">
<h1 id="hd_id1" dir="auto">Optionen   Laden</h1>
<p id="par_id2" class="paragraph">Wählen Sie <span class="switchinline"><span hidden="true" id="MACx" class="MAC">
LibreOffice – Einstellungen</span><span hidden="true" id="defaultx">Extras – Optionen</span></span> – Laden.</p>
<p id="par_id3" class="paragraph">Erste Zeile.<br>Zweite Zeile.</p>
<p id="par_id4" class="code">print("code")</p>
<p id="par_id2" class="paragraph">repeated id</p>
<p class="paragraph">no id</p>
</div></body></html>"""


def test_page_paragraphs_keeps_default_switch_breaks_lines_and_skips_code(tmp_path):
    page = tmp_path / "page.html"
    page.write_text(PAGE, encoding="utf-8")
    got = list(page_paragraphs(page, "text/x/page.html"))
    assert [(p.id, p.doc, p.pos, p.text) for p in got] == [
        ("text/x/page.html#hd_id1", "text/x/page.html", 0, "Optionen Laden"),
        ("text/x/page.html#par_id2", "text/x/page.html", 1, "Wählen Sie Extras – Optionen – Laden."),
        ("text/x/page.html#par_id3", "text/x/page.html", 2, "Erste Zeile. Zweite Zeile."),
    ]


def test_clean_normalises_drops_fallbacks_and_duplicates():
    pars = [
        Paragraph("a", "d", 0, "  Hallo \n Welt "),
        Paragraph("b", "d", 1, "Hello"),  # untranslated: equals the English text of id b
        Paragraph("c", "d", 2, "Hallo Welt"),  # duplicate text of a
        Paragraph("d", "d", 3, "   "),
        Paragraph("e", "d", 4, "Tschüss"),
    ]
    kept = clean(pars, fallback={"b": "Hello", "e": "Bye"})
    assert [(p.id, p.text) for p in kept] == [("a", "Hallo Welt"), ("e", "Tschüss")]
    assert normalize("x\t\n y") == "x y"


def test_split_is_a_function_of_the_id_with_the_requested_fractions():
    ids = [f"doc{i // 50}.html#par_id{i}" for i in range(20_000)]
    splits = [split_of(pid, 0.05, 0.1) for pid in ids]
    assert splits == [split_of(pid, 0.05, 0.1) for pid in ids]
    assert abs(splits.count("val") / len(ids) - 0.05) < 0.006
    assert abs(splits.count("test") / len(ids) - 0.1) < 0.008
    pars = [Paragraph(pid, "d", i, pid) for i, pid in enumerate(ids[:1000])]
    by_split = split_paragraphs(pars, 0.05, 0.1)
    assert sorted(p.id for ps in by_split.values() for p in ps) == sorted(ids[:1000])
    assert [p.pos for p in by_split["train"]] == sorted(p.pos for p in by_split["train"])  # document order


def test_cap_prefers_ids_every_language_has():
    en = [Paragraph(f"p{i}", "d", i, f"en {i}") for i in range(100)]
    de = [Paragraph(f"p{i}", "d", i, f"de {i}") for i in range(0, 100, 2)]  # half translated
    capped = cap({"en": en, "de": de}, 20)
    assert len(capped["en"]) == len(capped["de"]) == 20
    assert [p.id for p in capped["en"]] == [p.id for p in capped["de"]]
    assert cap({"en": en}, None)["en"] is en


def test_local_paragraphs_split_at_blank_lines(tmp_path):
    (tmp_path / "fr").mkdir()
    (tmp_path / "fr" / "b.txt").write_text("un\ndeux\n\n\n  \ntrois\n", encoding="utf-8")
    (tmp_path / "fr" / "a.txt").write_text("zéro", encoding="utf-8")
    got = [(p.id, p.doc, p.pos, p.text) for p in local_paragraphs(tmp_path, "fr")]
    assert got == [
        ("a.txt#0", "a.txt", 0, "zéro"),
        ("b.txt#0", "b.txt", 0, "un\ndeux"),
        ("b.txt#1", "b.txt", 1, "trois"),
    ]
