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

Side by side with DINOv2's official ViT (issue 15):

    git --git-dir=<fetched dinov2 mirror> archive HEAD | tar -x -C /tmp/dinov2   # never committed
    python benchmarks/explora.py --official /tmp/dinov2 --threads 2 --n-local 8 --precision auto

times one *student* forward + backward (2 global + ``--n-local`` local crops through the backbone,
a squared-token loss on the normed class and patch tokens, backward) of our ViT-S/14 and of
``dinov2.models.vision_transformer.vit_small`` built from that checkout, with the same weights
(our state dict loaded into it; checked: eval outputs agree), the same per-block drop-path rates
(timm's linear rule up to ``--drop-path``, which DINOv2 also uses with ``drop_path_uniform=False``)
and the same LoRA (``lora.apply(..., preset="explora")`` on both). Interleaved in one process, each
repetition alternating the order; prints the median wall time and process CPU time of each, the
ratio official / ours, and each one's FLOPs (``torch.utils.flop_counter``) as a share of this
machine's matmul peak. Also timed: ``ours-before`` (timm's Block with per-sample DropPath, per-chunk
LoRA, SDPA attention: the state before issue 15). The official model's LoRA is the per-chunk loop
(``--official-lora unfused``, the default: the form an official LoRA of q and v takes) or our fused
path (``fused``).
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
    from domainfm.precision import autocast
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
    counter = {"step": 0}

    def one_step():
        with autocast(args.precision if args.precision != "both" else "auto", device):  # domainfm.precision's rule
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
    from domainfm.precision import autocast

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
    precision = args.precision if args.precision != "both" else "auto"

    def run(model):  # forward under domainfm.precision's rule; merge/unmerge stay outside (fp32)
        with autocast(precision, device):
            return model(x).float()

    res = {"plain_vit_s": _timed(lambda: run(plain), args.reps, device)}
    res["lora_unmerged_s"] = _timed(lambda: run(adapted), args.reps, device)
    reference = adapted(x)  # exactness of merging is checked in fp32 (bf16 would round the merged weights)
    res["adapter_effect_max_abs"] = float((reference - plain(x)).abs().max())
    lora.merge(adapted)
    res["lora_merged_s"] = _timed(lambda: run(adapted), args.reps, device)
    res["merged_max_abs_diff"] = float((adapted(x) - reference).abs().max())
    lora.unmerge(adapted)
    lora.merge(adapted, unload=True)
    res["lora_merged_unloaded_s"] = _timed(lambda: run(adapted), args.reps, device)
    res["unloaded_same_module_types"] = [type(m).__name__ for m in adapted.modules()] == [type(m).__name__ for m in plain.modules()]
    return res


# ---------------------------------------------------------------- side by side with DINOv2's official ViT

def _import_official(path: str):
    """``vit_small`` from a checkout of facebookresearch/dinov2 (needs only torch; xFormers off)."""
    import os
    import pathlib
    import warnings

    root = pathlib.Path(path).expanduser().resolve()
    if not (root / "dinov2" / "models" / "vision_transformer.py").is_file():
        raise SystemExit(f"--official {path}: expected a dinov2 checkout with dinov2/models/vision_transformer.py")
    os.environ.setdefault("XFORMERS_DISABLED", "1")  # its fallbacks are plain torch
    sys.path.insert(0, str(root))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from dinov2.models.vision_transformer import vit_small
    return vit_small


def _set_trained_like(model) -> None:
    """LayerScales at 1 and non-zero LoRA up factors (a random ViT's 1e-5 LayerScale and zero B
    would make every branch invisible in the agreement check)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.fill_(1.0)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def build_pair(args):
    """Ours, ours-before and the official ViT-S/14, all with the explora LoRA and the same weights."""
    from domainfm import create_model, lora
    from domainfm.lora.layer import LoraLayer

    vit_small = _import_official(args.official)
    torch.manual_seed(0)
    common = dict(img_size=args.img, n_outputs=0, dynamic_img_size=True, drop_path_rate=args.drop_path)
    ours = create_model("explora-dinov2-vit-small", **common)
    lora.apply(ours, preset="explora")
    _set_trained_like(ours)
    state = ours.state_dict()
    before = create_model("explora-dinov2-vit-small", efficient_drop_path=False, **common)
    lora.apply(before, preset="explora")
    official = vit_small(patch_size=14, img_size=args.img, init_values=1.0, block_chunks=0,
                         drop_path_rate=args.drop_path, drop_path_uniform=False)
    lora.apply(official, preset="explora")
    for name, model in (("ours-before", before), ("official", official)):
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"mask_token"}:
            raise RuntimeError(f"{name}: weights do not line up: missing {missing}, unexpected {unexpected}")
    # the very same per-block rates (timm keeps them in float32, DINOv2 in float64: at some batch
    # sizes int(B * (1 - rate)) would then differ by one sample and the two would do unequal work)
    for ob, mb in zip(official.blocks, ours.blocks):
        rate = float(mb.drop_path1.drop_prob) if hasattr(mb.drop_path1, "drop_prob") else 0.0
        ob.sample_drop_ratio = rate
        for dp in (ob.drop_path1, ob.drop_path2):
            if hasattr(dp, "drop_prob"):
                dp.drop_prob = rate
    for m in before.modules():
        if isinstance(m, LoraLayer):
            m.fuse_chunks = False
        if hasattr(m, "fused_attn"):
            m.fused_attn = True
    if args.official_lora == "unfused":
        for m in official.modules():
            if isinstance(m, LoraLayer):
                m.fuse_chunks = False
    counts = {n: lora.count_trainable(m) for n, m in (("ours", ours), ("ours-before", before), ("official", official))}
    if len(set(counts.values())) != 1:
        raise RuntimeError(f"trainable parameter counts differ: {counts}")
    return {"ours": ours, "ours-before": before, "official": official}, counts["ours"]


def _tokens(name, model, x):
    """Normed class token ``(B, D)`` and patch tokens ``(B, N, D)`` as the student computes them."""
    if name == "official":
        out = model.forward_features(x)
        return out["x_norm_clstoken"], out["x_norm_patchtokens"]
    from domainfm.pretrain.explora.dino import vit_tokens

    return vit_tokens(model, x)


def official_comparison(args) -> int:
    import contextlib

    from _peak import count_flops, matmul_peak, peak_line, share_of_peak

    from domainfm.precision import autocast, autocast_dtype, resolve_precision

    device = args.device
    models, trainable = build_pair(args)
    for m in models.values():
        m.to(device)
    # agreement check in fp32, eval mode (no drop path), global crops (no position-table resampling)
    x = torch.randn(2, 3, args.img, args.img, device=device)
    with torch.no_grad():
        ref = [t.float() for t in _tokens("ours", models["ours"].eval(), x)]
        diffs = {}
        for name in ("ours-before", "official"):
            got = _tokens(name, models[name].eval(), x)
            diffs[name] = max(float((a.float() - b).abs().max()) for a, b in zip(got, ref))
    if max(diffs.values()) > 1e-3:
        raise RuntimeError(f"the models do not compute the same function (fp32 max |diff| {diffs})")

    g = torch.Generator().manual_seed(0)
    globals_ = torch.randn(2 * args.batch, 3, args.img, args.img, generator=g).to(device)
    locals_ = torch.randn(args.n_local * args.batch, 3, args.local, args.local, generator=g).to(device)
    precisions = ["32-true", "auto"] if args.precision == "both" else [args.precision]
    threads = torch.get_num_threads()
    print(f"ExPLoRA student step vs DINOv2's official ViT ({args.official}): ViT-S/14, batch {args.batch} x "
          f"(2 global {args.img}px + {args.n_local} local {args.local}px), drop-path {args.drop_path} (linear over "
          f"depth), LoRA preset explora ({trainable:,} trainable), official LoRA {args.official_lora}, "
          f"device {device}, threads {threads}")
    print(f"fp32 eval agreement with ours (max |diff| of tokens): " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    print(peak_line(threads, device))
    for precision in precisions:
        resolved = resolve_precision(precision, device)
        dtype = autocast_dtype(precision, device) or torch.float32
        peak = matmul_peak(dtype, device, threads)
        # CPU-time accounting of several OpenMP threads is not reliable enough for a peak: 1 thread only
        cpu_peak = cpu_time_peak(dtype, threads) if device == "cpu" and threads == 1 else float("nan")

        def step(name, model=None):
            model = models[name]
            model.train()
            with autocast(precision, device) if resolved != "32-true" else contextlib.nullcontext():
                loss = 0.0
                for crops in (globals_, locals_):
                    cls, patches = _tokens(name, model, crops)
                    loss = loss + cls.float().square().mean() + patches.float().square().mean()
            loss.backward()
            for p in model.parameters():
                p.grad = None

        flops = {name: count_flops(step, name) for name in models}
        for name in models:  # warm-up
            step(name)
        wall = {name: [] for name in models}
        cpu = {name: [] for name in models}
        order = list(models)
        for rep in range(args.reps):
            for name in (order if rep % 2 == 0 else order[::-1]):
                _sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
                step(name)
                _sync(device)
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        med = {n: statistics.median(v) for n, v in wall.items()}
        med_cpu = {n: statistics.median(v) for n, v in cpu.items()}
        print(f"\n[{resolved}] median of {args.reps} interleaved steps (load average before: "
              f"{_loadavg()})")
        print(f"{'':14s}{'wall s':>9s}{'cpu s':>9s}{'GFLOP':>9s}{'GFLOP/s':>9s}{'of peak':>9s}{'cpu-time':>10s}"
              f"{'official/x wall':>17s}{'official/x cpu':>16s}")
        for name in models:
            rate = flops[name] / med[name] / 1e9
            cpu_share = share_of_peak(flops[name], med_cpu[name] / threads, cpu_peak)
            print(f"{name:14s}{med[name]:9.3f}{med_cpu[name]:9.3f}{flops[name] / 1e9:9.1f}{rate:9.1f}"
                  f"{100 * share_of_peak(flops[name], med[name], peak):8.1f}%{100 * cpu_share:9.1f}%"
                  f"{med['official'] / med[name]:16.2f}x{med_cpu['official'] / med_cpu[name]:15.2f}x")
        print(f"(matmul peak {peak:.0f} GFLOP/s wall-clock, {cpu_peak:.0f} GFLOP/s per CPU-second per thread, in "
              f"{str(dtype).replace('torch.', '')}; 'of peak' uses wall time, 'cpu-time' CPU time per thread; FLOPs "
              f"counted on one step each (the plain attention form counts its backward matmuls, SDPA's backward is "
              f"estimated), drop-path subsets drawn independently)")
    return 0


def cpu_time_peak(dtype: torch.dtype, threads: int, n: int = 2048, seconds: float = 1.5) -> float:
    """Best GFLOP/s of ``n x n`` CPU matmuls per *CPU second per thread* (``time.process_time``).

    On a shared machine the wall-clock peak (``_peak.matmul_peak``) drops whenever other processes
    hold the cores; CPU time does not count the time this process waits, so this peak and the
    CPU-time shares stay meaningful under load. Used with 1 thread only (with more, the CPU time
    of the OpenMP threads is not accounted precisely enough over one matmul)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    for _ in range(2):
        torch.mm(a, b, out=out)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        c0 = time.process_time()
        torch.mm(a, b, out=out)
        dt = (time.process_time() - c0) / max(threads, 1)
        if dt > 0:
            best = max(best, 2.0 * n ** 3 / dt / 1e9)
    return best


def _loadavg() -> str:
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "n/a"


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
    parser.add_argument("--official", default=None, metavar="PATH",
                        help="checkout of facebookresearch/dinov2: time the student step side by side with its ViT")
    parser.add_argument("--official-lora", choices=["unfused", "fused"], default="unfused",
                        help="LoRA form on the official ViT (default: per-chunk, as an official q/v LoRA)")
    parser.add_argument("--drop-path", type=float, default=0.3)
    parser.add_argument("--precision", default="auto",
                        help="with --official: auto (domainfm.precision), 32-true, bf16-mixed, or both (fp32 and auto)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.official:
        sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
        return official_comparison(args)
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
    from domainfm.precision import resolve_precision

    print(f"ExPLoRA benchmark: {SIZES[args.size]} img {args.img}, batch {args.batch} x (2 global + {args.n_local} "
          f"local {args.local}px), {args.prototypes} prototypes, device {args.device}, threads {torch.get_num_threads()}, "
          f"precision {resolve_precision(args.precision if args.precision != 'both' else 'auto', args.device)}")
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
    print(f"  merged vs unmerged max |diff| (fp32): {i['merged_max_abs_diff']:.2e} (adapter changes outputs by up to "
          f"{i['adapter_effect_max_abs']:.2e}); unloaded model has the plain "
          f"ViT's module types: {i['unloaded_same_module_types']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
