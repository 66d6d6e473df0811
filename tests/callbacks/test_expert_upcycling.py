import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from moe_lit.callbacks.dense_upcycling import DenseToMoEUpcycling
from moe_lit.callbacks.expert_upcycling import ExpertUpcycling
from moe_lit.config import ConfigError
from moe_lit.convert.expand import ExpansionConfig
from moe_lit.errors import MoeLitError
from moe_lit.lit.module import MoELitModule
from moe_lit.lit.optim import OptimConfig
from tests.helpers.models import tiny

OPTIM = OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine")


def _state_by_name(trainer, pl_module) -> dict:
    names = {id(p): n for n, p in pl_module.model.named_parameters()}
    state = trainer.optimizers[0].state
    return {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in state.items()}


class Recorder(pl.Callback):
    """Learning rate of every step; the optimizer state by name just before and just after a swap."""

    def __init__(self, at_step: int = -1) -> None:
        self.at_step, self.lrs = at_step, []
        self.last_state = self.state_before = self.state_after = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # runs after the swap
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        if trainer.global_step == self.at_step:
            self.state_before, self.state_after = self.last_state, _state_by_name(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.last_state = _state_by_name(trainer, pl_module)


def _loader(cfg) -> DataLoader:
    # NOTE: the same batch every step: a resumed run sees the same data as an uninterrupted one.
    batch = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    return DataLoader([batch] * 64, batch_size=None)


def _fit(cfg, callbacks, max_steps, ckpt_path=None, module=None):
    torch.manual_seed(0)
    module = module or MoELitModule(cfg, OPTIM)
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(module, train_dataloaders=_loader(cfg), ckpt_path=ckpt_path)
    return trainer, module


def test_expansion_mid_run_keeps_function_schedule_and_copies_moments():
    cfg = tiny(top_k=1, balancing="bias")
    grow = ExpertUpcycling(at_steps=[3], expansion={"factor": 2, "noise": 0.0})
    recorder = Recorder(at_step=3)
    trainer, module = _fit(cfg, [grow, recorder], max_steps=6)
    _, baseline = _fit(cfg, [reference := Recorder()], max_steps=6)
    assert module.model.config.moe.num_experts == 8
    assert module.hparams["model"].moe.num_experts == 8 and module.config.moe.num_experts == 8
    (event,) = grow.events
    assert event["step"] == 3 and event["num_experts"] == 8
    assert event["loss_after"] == pytest.approx(event["loss_before"], abs=1e-6)  # top-1: exact
    assert recorder.lrs == pytest.approx(reference.lrs)  # the LR schedule went on where it was
    before, after = recorder.state_before, recorder.state_after
    w1 = "blocks.0.ffn.experts.mlp.w1"
    assert torch.equal(after[w1]["exp_avg"], before[w1]["exp_avg"].repeat(2, 1))
    assert torch.equal(after[w1]["step"], before[w1]["step"])
    router = "blocks.1.ffn.router.layer.weight"
    assert torch.equal(after[router]["exp_avg_sq"], before[router]["exp_avg_sq"].repeat(2, 1))
    assert torch.equal(after["tok_embeddings.weight"]["exp_avg"], before["tok_embeddings.weight"]["exp_avg"])
    assert event["row_sources"][router] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert not torch.equal(
        module.model.blocks[0].ffn.experts.mlp.w1[:64], module.model.blocks[0].ffn.experts.mlp.w1[64:]
    )


def test_reset_starts_every_tensor_fresh():
    recorder = Recorder(at_step=2)
    _fit(tiny(top_k=1), [ExpertUpcycling(at_steps=[2], optimizer_state="reset"), recorder], max_steps=3)
    assert recorder.state_before and recorder.state_after == {}


class SaveAt(pl.Callback):
    def __init__(self, step: int, path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def test_checkpoint_after_expansion_resumes_into_the_expanded_shape(tmp_path):
    cfg = tiny(top_k=2)

    def grow():
        return ExpertUpcycling(
            at_steps=[2],
            expansion={"factor": 2, "selection": "utility", "balancing": None, "noise": 0.0},
            utility_batches=2,
        )

    _, straight = _fit(cfg, [grow(), SaveAt(4, tmp_path / "mid.ckpt")], max_steps=6)
    resumed_grow = grow()
    _, resumed = _fit(cfg, [resumed_grow], max_steps=6, ckpt_path=tmp_path / "mid.ckpt")
    assert len(resumed_grow.events) == 1 and resumed_grow.events[0]["step"] == 2  # restored, not redone
    assert resumed.model.config.moe.num_experts == 8
    for (name, a), b in zip(resumed.model.state_dict().items(), straight.model.state_dict().values(), strict=False):
        assert torch.allclose(a, b, atol=1e-6), name


def test_dense_to_moe_mid_run_is_exact_keeps_attention_moments_and_can_grow_again():
    recorder = Recorder(at_step=2)
    upcycle = DenseToMoEUpcycling(
        at_step=2, upcycling={"recipe": "granular", "num_experts": 4, "top_k": 2, "granularity": 2}
    )
    grow = ExpertUpcycling(at_steps=[3], expansion={"factor": 2})
    _, module = _fit(tiny(dense=True), [upcycle, grow, recorder], max_steps=4)
    (event,) = upcycle.events
    assert event["loss_after"] == pytest.approx(event["loss_before"], abs=1e-5)
    assert event["num_experts"] == 4 and grow.events[0]["num_experts"] == 8
    assert module.model.config.moe.num_experts == 8 and module.hparams["model"].moe.expert_size == 32
    q = "blocks.0.attn.q_proj.weight"
    assert torch.equal(recorder.state_after[q]["exp_avg"], recorder.state_before[q]["exp_avg"])
    assert "blocks.0.ffn.experts.mlp.w1" not in recorder.state_after


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ExpertUpcycling(at_steps=[]), r"ExpertUpcycling.at_steps: need one or more integers >= 1"),
        (lambda: ExpertUpcycling(at_steps=[5, 3]), "must be strictly increasing"),
        (
            lambda: ExpertUpcycling(at_steps=[2], expansion={"factor": 1}),
            "ExpertUpcycling.expansion.factor: must be an integer >= 2",
        ),
        (lambda: ExpertUpcycling(at_steps=[2], optimizer_state="keep"), "allowed values: copy, reset"),
        (
            lambda: ExpertUpcycling(at_steps=[2], expansion={"factor": 2, "selection": "best"}),
            "ExpertUpcycling.expansion.selection: got 'best'",
        ),
        (
            lambda: ExpertUpcycling(at_steps=[2], expansion={"fator": 2}),
            r"ExpertUpcycling.expansion: unknown key\(s\) \['fator'\], allowed keys: \['factor', ",
        ),
        (
            lambda: ExpertUpcycling(at_steps=[2], expansion={"factor": 2, "counts": [2, 1]}),
            "ExpertUpcycling.expansion.factor/counts: give exactly",
        ),
        (
            lambda: ExpertUpcycling(at_steps=[2], expansion=ExpansionConfig(counts=[2, 1])),
            "ExpertUpcycling.expansion.counts: the expert count grows at every step; give a factor",
        ),
        (lambda: DenseToMoEUpcycling(at_step=0), r"DenseToMoEUpcycling.at_steps: need one or more integers >= 1"),
        (
            lambda: DenseToMoEUpcycling(at_step=2, upcycling={"recipe": "split"}),
            "DenseToMoEUpcycling.upcycling.recipe: got 'split'",
        ),
        (
            lambda: DenseToMoEUpcycling(
                at_step=2, upcycling={"recipe": "granular", "num_experts": 6, "granularity": 4}
            ),
            "DenseToMoEUpcycling.upcycling.num_experts: must be a multiple of granularity=4",
        ),
    ],
)
def test_bad_arguments_fail_at_construction(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_bad_upcycling_shape_fails_at_setup_not_mid_run():
    grow = DenseToMoEUpcycling(
        at_step=5, upcycling={"recipe": "granular", "num_experts": 6, "top_k": 3, "granularity": 3}
    )
    with pytest.raises(ConfigError, match="model.d_ff: must be a multiple of granularity=3, got 64"):
        _fit(tiny(dense=True), [grow], max_steps=6)
    with pytest.raises(MoeLitError, match="the model is dense; add a DenseToMoEUpcycling callback"):
        _fit(tiny(dense=True), [ExpertUpcycling(at_steps=[2])], max_steps=6)


def test_a_model_upcycled_by_dense_to_moe_with_its_defaults_exports_to_transformers_and_generates(tmp_path):
    transformers = pytest.importorskip("transformers")
    from moe_lit.checkpoint import export_model
    from moe_lit.console_script import main

    cfg = tiny(dense=True, n_kv_heads=2, d_ff=16)
    _, module = _fit(cfg, [DenseToMoEUpcycling(at_step=1, upcycling={"num_experts": 4})], 3)
    ours = module.model.eval()
    assert ours.config.moe.num_experts == 4 and not ours.config.moe.expert_output_bias
    export_model(ours, tmp_path / "ours")
    assert (
        main(["export", "--checkpoint", str(tmp_path / "ours"), "--format", "mixtral", "--out", str(tmp_path / "hf")])
        == 0
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    prompt = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(hf(prompt).logits, ours(prompt).logits_BLV, atol=1e-4)
        generated = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert generated.shape == (2, 10) and torch.equal(generated[:, :6], prompt)


def test_the_transform_config_comes_as_an_object_or_a_mapping():
    from moe_lit.convert.dense_to_moe import UpcyclingConfig

    expansion = ExpansionConfig(factor=4, noise=0.0, selection="utility")
    by_mapping = ExpertUpcycling(at_steps=[2], expansion={"factor": 4, "noise": 0.0, "selection": "utility"})
    assert ExpertUpcycling(at_steps=[2], expansion=expansion).expansion == by_mapping.expansion == expansion
    upcycling = UpcyclingConfig(recipe="granular", num_experts=4, granularity=2)
    by_object = DenseToMoEUpcycling(at_step=1, upcycling=upcycling)
    by_mapping_up = DenseToMoEUpcycling(at_step=1, upcycling={"recipe": "granular", "num_experts": 4, "granularity": 2})
    assert by_object.upcycling == by_mapping_up.upcycling
    assert by_object.upcycling.moe == {"expert_output_bias": False}
    with pytest.raises(TypeError, match="factor"):
        ExpertUpcycling(at_steps=[2], factor=4)  # type: ignore[call-arg]  # one way in: the config
