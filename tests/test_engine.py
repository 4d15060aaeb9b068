import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from _engine_toys import ClassifyRecipe, TinyNet, make_dataset  # noqa: E402

from domainfm.engine import (  # noqa: E402
    ResumableSampler,
    TrainConfig,
    Trainer,
    build_param_groups,
    warmup_cosine,
)


def _cfg(**kw):
    base = dict(max_epochs=3, batch_size=16, lr=1e-2, progress=False, accelerator="cpu")
    base.update(kw)
    return TrainConfig(**base)


def test_tiny_model_learns_and_writes_run_files(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    trainer = Trainer(_cfg(max_epochs=5, monitor="val/accuracy", monitor_mode="max"), run_dir=tmp_path)
    result = trainer.fit(ClassifyRecipe(model, make_dataset(), make_dataset(seed=1)))
    train_losses = [r["loss"] for r in result.history if r.get("split") == "train"]
    assert train_losses[-1] < 0.45 < train_losses[0]
    assert result.best_metric > 0.85
    assert result.global_step == 5 * (256 // 16)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("split") == "val" for r in records) == 5
    best = load_file(str(tmp_path / "checkpoints" / "best.safetensors"))
    assert set(best) == set(model.state_dict())
    assert not list((tmp_path / "checkpoints").glob(".*tmp*"))  # atomic writes leave no temp files


class _Crash(RuntimeError):
    pass


class _CrashingRecipe(ClassifyRecipe):
    def __init__(self, *a, crash_at, **kw):
        super().__init__(*a, **kw)
        self.crash_at, self.calls = crash_at, 0

    def step(self, model, batch):
        self.calls += 1
        if self.calls == self.crash_at:
            raise _Crash("simulated interruption")
        return super().step(model, batch)


def test_interrupted_run_resumes_to_identical_weights(tmp_path):
    # dropout on, so the RNG state must be restored too; 16 micro-batches per epoch
    cfg = dict(max_epochs=3, batch_size=16, checkpoint_every_steps=5, log_every_steps=1)
    torch.manual_seed(0)
    reference = TinyNet(dropout=0.3)
    init = {k: v.clone() for k, v in reference.state_dict().items()}
    Trainer(_cfg(**cfg), run_dir=tmp_path / "a").fit(ClassifyRecipe(reference, make_dataset(), make_dataset(seed=1)))

    interrupted = TinyNet(dropout=0.3)
    interrupted.load_state_dict(init)
    with pytest.raises(_Crash):
        Trainer(_cfg(**cfg), run_dir=tmp_path / "b").fit(
            _CrashingRecipe(interrupted, make_dataset(), make_dataset(seed=1), crash_at=23)
        )
    resumed = TinyNet(dropout=0.3)  # a fresh process would start from scratch
    trainer = Trainer(_cfg(resume=True, **cfg), run_dir=tmp_path / "b")
    result = trainer.fit(ClassifyRecipe(resumed, make_dataset(), make_dataset(seed=1)))
    assert result.global_step == 48
    assert any(r.get("event") == "resumed" and r["step"] == 20 for r in result.history)
    for key, value in reference.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_gradient_accumulation_matches_large_batch_fp64():
    data = make_dataset(n=128, dtype=torch.float64)
    states = []
    for batch_size, accum in ((16, 1), (8, 2)):
        torch.manual_seed(0)
        model = TinyNet(dropout=0.0).double()
        trainer = Trainer(_cfg(max_epochs=2, batch_size=batch_size, grad_accum=accum, precision="64-true", clip_grad_norm=1.0))
        result = trainer.fit(ClassifyRecipe(model, data))
        assert result.global_step == 16
        states.append(model.state_dict())
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=1e-6)


def test_bf16_autocast_path_trains():
    torch.manual_seed(0)
    model = TinyNet()
    seen = []
    model.head.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    result = Trainer(_cfg(max_epochs=3, precision="bf16-mixed")).fit(ClassifyRecipe(model, make_dataset()))
    assert seen[0] == torch.bfloat16  # linear layers ran under autocast
    assert model.head.weight.dtype == torch.float32  # master weights stay fp32
    losses = [r["loss"] for r in result.history if r.get("split") == "train"]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_early_stopping_stops_after_patience(tmp_path):
    torch.manual_seed(0)
    cfg = _cfg(max_epochs=20, lr=0.0, monitor="val/accuracy", monitor_mode="max", early_stopping_patience=2)
    result = Trainer(cfg, run_dir=tmp_path).fit(ClassifyRecipe(TinyNet(), make_dataset(n=64), make_dataset(n=32, seed=1)))
    # lr 0: the metric never improves after epoch 1, so training stops after epoch 3
    assert result.stopped_early and result.epochs_completed == 3
    assert result.best_step == 4


def test_param_groups_head_lr_layer_decay_and_no_decay():
    model = TinyNet()
    cfg = _cfg(lr=1.0, head_lr=5.0, layer_decay=0.5, weight_decay=0.1)
    lrs = {}
    for group in build_param_groups(model, cfg):
        for name in group["names"]:
            lrs[name] = (group["lr"], group["weight_decay"])
    # one block: blocks.0 is layer 1 of L=1 -> scale 0.5**(2-1); norm (layer 0) -> 0.5**2; head -> head_lr
    assert lrs["blocks.0.0.weight"] == (0.5, 0.1)
    assert lrs["blocks.0.0.bias"] == (0.5, 0.0)
    assert lrs["norm.weight"] == (0.25, 0.0)
    assert lrs["head.weight"] == (5.0, 0.1)


def test_warmup_cosine_schedule_values():
    assert warmup_cosine(0, 100, 10, 0.0) == pytest.approx(0.1)
    assert warmup_cosine(9, 100, 10, 0.0) == pytest.approx(1.0)
    assert warmup_cosine(10, 100, 10, 0.0) == pytest.approx(1.0)
    assert warmup_cosine(55, 100, 10, 0.0) == pytest.approx(0.5)
    assert warmup_cosine(100, 100, 10, 0.02) == pytest.approx(0.02)
    assert warmup_cosine(55, 100, 10, 0.0, "linear") == pytest.approx(0.5)
    assert warmup_cosine(70, 100, 0, 0.0, "constant") == 1.0


def test_resumable_sampler_shards_and_skips():
    shards = []
    for rank in range(3):
        s = ResumableSampler(10, num_replicas=3, rank=rank, seed=4)
        s.set_epoch(2)
        shards.append(list(s))
    assert all(len(x) == 4 for x in shards)
    assert set().union(*map(set, shards)) == set(range(10))
    s = ResumableSampler(10, num_replicas=3, rank=1, seed=4)
    s.set_epoch(2, start=3)
    assert list(s) == shards[1][3:] and len(s) == 1
    other = ResumableSampler(10, seed=4)
    other.set_epoch(3)
    first = ResumableSampler(10, seed=4)
    first.set_epoch(2)
    assert list(other) != list(first)  # a new permutation each epoch


def test_config_rejects_unknown_and_bad_values():
    with pytest.raises(ValueError, match="unknown train setting"):
        TrainConfig.from_dict({"learning_rate": 1e-3})
    with pytest.raises(ValueError, match="schedule"):
        TrainConfig(schedule="step")
    with pytest.raises(ValueError, match="monitor"):
        TrainConfig(early_stopping_patience=3)


@pytest.mark.distributed
def test_torchrun_two_processes_ddp_gloo(tmp_path):
    script = Path(__file__).parent / "_ddp_script.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
         str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    w0 = load_file(str(tmp_path / "rank0.safetensors"))
    w1 = load_file(str(tmp_path / "rank1.safetensors"))
    for key in w0:
        assert torch.equal(w0[key], w1[key]), key
    world, steps, acc = (tmp_path / "rank0.txt").read_text().split()
    assert world == "2"
    assert int(steps) == 2 * (128 // 2 // 16)  # each rank sees half the data per epoch
    assert float(acc) > 0.5
    assert (tmp_path / "rank1.txt").read_text() == (tmp_path / "rank0.txt").read_text()
    init = TinyNet(dropout=0.0)
    assert not torch.equal(init.head.weight, w0["head.weight"])


def test_before_optimizer_step_hook_sees_live_optimizer_also_after_resume(tmp_path):
    class WdSchedule(ClassifyRecipe):
        def before_optimizer_step(self, optimizer, step, total_steps):
            for g in optimizer.param_groups:
                if g["weight_decay"] > 0:
                    g["weight_decay"] = 0.01 * (step + 1)
            self.seen = (step, total_steps, optimizer.param_groups[0]["weight_decay"])

    cfg = dict(max_epochs=2, batch_size=32, checkpoint_every_steps=4)
    torch.manual_seed(0)
    recipe = WdSchedule(TinyNet(), make_dataset())
    Trainer(_cfg(**cfg), run_dir=tmp_path).fit(recipe)
    assert recipe.seen == (15, 16, pytest.approx(0.16))
    resumed = WdSchedule(TinyNet(), make_dataset())
    trainer = Trainer(_cfg(max_epochs=3, resume=True, **{k: v for k, v in cfg.items() if k != "max_epochs"}), run_dir=tmp_path)
    trainer.fit(resumed)
    # the resumed run's groups are new dicts (optimizer.load_state_dict), and the hook still drives them
    assert resumed.seen == (23, 24, pytest.approx(0.24))


def test_eval_collate_fn_is_used_for_evaluation_only():
    calls = {"train": 0, "eval": 0}

    def train_collate(items):
        calls["train"] += 1
        return torch.utils.data.default_collate(items)

    def eval_collate(items):
        calls["eval"] += 1
        return torch.utils.data.default_collate(items)

    recipe = ClassifyRecipe(TinyNet(), make_dataset(n=64), make_dataset(n=32, seed=1))
    recipe.collate_fn, recipe.eval_collate_fn = train_collate, eval_collate
    Trainer(_cfg(max_epochs=1)).fit(recipe)
    assert calls == {"train": 4, "eval": 2}


def _bare_loop_state(seed, steps, batch_size, lr, data, precision):
    """An independent reference: the same optimizer, schedule and batch order, written plainly."""
    torch.manual_seed(seed)
    model = TinyNet(dropout=0.0)
    # the engine's parameter groups (no decay on biases and norms) are tested on their own above
    groups = build_param_groups(model, _cfg(lr=lr))
    for g in groups:
        g.pop("names", None)
    optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, steps, 0, 0.0, "cosine"))
    x, y = data.tensors
    for s in range(steps):
        idx = torch.arange(s * batch_size, (s + 1) * batch_size)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return model.state_dict()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_trainer_equals_a_bare_loop(precision):
    # the direct single-device path does the same arithmetic as a plain PyTorch loop
    data = make_dataset()
    steps, bs = 12, 16
    reference = _bare_loop_state(3, steps, bs, 1e-2, data, precision)
    torch.manual_seed(3)
    model = TinyNet(dropout=0.0)
    cfg = _cfg(max_steps=steps, batch_size=bs, shuffle=False, precision=precision, log_every_steps=5)
    trainer = Trainer(cfg)
    assert trainer.precision == precision
    trainer.fit(ClassifyRecipe(model, data))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=1e-6 if precision == "32-true" else 1e-5)


def test_precision_auto_follows_the_hardware(monkeypatch):
    from domainfm import precision as P

    monkeypatch.delenv("DOMAINFM_PRECISION", raising=False)
    monkeypatch.setattr(P, "_cpu_bf16_native", lambda: True)
    assert P.resolve_precision("auto", "cpu") == "bf16-mixed"
    assert Trainer(_cfg()).precision == "bf16-mixed"  # the default is auto
    monkeypatch.setattr(P, "_cpu_bf16_native", lambda: False)
    assert P.resolve_precision("auto", "cpu") == "32-true"
    assert Trainer(_cfg()).precision == "32-true"
    assert P.autocast_dtype("auto", "cpu") is None
    monkeypatch.setenv("DOMAINFM_PRECISION", "bf16-mixed")
    assert P.resolve_precision("auto", "cpu") == "bf16-mixed"
    assert P.resolve_precision("32-true", "cpu") == "32-true"  # an explicit choice is kept
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="half")


def test_active_autocast_dtype_follows_the_autocast_context():
    from domainfm.precision import active_autocast_dtype

    assert active_autocast_dtype("cpu") is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert active_autocast_dtype("cpu") == torch.bfloat16
        with torch.autocast("cpu", enabled=False):
            assert active_autocast_dtype("cpu") is None
    assert active_autocast_dtype("cpu") is None


def test_csv_and_tensorboard_loggers_write_beside_jsonl(tmp_path):
    import tensorboard  # noqa: F401  (in the test extra; train.loggers=[tensorboard] needs it)
    torch.manual_seed(0)
    cfg = _cfg(max_epochs=2, loggers=["jsonl", "csv", "tensorboard"], log_every_steps=4)
    Trainer(cfg, run_dir=tmp_path).fit(ClassifyRecipe(TinyNet(), make_dataset(), make_dataset(seed=1)))
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    csv_file = next((tmp_path / "logs" / "csv").rglob("metrics.csv"))
    import csv

    rows = list(csv.DictReader(csv_file.open()))
    train_jsonl = [r for r in jsonl if r.get("split") == "train"]
    train_csv = [r for r in rows if r.get("train/loss")]
    assert [int(r["step"]) for r in train_csv] == [r["step"] for r in train_jsonl]
    assert [float(r["train/loss"]) for r in train_csv] == pytest.approx([r["loss"] for r in train_jsonl])
    assert any(r.get("val/accuracy") for r in rows)
    events = list((tmp_path / "logs" / "tensorboard").rglob("events.out.tfevents*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [r["step"] for r in train_jsonl]
    with pytest.raises(ValueError, match="jsonl"):
        TrainConfig(loggers=["csv"])
    with pytest.raises(ValueError, match="unknown logger"):
        TrainConfig(loggers=["jsonl", "wandb"])


def test_trainer_does_not_log_lightnings_precision_notice_but_keeps_other_messages():
    """Lightning logs "Using bfloat16 Automatic Mixed Precision (AMP)" per Fabric, i.e. per Trainer;
    a run builds dozens. The notice is dropped while the Trainer builds its Fabric; the logger's
    other messages still pass, and the filter does not outlive the construction."""
    import logging

    from domainfm.engine import TrainConfig, Trainer

    logger = logging.getLogger("lightning_fabric.utilities.rank_zero")
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep(level=logging.DEBUG)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        trainer = Trainer(TrainConfig(precision="bf16-mixed", accelerator="cpu", progress=False))
        assert trainer.precision == "bf16-mixed"
        assert not any("Automatic Mixed Precision" in m for m in seen), seen
        logger.info("Using bfloat16 Automatic Mixed Precision (AMP)")  # outside the Trainer: not filtered
        logger.info("another message")
        assert seen[-2:] == ["Using bfloat16 Automatic Mixed Precision (AMP)", "another message"]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def test_a_dataset_smaller_than_one_global_batch_is_an_error_not_zero_steps():
    # drop_last with fewer samples than a batch gave no batch at all, and the run "trained" 0 steps
    with pytest.raises(ValueError, match=r"10 training samples .* train.batch_size=16"):
        Trainer(_cfg(max_epochs=2)).fit(ClassifyRecipe(TinyNet(), make_dataset(n=10)))
    # without drop_last the short batch is used
    result = Trainer(_cfg(max_epochs=2, drop_last=False)).fit(ClassifyRecipe(TinyNet(), make_dataset(n=10)))
    assert result.global_step == 2


class _EvalCrashRecipe(ClassifyRecipe):
    """Dies in the ``crash_at``-th validation: a kill after the step's checkpoint, before validation."""

    def __init__(self, *a, crash_at, **kw):
        super().__init__(*a, **kw)
        self.crash_at, self.evals = crash_at, 0

    def metrics(self, outputs):
        self.evals += 1
        if self.evals == self.crash_at:
            raise _Crash("killed after the last step's checkpoint, before its validation")
        return super().metrics(outputs)


@pytest.mark.parametrize("max_steps", [40, 48])  # the last step inside an epoch, and at an epoch's end
def test_resume_after_a_kill_before_the_final_validation_validates_and_selects(tmp_path, max_steps):
    cfg = dict(max_epochs=10, max_steps=max_steps, batch_size=16, checkpoint_every_steps=1, log_every_steps=4,
               monitor="val/loss", monitor_mode="min")
    torch.manual_seed(0)
    reference = TinyNet(dropout=0.3)
    init = {k: v.clone() for k, v in reference.state_dict().items()}
    expected = Trainer(_cfg(**cfg), run_dir=tmp_path / "a").fit(
        ClassifyRecipe(reference, make_dataset(), make_dataset(seed=1)))
    killed = TinyNet(dropout=0.3)
    killed.load_state_dict(init)
    with pytest.raises(_Crash):
        Trainer(_cfg(**cfg), run_dir=tmp_path / "b").fit(
            _EvalCrashRecipe(killed, make_dataset(), make_dataset(seed=1), crash_at=3))
    resumed = TinyNet(dropout=0.3)
    result = Trainer(_cfg(resume=True, **cfg), run_dir=tmp_path / "b").fit(
        ClassifyRecipe(resumed, make_dataset(), make_dataset(seed=1)))
    assert result.global_step == expected.global_step == max_steps
    assert result.best_step == expected.best_step and result.best_metric == pytest.approx(expected.best_metric)
    assert result.last_val == pytest.approx(expected.last_val)
    vals = lambda r: [(x["step"], round(x["loss"], 6)) for x in r.history if x.get("split") == "val"]  # noqa: E731
    assert vals(result) == vals(expected)
    for key, value in reference.state_dict().items():  # the selected (best) model is the one returned
        assert torch.equal(value, resumed.state_dict()[key]), key
