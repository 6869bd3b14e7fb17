"""Optimizer state: round trips through prime_optimizer, and restoring into unprimed optimizers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptmgr import CheckpointError, CheckpointManager, prime_optimizer

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def sgd_momentum(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=5e-2, momentum=0.9, weight_decay=0.01)


OPTIMIZERS = [pytest.param(adamw, id="adamw"), pytest.param(sgd_momentum, id="sgd-momentum")]


@dataclass
class Trainer:
    """A small model, its optimizer and LR scheduler, trained on fixed synthetic data."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    @classmethod
    def create(cls, make_optimizer: OptimizerFactory, seed: int) -> Trainer:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        optimizer = make_optimizer(list(model.parameters()))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return cls(model, optimizer, scheduler)

    def train(self, steps: int, first_batch: int = 0) -> list[float]:
        losses = []
        for batch in range(first_batch, first_batch + steps):
            gen = torch.Generator().manual_seed(1000 + batch)
            inputs = torch.randn(32, 6, generator=gen)
            targets = torch.randn(32, 3, generator=gen)
            loss = nn.functional.mse_loss(self.model(inputs), targets)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            losses.append(loss.item())
        return losses

    def objects(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.optimizer, "sched": self.scheduler}


def assert_equal_nested(actual: Any, expected: Any, where: str = "") -> None:
    """Bit-exact equality of nested dicts/lists/tuples of tensors and plain values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_equal_nested(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)), where
        assert len(actual) == len(expected), where
        for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
            assert_equal_nested(got, want, f"{where}[{index}]")
    else:
        assert actual == expected, where


def snapshot(trainer: Trainer) -> dict[str, Any]:
    """Deep copies of the trainer's state dicts, to compare against later."""
    return {
        "model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "optim": _clone(trainer.optimizer.state_dict()),
        "sched": _clone(trainer.scheduler.state_dict()),
    }


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return value


def assert_same_training_state(restored: Trainer, saved: dict[str, Any]) -> None:
    assert_equal_nested(snapshot(restored), saved)


def save_trained(
    ckpt_dir: Path, make_optimizer: OptimizerFactory
) -> tuple[Trainer, dict[str, Any]]:
    """Train 5 steps, save model+optimizer+scheduler at step 5; returns trainer and snapshot."""
    trainer = Trainer.create(make_optimizer, seed=0)
    trainer.train(5)
    assert trainer.optimizer.state, "the optimizer should have state after training"
    saved = snapshot(trainer)
    with CheckpointManager(ckpt_dir, save_interval=5, chkpt_on_preemption=False) as mgr:
        assert mgr.save(5, trainer.objects()) is True
    return trainer, saved


def assert_training_continues_identically(original: Trainer, restored: Trainer) -> None:
    """Both trainers take the same next steps and end bit-identical."""
    assert restored.train(3, first_batch=5) == original.train(3, first_batch=5)
    assert_equal_nested(snapshot(restored), snapshot(original))


@pytest.mark.parametrize("make_optimizer", OPTIMIZERS)
def test_round_trip_with_explicitly_primed_optimizer_object(
    ckpt_dir: Path, make_optimizer: OptimizerFactory
) -> None:
    original, saved = save_trained(ckpt_dir, make_optimizer)
    restored = Trainer.create(make_optimizer, seed=1)
    assert prime_optimizer(restored.optimizer) is restored.optimizer
    assert restored.optimizer.state
    with CheckpointManager(ckpt_dir, save_interval=5, chkpt_on_preemption=False) as mgr:
        assert mgr.all_steps() == [5]
        mgr.restore(5, restored.objects())
    assert_same_training_state(restored, saved)
    assert restored.optimizer.param_groups[0]["lr"] == original.optimizer.param_groups[0]["lr"]
    assert_training_continues_identically(original, restored)


@pytest.mark.parametrize("make_optimizer", OPTIMIZERS)
def test_round_trip_with_primed_plain_state_dicts(
    ckpt_dir: Path, make_optimizer: OptimizerFactory
) -> None:
    original, saved = save_trained(ckpt_dir, make_optimizer)
    restored = Trainer.create(make_optimizer, seed=1)
    prime_optimizer(restored.optimizer)
    state = {
        "model": restored.model.state_dict(),
        "optim": restored.optimizer.state_dict(),
        "sched": restored.scheduler.state_dict(),
    }
    with CheckpointManager(ckpt_dir, save_interval=5, chkpt_on_preemption=False) as mgr:
        mgr.restore(5, state)
    restored.model.load_state_dict(state["model"])
    restored.optimizer.load_state_dict(state["optim"])
    restored.scheduler.load_state_dict(state["sched"])
    assert_same_training_state(restored, saved)
    assert_training_continues_identically(original, restored)


@pytest.mark.parametrize("make_optimizer", OPTIMIZERS)
def test_unprimed_optimizer_object_is_primed_automatically(
    ckpt_dir: Path, make_optimizer: OptimizerFactory
) -> None:
    original, saved = save_trained(ckpt_dir, make_optimizer)

    # Priming is destructive here: weight decay moves the parameters. The restore must still end
    # with the saved parameters, so it has to prime before it loads the model.
    control = Trainer.create(make_optimizer, seed=1)
    before = {k: v.clone() for k, v in control.model.state_dict().items()}
    prime_optimizer(control.optimizer)
    assert any(not torch.equal(v, before[k]) for k, v in control.model.state_dict().items())

    restored = Trainer.create(make_optimizer, seed=1)
    assert not restored.optimizer.state
    with CheckpointManager(ckpt_dir, save_interval=5, chkpt_on_preemption=False) as mgr:
        # The model comes first in the dict: loading in dict order and priming afterwards
        # would corrupt the restored parameters.
        mgr.restore(
            5, {"model": restored.model, "optim": restored.optimizer, "sched": restored.scheduler}
        )
    assert_same_training_state(restored, saved)
    assert len(restored.optimizer.state) == len(list(restored.model.parameters()))
    assert_training_continues_identically(original, restored)


@pytest.mark.parametrize("make_optimizer", OPTIMIZERS)
def test_unprimed_plain_optimizer_state_dict_raises_naming_prime_optimizer(
    ckpt_dir: Path, make_optimizer: OptimizerFactory
) -> None:
    _, saved = save_trained(ckpt_dir, make_optimizer)
    restored = Trainer.create(make_optimizer, seed=1)
    state = {"model": restored.model.state_dict(), "optim": restored.optimizer.state_dict()}
    assert state["optim"]["state"] == {}
    with CheckpointManager(ckpt_dir, save_interval=5, chkpt_on_preemption=False) as mgr:
        with pytest.raises(CheckpointError, match="prime_optimizer"):
            mgr.restore(5, state)
        assert not restored.optimizer.state, "nothing may be loaded into the optimizer silently"

        # After the advice is followed, the same restore works.
        prime_optimizer(restored.optimizer)
        state = {"model": restored.model.state_dict(), "optim": restored.optimizer.state_dict()}
        mgr.restore(5, state)
    restored.optimizer.load_state_dict(state["optim"])
    assert_equal_nested(snapshot(restored)["optim"], saved["optim"])
    assert_equal_nested(snapshot(restored)["model"], saved["model"])


def test_async_save_of_optimizer_holds_values_at_call_time(ckpt_dir: Path) -> None:
    trainer = Trainer.create(adamw, seed=0)
    trainer.train(3)
    saved = snapshot(trainer)
    with CheckpointManager(ckpt_dir, save_interval=3, chkpt_on_preemption=False) as mgr:
        assert mgr.save_async(3, trainer.objects()) is True
        trainer.train(2, first_batch=3)  # mutates parameters and optimizer state in place
        mgr.join()
        assert mgr.all_steps() == [3]
        restored = Trainer.create(adamw, seed=1)
        mgr.restore(3, restored.objects())
    assert_same_training_state(restored, saved)


def two_layers() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def trained_one_step(model: nn.Module) -> torch.optim.Optimizer:
    """An Adam over ``model`` after one step (so it has state), seeded."""
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return optimizer


@pytest.mark.parametrize("saved_as", ["optimizer", "state_dict"])
def test_an_optimizer_with_other_parameter_groups_is_refused_before_anything_changes(
    ckpt_dir: Path, saved_as: str
) -> None:
    """A checkpoint of one parameter group restored into an optimizer of two raises
    CheckpointError, and neither the model nor the optimizer is changed: it returned with the
    model loaded and a group without lr or betas (the next step raised KeyError), or, for a
    checkpoint keyed by position, raised a ValueError after loading the model."""
    saved_model = two_layers()
    saved_optimizer = trained_one_step(saved_model)
    optim = saved_optimizer if saved_as == "optimizer" else saved_optimizer.state_dict()
    target_model = two_layers()
    before = {k: v.clone() for k, v in target_model.state_dict().items()}
    target_optimizer = torch.optim.Adam(
        [{"params": target_model[0].parameters()}, {"params": target_model[1].parameters()}],
        lr=0.5,
    )
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {"model": saved_model, "optim": optim})
        with pytest.raises(CheckpointError, match="parameter group"):
            mgr.restore(1, {"model": target_model, "optim": target_optimizer})
    assert all(torch.equal(v, before[k]) for k, v in target_model.state_dict().items())
    assert [g["lr"] for g in target_optimizer.param_groups] == [0.5, 0.5]
    assert not target_optimizer.state


@pytest.mark.parametrize("kind", ["sgd", "adamw", "adam with other schedulers"])
def test_a_checkpoint_of_another_kind_of_optimizer_is_named_in_a_warning(
    ckpt_dir: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Adam's checkpoint restored into an SGD: torch's load takes Adam's settings and state as
    they are (as ``SGD.load_state_dict`` does), and the first step raised ``KeyError:
    'momentum'`` with no word of the cause; a warning names both sides' settings. An AdamW
    (Adam's settings, and one more) gets none, nor an Adam saved with OneCycleLR's settings in
    its group and restored into one with SWALR's (a scheduler's settings are no optimizer's)."""
    saved_model = two_layers()
    saved_optimizer = trained_one_step(saved_model)
    target_model = two_layers()
    if kind == "sgd":
        target: torch.optim.Optimizer = torch.optim.SGD(
            target_model.parameters(), lr=0.1, momentum=0.9
        )
    elif kind == "adamw":
        target = torch.optim.AdamW(target_model.parameters(), lr=0.01)
    else:
        torch.optim.lr_scheduler.OneCycleLR(saved_optimizer, max_lr=0.1, total_steps=10)
        target = torch.optim.Adam(target_model.parameters(), lr=0.01)
        torch.optim.swa_utils.SWALR(target, swa_lr=0.05)
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {"model": saved_model, "optim": saved_optimizer})
        with caplog.at_level("WARNING", logger="ckptmgr"):
            mgr.restore(1, {"model": target_model, "optim": target})
    warnings = [r.getMessage() for r in caplog.records if "another kind" in r.getMessage()]
    if kind != "sgd":
        assert warnings == []
        return
    assert len(warnings) == 1, warnings
    assert "than this SGD" in warnings[0]
    assert "'betas'" in warnings[0] and "'momentum'" in warnings[0], warnings[0]


def test_saved_state_of_a_parameter_the_live_optimizer_has_none_for_is_restored(
    ckpt_dir: Path,
) -> None:
    """The optimizer restored into has state for some parameters only (a layer was frozen in
    the steps it took): the checkpoint's state of the others is restored too, not dropped, and
    the parameters themselves are the checkpoint's."""
    saved_model = two_layers()
    saved_optimizer = trained_one_step(saved_model)
    target_model = two_layers()
    target_optimizer = torch.optim.Adam(target_model.parameters(), lr=0.01)
    target_model[1].weight.requires_grad_(False)  # frozen for the steps taken so far
    target_model(torch.randn(3, 4)).sum().backward()
    target_optimizer.step()
    target_optimizer.zero_grad()
    target_model[1].weight.requires_grad_(True)
    assert len(target_optimizer.state) == 3
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {"model": saved_model, "optim": saved_optimizer})
        mgr.restore(1, {"model": target_model, "optim": target_optimizer})
    for saved_param, target_param in zip(
        saved_model.parameters(), target_model.parameters(), strict=True
    ):
        assert torch.equal(saved_param, target_param)
        saved_state = saved_optimizer.state[saved_param]
        target_state = target_optimizer.state[target_param]
        assert sorted(saved_state) == sorted(target_state)
        for key, value in saved_state.items():
            assert torch.equal(value, target_state[key]), key


def test_a_failed_restore_leaves_a_fresh_optimizer_without_state(ckpt_dir: Path) -> None:
    """A restore that fails in planning (a key the checkpoint lacks, after the optimizer) drops
    the state it created to load into: the optimizer is as it was, without state (it kept a
    step count of 1 and moments from weight decay), and a later restore works."""
    saved_model = nn.Linear(4, 2)
    saved_optimizer = trained_one_step(saved_model)
    target_model = nn.Linear(4, 2)
    before = {k: v.clone() for k, v in target_model.state_dict().items()}
    target_optimizer = torch.optim.Adam(target_model.parameters(), lr=0.01, weight_decay=0.1)
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {"model": saved_model, "optim": saved_optimizer})
        with pytest.raises(CheckpointError, match="'epoch'"):
            mgr.restore(1, {"model": target_model, "optim": target_optimizer, "epoch": 0})
        assert len(target_optimizer.state) == 0
        assert all(torch.equal(v, before[k]) for k, v in target_model.state_dict().items())
        mgr.restore(1, {"model": target_model, "optim": target_optimizer})
    assert len(target_optimizer.state) == 2
    assert torch.equal(target_model.weight, saved_model.weight)


# --- A new optimizer's state made from the checkpoint, without a step ---------------------------
def nadam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.NAdam(params, lr=1e-2)  # (a scalar of its own besides step)


def adam_amsgrad(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2, amsgrad=True)


def rmsprop(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(params, lr=1e-3, momentum=0.5, centered=True)


class OwnAdamW(torch.optim.AdamW):
    """An optimizer that is not one of torch's own (its state made by a step, as before)."""


def own_adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return OwnAdamW(params, lr=1e-2, weight_decay=0.1)


class Momentum(torch.optim.Optimizer):
    """An optimizer of a project's own, on torch's Optimizer: SGD with momentum."""

    def __init__(self, params: list[nn.Parameter], lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                buffer = self.state[param].setdefault("buffer", torch.zeros_like(param))
                buffer.mul_(0.9).add_(param.grad)
                param.add_(buffer, alpha=-group["lr"])


def momentum(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return Momentum(params, lr=5e-2)


class CreateStateCalls:
    """The parameters ``create_state`` (the step that makes an optimizer's state) was asked
    to make state for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from ckptmgr import module_state

        self.params: list[torch.Tensor] = []
        real = module_state.create_state

        def recorded(optimizer: torch.optim.Optimizer, params: Any = None) -> Any:
            self.params.extend(params or [])
            return real(optimizer, params)

        monkeypatch.setattr(module_state, "create_state", recorded)


def saved_and_restored(
    ckpt_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    saved: tuple[nn.Module, torch.optim.Optimizer],
    target: tuple[nn.Module, torch.optim.Optimizer],
) -> CreateStateCalls:
    """Save ``saved`` (a module and its optimizer) as step 1, restore it into ``target``;
    returns the parameters the restore made state for by a step."""
    calls = CreateStateCalls(monkeypatch)
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {"model": saved[0], "optim": saved[1]})
        mgr.restore(1, {"model": target[0], "optim": target[1]})
    return calls


@pytest.mark.parametrize(
    "make_optimizer",
    [*OPTIMIZERS, nadam, adam_amsgrad, rmsprop, pytest.param(own_adamw, id="not-torchs")],
)
def test_a_new_optimizers_state_is_made_from_the_checkpoint(
    ckpt_dir: Path, make_optimizer: OptimizerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted job's optimizer has no state: for torch's own optimizers the restore makes
    it from what the checkpoint holds, without a step (for others by a step, as before). The
    state is the saved one bit for bit, its keys in the order a step makes them, each tensor
    laid out like the one the step made, and training goes on identically."""
    original, saved = save_trained(ckpt_dir, make_optimizer)
    restored = Trainer.create(make_optimizer, seed=1)
    assert not restored.optimizer.state
    calls = CreateStateCalls(monkeypatch)
    with CheckpointManager(ckpt_dir, save_interval=5, chkpt_on_preemption=False) as mgr:
        mgr.restore(5, restored.objects())
    by_a_step = make_optimizer is own_adamw
    assert len(calls.params) == (len(list(restored.model.parameters())) if by_a_step else 0)
    assert_same_training_state(restored, saved)
    params = zip(original.model.parameters(), restored.model.parameters(), strict=True)
    for original_param, restored_param in params:
        made = restored.optimizer.state[restored_param]
        stepped = original.optimizer.state[original_param]
        assert list(made) == list(stepped)  # (the order of the keys too)
        for key, value in stepped.items():
            layout = (value.dtype, value.device, value.shape, value.stride())
            assert (made[key].dtype, made[key].device, made[key].shape, made[key].stride()) == (
                layout
            ), key
    assert_training_continues_identically(original, restored)


def test_a_new_optimizers_state_keeps_the_parameters_layout_and_plain_values(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A channels-last parameter's moments are channels-last, as a step makes them (a weight
    large enough to be stored outside the pack of small tensors: its ``step`` still comes
    first); a plain value in a parameter's state is restored as it was saved."""
    torch.manual_seed(0)
    saved_model = nn.Conv2d(64, 32, 3).to(memory_format=torch.channels_last)  # (72 KiB)
    saved_optimizer = torch.optim.AdamW(saved_model.parameters(), lr=0.01)
    saved_model(torch.randn(2, 64, 6, 6)).sum().backward()
    saved_optimizer.step()
    saved_optimizer.state[saved_model.bias]["note"] = 3
    target_model = nn.Conv2d(64, 32, 3).to(memory_format=torch.channels_last)
    target_optimizer = torch.optim.AdamW(target_model.parameters(), lr=0.01)
    calls = saved_and_restored(
        ckpt_dir, monkeypatch, (saved_model, saved_optimizer), (target_model, target_optimizer)
    )
    assert calls.params == []
    weight_state = target_optimizer.state[target_model.weight]
    assert list(weight_state) == ["step", "exp_avg", "exp_avg_sq"]
    assert target_model.weight.is_contiguous(memory_format=torch.channels_last)
    for key in ("exp_avg", "exp_avg_sq"):
        assert weight_state[key].stride() == target_model.weight.stride(), key
        assert torch.equal(weight_state[key], saved_optimizer.state[saved_model.weight][key])
    bias_state = target_optimizer.state[target_model.bias]
    assert bias_state["note"] == 3 and list(bias_state)[-1] == "note"
    assert torch.equal(bias_state["exp_avg"], saved_optimizer.state[saved_model.bias]["exp_avg"])


def test_a_new_optimizers_step_count_keeps_its_own_dtype(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``step`` is made as the step makes it (float32 on the CPU), not in the parameters' dtype
    (float64 here; in bfloat16 a count past 256 would round)."""
    torch.manual_seed(0)
    saved_model = nn.Linear(3, 2).double()
    saved_optimizer = torch.optim.AdamW(saved_model.parameters(), lr=0.01)
    for _ in range(3):
        saved_model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
        saved_optimizer.step()
    target_model = nn.Linear(3, 2).double()
    target_optimizer = torch.optim.AdamW(target_model.parameters(), lr=0.01)
    calls = saved_and_restored(
        ckpt_dir, monkeypatch, (saved_model, saved_optimizer), (target_model, target_optimizer)
    )
    assert calls.params == []
    for saved_param, target_param in zip(
        saved_model.parameters(), target_model.parameters(), strict=True
    ):
        step = target_optimizer.state[target_param]["step"]
        assert step.dtype == torch.float32 and step.device.type == "cpu" and step.item() == 3
        exp_avg = target_optimizer.state[target_param]["exp_avg"]
        assert exp_avg.dtype == torch.float64
        assert torch.equal(exp_avg, saved_optimizer.state[saved_param]["exp_avg"])


def test_a_parameter_whose_saved_state_holds_more_than_tensors_gets_its_state_by_a_step(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the checkpoint's state of a parameter holds a container (a list of tensors, as
    LBFGS keeps), that parameter's state is made by a step as before; the others' from the
    checkpoint."""
    saved_model = two_layers()
    saved_optimizer = trained_one_step(saved_model)
    saved_optimizer.state[saved_model[0].weight]["history"] = [torch.ones(2), torch.zeros(2)]
    target_model = two_layers()
    target_optimizer = torch.optim.Adam(target_model.parameters(), lr=0.01)
    calls = saved_and_restored(
        ckpt_dir, monkeypatch, (saved_model, saved_optimizer), (target_model, target_optimizer)
    )
    assert calls.params == [target_model[0].weight]
    for saved_param, target_param in zip(
        saved_model.parameters(), target_model.parameters(), strict=True
    ):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            got = target_optimizer.state[target_param][key]
            assert torch.equal(got, saved_optimizer.state[saved_param][key]), key


@pytest.mark.parametrize(
    "make_optimizer",
    [adamw, sgd_momentum, own_adamw, momentum],
    ids=["adamw", "sgd", "adamw-subclass", "own-optimizer"],
)
def test_the_state_of_a_frozen_parameter_is_restored(
    ckpt_dir: Path, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
) -> None:
    """A layer frozen (requires_grad=False) after its state was made, for staged fine-tuning:
    its saved state was left out of the restore (as DCP's set_optimizer_state_dict does), so
    the resumed run's moments started afresh once the layer was unfrozen. So it was for an
    optimizer not of torch's own (a subclass, or one on torch's Optimizer), whose state is
    made by a step: the step made none for a parameter that requires no grad."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        return model, make_optimizer(list(model.parameters()))

    def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(8, 4, generator=generator)).pow(2).mean().backward()
            optimizer.step()

    model, optimizer = build()
    train(model, optimizer, 3, seed=1)
    model[0].weight.requires_grad_(False)
    train(model, optimizer, 2, seed=2)
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as manager:
        assert manager.save(5, {"model": model, "optim": optimizer})
        resumed_model, resumed_optimizer = build()
        resumed_model[0].weight.requires_grad_(False)
        manager.restore(5, {"model": resumed_model, "optim": resumed_optimizer})
    frozen = resumed_optimizer.state[resumed_model[0].weight]
    expected = optimizer.state[model[0].weight]
    assert sorted(frozen) == sorted(expected)
    assert all(torch.equal(frozen[key], expected[key]) for key in expected)
    for run_model, run_optimizer in ((model, optimizer), (resumed_model, resumed_optimizer)):
        run_model[0].weight.requires_grad_(True)  # unfrozen: its moments go on from the save
        train(run_model, run_optimizer, 2, seed=3)
    resumed_params = dict(resumed_model.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, resumed_params[name]), name


@pytest.mark.parametrize("live", [False, True], ids=["fresh", "stepped"])
@pytest.mark.parametrize("make_optimizer", [torch.optim.AdamW, OwnAdamW], ids=["adamw", "own"])
def test_an_empty_parameter_group_gets_its_hyperparameters_back(
    ckpt_dir: Path, live: bool, make_optimizer: type[torch.optim.Optimizer]
) -> None:
    """A parameter group with no parameters (a "no weight decay" group of a model without
    biases): its saved group went through DCP's matching of groups by the names they hold,
    which gave it none of its hyperparameters back (lr, betas, eps, weight_decay): the next
    optimizer.step() raised KeyError: 'betas', a new LambdaLR KeyError: 'lr'."""

    def build(empty_lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.Linear(8, 1, bias=False))
        groups = [
            {"params": [model[0].weight], "lr": 1e-2, "weight_decay": 0.1},
            {"params": [], "lr": empty_lr, "weight_decay": 0.0},
            {"params": [model[1].weight], "lr": 1e-3, "weight_decay": 0.2},
        ]
        return model, make_optimizer(groups)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model(torch.randn(2, 4, generator=torch.Generator().manual_seed(1))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = build(5e-3)
    step(model, optimizer)
    resumed_model, resumed_optimizer = build(7e-3)  # (other values, overwritten by restore)
    if live:
        step(resumed_model, resumed_optimizer)
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as manager:
        assert manager.save(1, {"model": model, "optim": optimizer})
        manager.restore(1, {"model": resumed_model, "optim": resumed_optimizer})
    assert resumed_optimizer.param_groups == [
        {**group, "params": list(resumed_group["params"])}
        for group, resumed_group in zip(
            optimizer.param_groups, resumed_optimizer.param_groups, strict=True
        )
    ]
    torch.optim.lr_scheduler.LambdaLR(resumed_optimizer, lambda epoch: 1.0)
    step(model, optimizer)
    step(resumed_model, resumed_optimizer)
    for param, resumed in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(param, resumed)


class DecayingMomentum(Momentum):
    """Momentum with a weight decay that does not scale with the learning rate."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.mul_(0.999)
        super().step(closure)


def test_making_the_state_by_a_step_leaves_every_parameter_as_it_was(ckpt_dir: Path) -> None:
    """The state of an optimizer not of torch's own is made by a step at learning rate 0, which
    left the parameters alone only where the update scales with the learning rate: a weight
    decay of the optimizer's own moved them (trainable and frozen), and a restore of the
    optimizer alone left them moved."""
    from ckptmgr import OptimizerState

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        return model, DecayingMomentum(list(model.parameters()), lr=5e-2)

    model, optimizer = build()
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    model[0].weight.requires_grad_(False)
    resumed_model, resumed_optimizer = build()
    resumed_model[0].weight.requires_grad_(False)
    before = [param.detach().clone() for param in resumed_model.parameters()]
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as manager:
        assert manager.save(1, {"optim": OptimizerState(model, optimizer)})
        manager.restore(1, {"optim": OptimizerState(resumed_model, resumed_optimizer)})
    for param, value in zip(resumed_model.parameters(), before, strict=True):
        assert torch.equal(param, value)
    for param, resumed in zip(model.parameters(), resumed_model.parameters(), strict=True):
        saved = optimizer.state[param]["buffer"]
        assert torch.equal(resumed_optimizer.state[resumed]["buffer"], saved)


def test_an_optimizer_whose_step_needs_a_closure_is_refused_clearly(ckpt_dir: Path) -> None:
    """LBFGS: making its state (a step) raised torch's TypeError ('missing 1 required
    positional argument: closure') out of restore and prime_optimizer."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.LBFGS(model.parameters(), history_size=3)
    data = torch.randn(8, 4)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(data).pow(2).mean()
        loss.backward()
        return loss

    optimizer.step(closure)
    with CheckpointManager(ckpt_dir, 1, chkpt_on_preemption=False) as manager:
        assert manager.save(1, {"model": model, "optim": optimizer})
        fresh_model = nn.Linear(4, 1)
        fresh = torch.optim.LBFGS(fresh_model.parameters(), history_size=3)
        with pytest.raises(CheckpointError, match=r"LBFGS cannot be made .* needs a closure"):
            manager.restore(1, {"model": fresh_model, "optim": fresh})
    with pytest.raises(CheckpointError, match=r"LBFGS cannot be made .* needs a closure"):
        prime_optimizer(torch.optim.LBFGS(nn.Linear(4, 1).parameters()))
