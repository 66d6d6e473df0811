"""Two tiny corpora.

* ``write_corpus``: random words in three scripts (en: a-h, de: j-q, ru: Cyrillic), so the language
  of any decoded token block is visible from its characters (``language_of``);
* ``PARAGRAPHS``: two documents of four parallel help-text paragraphs in en/de/fr, the
  prepared-dir ``text/<split>/<lang>.jsonl`` records of ``paragraph_records``.
"""

import random

ALPHABETS = {"en": "abcdefgh", "de": "jklmnopq", "ru": "абвгдежз"}
FILES = 4
PARAGRAPHS_PER_FILE = 60
VOCAB = 300


def write_corpus(root, alphabets=ALPHABETS, files=FILES, paragraphs=PARAGRAPHS_PER_FILE, seed=0):
    """``root/<lang>/doc<i>.txt``: the same file names and paragraph counts in every language."""
    rng = random.Random(seed)
    for lang, letters in alphabets.items():
        (root / lang).mkdir(parents=True)
        for i in range(files):
            pars = []
            for _ in range(paragraphs):
                words = ["".join(rng.choices(letters, k=rng.randint(2, 6))) for _ in range(rng.randint(15, 30))]
                pars.append(" ".join(words[:10]) + "\n" + " ".join(words[10:]))
            (root / lang / f"doc{i}.txt").write_text("\n\n".join(pars) + "\n", encoding="utf-8")
    return root


def prepare_corpus(root, paragraphs: int, val_fraction: float, test_fraction: float):
    """``moe-lit data prepare`` (vocabulary 300) of a 2-file :func:`write_corpus` under ``root``;
    the prepared directory ``root/data``."""
    from moe_lit.data.prepare import PrepareConfig, prepare

    corpus = write_corpus(root / "corpus", files=2, paragraphs=paragraphs)
    config = PrepareConfig(
        source=str(corpus),
        out=root / "data",
        vocab_size=VOCAB,
        val_fraction=val_fraction,
        test_fraction=test_fraction,
        progress=False,
    )
    prepare(config)
    return root / "data"


def language_of(text: str) -> str:
    """The fixture language whose letters occur in ``text`` (exactly one must)."""
    found = [lang for lang, letters in ALPHABETS.items() if any(ch in letters for ch in text)]
    assert len(found) == 1, (text, found)
    return found[0]


# Two documents of four paragraphs, in three languages (en/de Germanic, fr Romance).
PARAGRAPHS = {
    "en": [
        "Open the file menu and choose save.",
        "The document is written to the disk.",
        "You can close the window now.",
        "Press the help key for more information.",
        "Insert a table with three rows.",
        "Each cell can hold text or numbers.",
        "Select a cell to change its format.",
        "The sum appears in the last row.",
    ],
    "de": [
        "Öffnen Sie das Menü Datei und wählen Sie Speichern.",
        "Das Dokument wird auf die Festplatte geschrieben.",
        "Sie können das Fenster jetzt schließen.",
        "Drücken Sie die Hilfetaste für weitere Informationen.",
        "Fügen Sie eine Tabelle mit drei Zeilen ein.",
        "Jede Zelle kann Text oder Zahlen enthalten.",
        "Wählen Sie eine Zelle, um ihr Format zu ändern.",
        "Die Summe erscheint in der letzten Zeile.",
    ],
    "fr": [
        "Ouvrez le menu fichier et choisissez enregistrer.",
        "Le document est écrit sur le disque.",
        "Vous pouvez fermer la fenêtre maintenant.",
        "Appuyez sur la touche aide pour plus d'informations.",
        "Insérez un tableau de trois lignes.",
        "Chaque cellule peut contenir du texte ou des nombres.",
        "Sélectionnez une cellule pour changer son format.",
        "La somme apparaît dans la dernière ligne.",
    ],
}
LANGUAGES = tuple(PARAGRAPHS)
EOT = "<|endoftext|>"


def paragraph_records(lang):
    return [{"id": f"p{i}", "doc": f"d{i // 4}", "text": text} for i, text in enumerate(PARAGRAPHS[lang])]
