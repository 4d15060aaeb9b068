"""Chronos-Bolt forecast speed: domainfm's ChronosBolt vs chronos-forecasting's ChronosBoltPipeline.
Not run in CI.

    python benchmarks/chronos_bolt.py [--size small] [--threads 2] [--batch 64] [--context 512] [--repeats 5]

Both load the same randomly initialised upstream checkpoint (written by the installed
``chronos-forecasting`` package into a temporary folder; speed only). Calls are interleaved (ours,
theirs, ours, ...) so that load on a shared machine hits both alike; the median of each is
printed with the ratio pipeline / ours (> 1: ours faster), in fp32 and in bf16 (the pipeline
with bf16 weights, as its users load it; ours under ``domainfm.precision.autocast("bf16-mixed")``,
the house rule: fp32 weights, bf16 compute).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch

import domainfm
from domainfm import zoo
from domainfm.precision import autocast


def write_upstream(directory: str, name: str) -> None:
    import transformers
    from chronos.chronos_bolt import ChronosBoltModelForForecasting

    d = zoo.get_card(name).defaults
    config = transformers.T5Config(d_model=d["d_model"], d_ff=d["d_ff"], d_kv=d["d_kv"], num_layers=d["num_layers"],
                                   num_decoder_layers=d["num_layers"], num_heads=d["num_heads"], dropout_rate=0.1,
                                   initializer_factor=0.05, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    config.architectures = ["ChronosBoltModelForForecasting"]
    config.chronos_pipeline_class = "ChronosBoltPipeline"
    config.chronos_config = {k: d[k] for k in ("context_length", "prediction_length", "input_patch_size",
                                               "input_patch_stride", "quantiles", "use_reg_token")}
    torch.manual_seed(0)
    ChronosBoltModelForForecasting(config).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="small", choices=["tiny", "mini", "small", "base"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from chronos import BaseChronosPipeline

    name = f"chronos-bolt-{args.size}"
    g = torch.Generator().manual_seed(0)
    context = torch.cumsum(torch.randn(args.batch, args.context, generator=g), dim=1) + 10
    print(f"{name}: batch {args.batch} x context {args.context}, horizon 64, torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as directory, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write_upstream(directory, name)
        ours = domainfm.create_model(name, pretrained=directory).eval()
        for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            pipeline = BaseChronosPipeline.from_pretrained(directory, dtype=dtype)
            precision = "32-true" if dtype == torch.float32 else "bf16-mixed"

            def run_ours():
                with autocast(precision, "cpu"):
                    return ours.predict(context)

            def run_theirs():
                return pipeline.predict(context)

            if dtype == torch.float32:
                assert torch.allclose(run_ours(), run_theirs(), atol=1e-4, rtol=1e-4)
            run_ours(), run_theirs()  # warm-up
            times = {"ours": [], "pipeline": []}
            for _ in range(args.repeats):
                for key, fn in (("ours", run_ours), ("pipeline", run_theirs)):
                    start = time.perf_counter()
                    fn()
                    times[key].append(time.perf_counter() - start)
            ours_s, theirs_s = statistics.median(times["ours"]), statistics.median(times["pipeline"])
            print(f"{label}: ours {ours_s * 1e3:8.1f} ms   pipeline {theirs_s * 1e3:8.1f} ms   "
                  f"pipeline/ours {theirs_s / ours_s:5.2f}   ({args.batch / ours_s:7.1f} series/s ours)")


if __name__ == "__main__":
    main()
