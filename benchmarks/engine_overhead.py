"""Steps/s of a small MLP through domainfm's Trainer vs a bare PyTorch loop, same process.

Both run identical work: AdamW, warmup-cosine LambdaLR, the same batches in the same order
(fixed permutation, batch 256), in fp32 and in bf16 autocast (``--precision``), one thread unless
--threads is given. Prints steps/s for each and the ratio Trainer/bare (1.0 = no overhead); the
figure is the median over interleaved repeats (order alternating, so load drift hits both alike).

    python benchmarks/engine_overhead.py [--steps 600] [--repeats 5] [--threads 1] [--precision 32-true bf16-mixed] [--clock wall|cpu]
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from domainfm.engine import Recipe, TrainConfig, Trainer, warmup_cosine


#: the clock both loops are timed with: wall time (default) or, with ``--clock cpu``, the process's
#: CPU time (one thread: the time it takes on a core of its own, robust to a loaded machine)
CLOCK = time.perf_counter


def make_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10))


class MLPRecipe(Recipe):
    def __init__(self, model, data):
        self.model, self.train_dataset = model, data

    def step(self, model, batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        return loss, {"loss": loss}


def bare_loop(model, data, steps, batch_size, lr, precision):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, steps, 10, 0.0))
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True, generator=generator)
    done = 0
    start = CLOCK()
    while done < steps:
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            done += 1
            if done >= steps:
                break
    return steps / (CLOCK() - start)


def trainer_loop(model, data, steps, batch_size, lr, precision):
    cfg = TrainConfig(max_steps=steps, batch_size=batch_size, lr=lr, warmup_steps=10, accelerator="cpu",
                      progress=False, log_every_steps=50, precision=precision)
    trainer = Trainer(cfg)  # no run_dir: nothing written, as in the bare loop
    start = CLOCK()
    result = trainer.fit(MLPRecipe(model, data))
    assert result.global_step == steps
    return steps / (CLOCK() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precision", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: elapsed time; cpu: process CPU time (for a loaded machine, one thread)")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(args.batch_size * 40, 64, generator=g), torch.randint(0, 10, (args.batch_size * 40,), generator=g))
    import statistics

    print(f"MLP 64-{args.width}-{args.width}-10, batch {args.batch_size}, {args.steps} steps, {args.threads} thread(s), {args.clock} clock")
    for precision in args.precision:
        bare, fabric = [], []
        runners = [(bare, bare_loop), (fabric, trainer_loop)]
        for r in range(args.repeats):
            for results, loop in runners if r % 2 == 0 else runners[::-1]:
                torch.manual_seed(r)
                results.append(loop(make_model(args.width), data, args.steps, args.batch_size, 1e-3, precision))
        ratios = [t / b for t, b in zip(fabric, bare)]
        b, t, ratio = statistics.median(bare), statistics.median(fabric), statistics.median(ratios)
        print(f"[{precision}] bare loop: {b:8.1f} steps/s  (runs: {', '.join(f'{v:.1f}' for v in bare)})")
        print(f"[{precision}] Trainer  : {t:8.1f} steps/s  (runs: {', '.join(f'{v:.1f}' for v in fabric)})")
        print(f"[{precision}] ratio Trainer/bare (median of pairs): {ratio:.3f}  (overhead {100 * (1 - ratio):+.1f}%)")


if __name__ == "__main__":
    main()
