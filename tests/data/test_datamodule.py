import json
import shutil
from collections import Counter
from itertools import islice

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

from moe_lit.data.layout import read_meta, tokenizer_file
from moe_lit.data.tokenizer import load_tokenizer
from moe_lit.errors import MoeLitError
from moe_lit.lit.datamodule import MoEDataModule
from tests.helpers.corpus import VOCAB, language_of

SEQ = 16


def _dm(prepared, **kwargs):
    return MoEDataModule(str(prepared), **{"seq_len": SEQ, "batch_size": 4, **kwargs})


def _batches(loader, n):
    return [batch.clone() for batch in islice(iter(loader), n)]


def test_contract_attributes_and_shapes(prepared):
    dm = _dm(prepared)
    assert dm.vocab_size == VOCAB and dm.languages == ["de", "en", "ru"]
    assert dm.tokenizer_path == tokenizer_file(prepared)
    assert dm.hparams["data_dir"] == str(prepared)
    batch = next(iter(dm.train_dataloader()))
    assert batch.dtype == torch.long and batch.shape == (4, SEQ + 1)
    assert 0 <= int(batch.min()) and int(batch.max()) < dm.vocab_size


def test_eval_loaders_one_per_language_in_order(prepared):
    dm = _dm(prepared, languages=["ru", "en"], val_batches=3)
    tokenizer = load_tokenizer(dm.tokenizer_path)
    val = dm.val_dataloader()
    assert len(val) == 2
    for lang, loader in zip(["ru", "en"], val, strict=False):
        batches = list(loader)
        assert len(batches) == 3 and all(b.shape == (4, SEQ + 1) for b in batches)
        assert {language_of(tokenizer.decode(row.tolist())) for b in batches for row in b} == {lang}
    assert all(torch.equal(a, b) for a, b in zip(val[0], dm.val_dataloader()[0], strict=False))  # fixed blocks
    test = dm.test_dataloader()
    blocks = read_meta(prepared)["tokens"]["test"]["en"] // (SEQ + 1)
    assert sum(len(b) for b in test[1]) == blocks


def test_default_mixture_is_proportional_to_training_tokens(prepared):
    train = read_meta(prepared)["tokens"]["train"]
    total = sum(train.values())
    assert _dm(prepared).mixture == pytest.approx({lang: n / total for lang, n in train.items()})
    assert _dm(prepared, language_weights={"en": 1.0, "ru": 3.0}).mixture == {"en": 0.25, "ru": 0.75}


def test_mixing_weights_are_honoured(prepared):
    weights = {"en": 0.6, "de": 0.3, "ru": 0.1}
    dm = _dm(prepared, language_weights=weights, batch_size=8)
    tokenizer = load_tokenizer(dm.tokenizer_path)
    rows = [row for batch in _batches(dm.train_dataloader(), 40) for row in batch]
    counts = Counter(language_of(tokenizer.decode(row.tolist())) for row in rows)
    for lang, weight in weights.items():
        assert abs(counts[lang] / len(rows) - weight) < 0.06, counts


def test_deterministic_given_seed(prepared):
    first = _batches(_dm(prepared, seed=3).train_dataloader(), 3)
    assert all(
        torch.equal(a, b) for a, b in zip(first, _batches(_dm(prepared, seed=3).train_dataloader(), 3), strict=False)
    )
    assert not torch.equal(first[0], _batches(_dm(prepared, seed=4).train_dataloader(), 1)[0])


@pytest.mark.parametrize("num_workers", [0, 2])  # workers serve val/test; training stays exact
def test_state_round_trip_resumes_with_the_next_batches(prepared, num_workers):
    dm = _dm(prepared, num_workers=num_workers)
    loader = dm.train_dataloader()
    iterator = iter(loader)
    seen = [next(iterator).clone() for _ in range(3)]
    state = dm.state_dict()
    expected = [next(iterator).clone() for _ in range(3)]
    del iterator

    resumed = _dm(prepared, num_workers=num_workers)
    resumed.load_state_dict(state)
    got = _batches(resumed.train_dataloader(), 3)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=False))
    assert not torch.equal(got[0], seen[0])


def test_missing_data_dir_says_how_to_create_it(tmp_path):
    with pytest.raises(MoeLitError, match=r"moe-lit data prepare --out .*missing"):
        MoEDataModule(str(tmp_path / "missing"))


def test_tokenizer_vocab_mismatch(prepared, tmp_path):
    copy = shutil.copytree(prepared, tmp_path / "copy")
    meta = json.loads((copy / "meta.json").read_text())
    (copy / "meta.json").write_text(json.dumps({**meta, "vocab_size": 512}))
    with pytest.raises(MoeLitError, match="tokenizer/vocab mismatch"):
        MoEDataModule(str(copy))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"languages": ["en", "xx"]}, "languages: .*xx.* available: de, en, ru"),
        ({"language_weights": {"fr": 1.0}}, "language_weights: unknown language"),
        ({"language_weights": {"en": -1.0}}, "language_weights: need finite weights"),
        ({"seq_len": 100_000}, "seq_len 100000: the train split"),
        ({"batch_size": 0}, "batch_size: must be an integer >= 1"),
    ],
)
def test_bad_arguments(prepared, kwargs, match):
    with pytest.raises(MoeLitError, match=match):
        _dm(prepared, **kwargs)


class _Recorder(LightningModule):
    """A one-parameter module that records the batches it trains on."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.clone())
        return (self.weight * batch.float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(prepared, max_steps, ckpt_path=None, save_to=None):
    trainer = Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    module = _Recorder()
    trainer.fit(module, datamodule=_dm(prepared), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return module.seen


def test_lightning_resume_continues_the_stream(prepared, tmp_path):
    straight = _fit(prepared, 6)
    _fit(prepared, 3, save_to=tmp_path / "step3.ckpt")
    ckpt = torch.load(tmp_path / "step3.ckpt", weights_only=True)
    assert ckpt["datamodule_hyper_parameters"]["data_dir"] == str(prepared)
    resumed = _fit(prepared, 6, ckpt_path=tmp_path / "step3.ckpt")
    assert len(resumed) == 3
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight[3:], strict=False))


def test_epoch_has_len_full_batches_and_resumes_across_its_end(prepared):
    dm = _dm(prepared, batch_size=8)
    loader = dm.train_dataloader()
    epoch1 = [batch.clone() for batch in loader]
    assert len(epoch1) == len(loader) > 10 and all(b.shape == (8, SEQ + 1) for b in epoch1)
    end_state = dm.state_dict()
    drawn = sum(map(sum, end_state["train_loader"]["num_samples_yielded"].values()))
    assert 0 <= drawn - len(loader) * 8 < 8  # the epoch length is exact: only a partial tail is dropped
    epoch2 = _batches(loader, 2)
    assert not torch.equal(epoch2[0], epoch1[0])  # reshuffled

    resumed = _dm(prepared, batch_size=8)
    resumed.load_state_dict(end_state)
    assert all(torch.equal(a, b) for a, b in zip(_batches(resumed.train_dataloader(), 2), epoch2, strict=False))
