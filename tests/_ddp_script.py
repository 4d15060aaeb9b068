"""Run under `torchrun --nproc_per_node=2`: trains the tiny net with DDP (gloo) and writes each
rank's final weights to OUT/rank{r}.safetensors."""
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from _engine_toys import ClassifyRecipe, TinyNet, make_dataset  # noqa: E402

from domainfm.engine import TrainConfig, Trainer  # noqa: E402

out = Path(sys.argv[1])
torch.manual_seed(0)
model = TinyNet(dropout=0.0)
cfg = TrainConfig(max_epochs=2, batch_size=16, lr=1e-2, progress=False, accelerator="cpu", strategy="ddp", devices=2,
                  monitor="val/accuracy", monitor_mode="max")
trainer = Trainer(cfg, run_dir=out / "run")
result = trainer.fit(ClassifyRecipe(model, make_dataset(n=128), make_dataset(n=60, seed=1)))
rank = trainer.fabric.global_rank
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / f"rank{rank}.safetensors"))
(out / f"rank{rank}.txt").write_text(f"{trainer.fabric.world_size} {result.global_step} {result.last_val['accuracy']}\n")
