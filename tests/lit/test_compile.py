"""``train.compile``: compiled blocks train exactly as eager ones, keep their checkpoint keys, compile
once for dropless routing, recompile after a model swap; bad values are one-line errors.

The tests that compile are ``slow`` (inductor's first compile of even a tiny block takes seconds);
they share one tiny config so that inductor's FX graph cache serves later runs.
"""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from moe_lit.callbacks.compile import CompileBlocks, compile_cost
from moe_lit.callbacks.expert_upcycling import ExpertUpcycling
from moe_lit.config import ConfigError
from moe_lit.console_script import main
from moe_lit.lit.module import MoELitModule
from moe_lit.lit.optim import OptimConfig
from moe_lit.lit.run_config import RunConfig, TrainConfig
from moe_lit.lit.trainer import trainer_arguments
from moe_lit.model import Transformer
from moe_lit.model.compile import INDUCTOR_CACHE_ENV, compile_blocks, is_compiled, use_inductor_cache_dir
from tests.helpers.models import tiny
from tests.lit.fakes import RandomTokenDataModule

OPTIM = OptimConfig(lr=1e-2, warmup_steps=1, schedule="constant")
EXPERIMENT = str(Path(__file__).resolve().parents[2] / "configs/experiments/tiny-moe.yaml")


def _cfg():
    return tiny(vocab_size=64)


class LossRecorder(pl.Callback):
    """The training loss of every step and dynamo's count of compiled frames after it."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.frames: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.frames.append(counters["frames"]["total"])


def _fit(cfg, callbacks, max_steps, ckpt_path=None):
    torch.manual_seed(0)
    module = MoELitModule(cfg, OPTIM)
    recorder = LossRecorder()
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[recorder, *callbacks],
    )
    data = RandomTokenDataModule(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, module, recorder


# ---------------------------------------------------------------------------------- fast
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_non_boolean_compile_is_a_config_error_naming_the_field(value):
    with pytest.raises(ConfigError, match=r"^compile: must be true or false"):
        TrainConfig(max_steps=1, compile=value)
    with pytest.raises(ConfigError, match=r"^train\.compile: must be true or false") as info:
        RunConfig(train={"max_steps": 1, "compile": value})
    assert len(str(info.value).splitlines()) == 1


def test_a_non_boolean_compile_on_the_command_line_is_one_line_exit_2(capsys):
    code = main(["fit", "--config", EXPERIMENT, "--train.compile", "maybe"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "train.compile" in err, err


def test_an_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match=r"CompileBlocks.backend: got 'tvm'"):
        CompileBlocks(backend="tvm")


def test_compiling_blocks_keeps_the_state_dict_keys_and_compiles_each_block_once():
    torch.manual_seed(0)
    model = Transformer(_cfg())
    keys = list(model.state_dict())
    assert compile_blocks(model, backend="aot_eager") == len(model.blocks)
    assert all(is_compiled(block) for block in model.blocks) and not is_compiled(model)
    assert list(model.state_dict()) == keys and not any("_orig_mod" in key for key in keys)
    assert compile_blocks(model, backend="aot_eager") == 0


def test_the_inductor_cache_defaults_under_the_user_cache_and_an_explicit_setting_wins(monkeypatch, tmp_path):
    ours = str(Path("~/.cache/moe_lit/inductor").expanduser())
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    assert use_inductor_cache_dir() == ours
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, default_cache_dir())  # what importing Lightning leaves there
    assert use_inductor_cache_dir() == ours
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path))
    assert use_inductor_cache_dir() == str(tmp_path)


def test_the_trainer_builder_adds_the_compile_callback_after_every_other_one(tmp_path):
    run = RunConfig(train={"max_steps": 2, "compile": True})
    swap, model = ExpertUpcycling(at_steps=[1]), Transformer(_cfg())
    callbacks = trainer_arguments(run, tmp_path, model, [swap])["callbacks"]
    kinds = [type(c) for c in callbacks]
    assert CompileBlocks in kinds and kinds.index(CompileBlocks) > kinds.index(ExpertUpcycling)
    plain = trainer_arguments(RunConfig(train={"max_steps": 2}), tmp_path, model)["callbacks"]
    assert not any(isinstance(c, CompileBlocks) for c in plain)


# ---------------------------------------------------------------------------------- compiling
@pytest.mark.slow
def test_compiled_training_repeats_the_eager_losses_and_its_weights_load_into_an_eager_model(tmp_path):
    cfg = _cfg()
    _, eager, eager_losses = _fit(cfg, [], max_steps=3)
    trainer, compiled, compiled_losses = _fit(cfg, [CompileBlocks()], max_steps=3)
    assert all(is_compiled(block) for block in compiled.model.blocks)
    torch.testing.assert_close(compiled_losses.losses, eager_losses.losses, rtol=1e-5, atol=1e-6)
    path = tmp_path / "compiled.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["state_dict"]
    assert list(state) == list(eager.state_dict())
    reloaded = Transformer(compiled.config)
    reloaded.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    idx_BL = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    compiled.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(idx_BL).logits_BLV, compiled.model(idx_BL).logits_BLV, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(reloaded(idx_BL).logits_BLV, eager.model(idx_BL).logits_BLV, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "moe_fields",
    [
        {"capacity_factor": 1.0, "balancing": "bias", "bias_update_rate": 0.01},  # drops; biased selection
        {"score_func": "sigmoid", "shared_expert_size": 16, "z_loss_coef": 1e-3},  # DeepSeek-style options
    ],
    ids=["capacity-bias", "sigmoid-shared-zloss"],
)
def test_compiled_training_repeats_the_eager_losses_for_other_routing_options(moe_fields):
    cfg = tiny(vocab_size=64, **moe_fields)
    _, eager, eager_losses = _fit(cfg, [], max_steps=3)
    _, compiled, compiled_losses = _fit(cfg, [CompileBlocks()], max_steps=3)
    torch.testing.assert_close(compiled_losses.losses, eager_losses.losses, rtol=1e-5, atol=1e-6)
    for name, buffer in eager.model.named_buffers():
        torch.testing.assert_close(compiled.model.get_buffer(name), buffer, msg=name)  # routing statistics, biases


@pytest.mark.slow
def test_a_resumed_compiled_run_repeats_the_uninterrupted_compiled_losses(tmp_path):
    cfg = _cfg()
    _, _, whole = _fit(cfg, [CompileBlocks()], max_steps=4)
    trainer, _, first = _fit(cfg, [CompileBlocks()], max_steps=2)
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    _, _, rest = _fit(cfg, [CompileBlocks()], max_steps=4, ckpt_path=tmp_path / "half.ckpt")
    assert len(rest.losses) == 2
    torch.testing.assert_close(first.losses + rest.losses, whole.losses, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_dropless_moe_compiles_once_not_once_per_routing():
    # NOTE: every step routes a different random batch; the dispatch is a custom op whose outputs'
    # sizes do not follow the routing (moe_lit/model/experts/ops.py), so the block is one graph and
    # after the first steps (the router's pending sums exist from the second forward on) no frame
    # is compiled again. The reset drops graphs an earlier test on this worker left in the cache.
    torch._dynamo.reset()
    counters.clear()
    _, module, recorder = _fit(_cfg(), [CompileBlocks()], max_steps=6)
    assert module.config.moe.capacity_factor is None
    assert 0 < recorder.frames[2] == recorder.frames[-1], recorder.frames
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.slow
def test_blocks_brought_in_by_an_expert_upcycling_swap_are_compiled():
    cfg = _cfg()
    swap = ExpertUpcycling(at_steps=[2], expansion={"factor": 2})
    _, module, recorder = _fit(cfg, [swap, CompileBlocks(backend="aot_eager")], max_steps=4)
    assert module.config.moe.num_experts == 2 * cfg.moe.num_experts
    assert all(is_compiled(block) for block in module.model.blocks)
    assert len(recorder.losses) == 4 and all(torch.isfinite(torch.tensor(recorder.losses)))


def test_compile_cost_counts_the_slow_batches_beyond_the_median():
    cost = compile_cost([12.0, 3.1, 1.0, 1.1, 0.9, 1.0, 1.0])
    assert cost["compile/median_step_s"] == 1.0
    assert cost["compile_s"] == pytest.approx(11.0 + 2.1)
    assert cost["compile/fraction"] == pytest.approx(13.1 / 20.1)
    assert compile_cost([1.0, 1.1, 0.9])["compile_s"] == 0.0
