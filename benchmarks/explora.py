"""ExPLoRA benchmark: one DINOv2 extended-pretraining step, ExPLoRA vs full training, and
LoRA-merged inference vs the plain ViT.

    python benchmarks/explora.py                      # ViT-S/14, 224 px, CPU-sized defaults
    python benchmarks/explora.py --size large --batch 32 --n-local 8 --device cuda

Printed per configuration: trainable parameters (backbone / all incl. the DINO head), median
time of one full step (teacher forward, student forward + backward, AdamW step, EMA update),
the exact bytes of gradients + AdamW state (2 fp32 moments per trainable parameter), and the
peak memory (CUDA: max allocated; CPU: peak RSS of a fresh subprocess per configuration).
Inference: median forward time of the plain timm ViT, the ViT with unmerged LoRA, with merged
LoRA (wrappers kept) and with merged + unloaded LoRA (plain modules again).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

SIZES = {"test": "explora-test", "small": "explora-dinov2-vit-small", "base": "explora-dinov2-vit-base",
         "large": "explora-dinov2-vit-large"}


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, reps, device, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _backbone(args, **kw):
    from domainfm import create_model

    extra = {"img_size": args.img, "n_outputs": 0, **kw}
    if args.size == "test":
        extra.update(patch_size=4)
    return create_model(SIZES[args.size], **extra)


def step_benchmark(args, adapter: bool) -> dict:
    from domainfm import lora
    from domainfm.pretrain import explora as E

    torch.manual_seed(0)
    device = args.device
    backbone = _backbone(args, dynamic_img_size=True, drop_path_rate=0.3)
    if adapter:
        lora.apply(backbone, preset="explora")
    settings = E.DinoSection(n_prototypes=args.prototypes, global_size=args.img, local_size=args.local,
                             n_local=args.n_local)
    pt = E.DinoPretrainer(backbone, settings).to(device)
    recipe = E.DinoRecipe(pt, [None], n_patches=(args.img // backbone.patch_embed.patch_size[0]) ** 2)
    params = [p for p in pt.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.04)
    crops = [torch.randn(args.batch, 3, args.img, args.img, device=device) for _ in range(2)]
    crops += [torch.randn(args.batch, 3, args.local, args.local, device=device) for _ in range(args.n_local)]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else torch.autocast("cpu", enabled=False)
    counter = {"step": 0}

    def one_step():
        with autocast:
            loss, _ = recipe.step(pt, crops)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 3.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        counter["step"] += 1
        recipe.on_train_step_end(pt, counter["step"], 1000)

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    seconds = _timed(one_step, args.reps, device)
    trainable_backbone = lora.count_trainable(backbone)
    trainable_all = sum(p.numel() for p in params)
    out = {
        "config": "explora" if adapter else "full",
        "trainable_backbone": trainable_backbone,
        "total_backbone": sum(p.numel() for p in backbone.parameters()),
        "trainable_all": trainable_all,
        "step_s": seconds,
        "grad_plus_adamw_state_MiB": trainable_all * 4 * 3 / 2**20,
    }
    if device.startswith("cuda"):
        out["peak_MiB"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        out["peak_rss_MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


@torch.no_grad()
def inference_benchmark(args) -> dict:
    import copy

    from domainfm import lora

    torch.manual_seed(0)
    device = args.device
    plain = _backbone(args).to(device).eval()
    # random DINOv2 init has LayerScale 1e-5, which would hide any adapter; trained ViTs do not
    for name, p in plain.named_parameters():
        if name.endswith("gamma"):
            p.fill_(1.0)
    adapted = copy.deepcopy(plain)
    lora.apply(adapted, preset="explora")
    with torch.no_grad():  # non-zero adapters, so merging really changes weights
        for n, p in adapted.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    x = torch.randn(args.batch, 3, args.img, args.img, device=device)
    res = {"plain_vit_s": _timed(lambda: plain(x), args.reps, device)}
    res["lora_unmerged_s"] = _timed(lambda: adapted(x), args.reps, device)
    reference = adapted(x)
    res["adapter_effect_max_abs"] = float((reference - plain(x)).abs().max())
    lora.merge(adapted)
    res["lora_merged_s"] = _timed(lambda: adapted(x), args.reps, device)
    res["merged_max_abs_diff"] = float((adapted(x) - reference).abs().max())
    lora.unmerge(adapted)
    lora.merge(adapted, unload=True)
    res["lora_merged_unloaded_s"] = _timed(lambda: adapted(x), args.reps, device)
    res["unloaded_same_module_types"] = [type(m).__name__ for m in adapted.modules()] == [type(m).__name__ for m in plain.modules()]
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--img", type=int, default=224)
    parser.add_argument("--local", type=int, default=98)
    parser.add_argument("--n-local", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prototypes", type=int, default=65536)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", choices=["explora", "full", "inference"], default=None,
                        help="run one part in this process (used for per-configuration peak RSS)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.only:
        result = inference_benchmark(args) if args.only == "inference" else step_benchmark(args, args.only == "explora")
        print(json.dumps(result))
        return 0
    results = {}
    for part in ("explora", "full", "inference"):
        cmd = [sys.executable, __file__, *[a for a in (argv if argv is not None else sys.argv[1:])], "--only", part]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        results[part] = json.loads(out)
    e, f, i = results["explora"], results["full"], results["inference"]
    print(f"ExPLoRA benchmark: {SIZES[args.size]} img {args.img}, batch {args.batch} x (2 global + {args.n_local} "
          f"local {args.local}px), {args.prototypes} prototypes, device {args.device}, threads {torch.get_num_threads()}")
    mem_key = "peak_MiB" if "peak_MiB" in e else "peak_rss_MiB"
    print(f"{'':28s}{'ExPLoRA':>16s}{'full':>16s}{'ratio':>10s}")
    for key in ("trainable_backbone", "trainable_all", "step_s", "grad_plus_adamw_state_MiB", mem_key):
        ratio = e[key] / f[key] if f[key] else float("nan")
        fmt = "{:>16,.0f}" if isinstance(e[key], int) else "{:>16.3f}"
        print(f"{key:28s}" + fmt.format(e[key]) + fmt.format(f[key]) + f"{ratio:>10.3f}")
    print(f"backbone params: {e['total_backbone']:,}; ExPLoRA trains {100 * e['trainable_backbone'] / e['total_backbone']:.2f}% of it")
    print("inference (median s / forward):")
    for key in ("plain_vit_s", "lora_unmerged_s", "lora_merged_s", "lora_merged_unloaded_s"):
        print(f"  {key:26s}{i[key]:.4f}  ({i[key] / i['plain_vit_s']:.3f} x plain)")
    print(f"  merged vs unmerged max |diff|: {i['merged_max_abs_diff']:.2e} (adapter changes outputs by up to "
          f"{i['adapter_effect_max_abs']:.2e}); unloaded model has the plain "
          f"ViT's module types: {i['unloaded_same_module_types']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
