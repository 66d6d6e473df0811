"""Shared fixtures: a tiny BPE tokenizer, a tiny exported MoE model and a tiny parallel corpus.

The corpus follows the data pipeline's prepared-dir contract: ``meta.json``, ``tokenizer.json`` and
``text/<split>/<lang>.jsonl`` with one ``{"id", "doc", "text"}`` per paragraph, parallel ids.
"""

import json

import pytest
import torch

from moe_lit.checkpoint import export_model
from moe_lit.model import Transformer
from tests.conftest import tiny

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


@pytest.fixture(scope="session")
def prepared_dir(tmp_path_factory):
    """A prepared data dir: meta.json, a byte-level BPE tokenizer.json, parallel test text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("prepared")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([text for texts in PARAGRAPHS.values() for text in texts], trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "meta.json").write_text(
        json.dumps({"languages": list(LANGUAGES), "vocab_size": tokenizer.get_vocab_size()})
    )
    for lang in LANGUAGES:
        split_dir = root / "text" / "test"
        split_dir.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(record, ensure_ascii=False) for record in paragraph_records(lang)]
        (split_dir / f"{lang}.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="session")
def tiny_moe(prepared_dir):
    """A seeded tiny MoE Transformer whose vocabulary fits the fixture tokenizer."""
    vocab = json.loads((prepared_dir / "meta.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    return Transformer(tiny(vocab_size=vocab, seq_len=32)).eval()


@pytest.fixture(scope="session")
def exported(tmp_path_factory, tiny_moe, prepared_dir):
    """The tiny model exported with its tokenizer (a checkpoint directory)."""
    return export_model(tiny_moe, tmp_path_factory.mktemp("ckpt") / "tiny-moe", prepared_dir / "tokenizer.json")
