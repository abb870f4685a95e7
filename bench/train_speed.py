"""Benchmark: how close training runs to this CPU's limit (issue 55, item 4).

    python bench/train_speed.py [--spec default] [--set KEY=VALUE ...] [--steps 40] [--jit] [--cache]
                                [--data DIR]

On the spec's detector and its training data (the synthetic set of the spec, written once into DATA):
- `input`: the training input pipeline alone (decode, augment, encode targets), batches/s as img/s;
- `model`: training steps on one fixed batch held in memory (the convolutions' share, no input work);
- `train`: training steps fed by the input pipeline, as `qatpipe train` runs them.
Each is timed over STEPS steps after a warm-up of 5. Beside them: GFLOP per training image (3 x the forward
convolutions' FLOPs: forward, and backward for inputs and weights), the GFLOP/s that makes, and the CPU's FP32
FMA peak from its flags, core count and clock (2 FMA units per core: 64 FLOP/cycle with AVX-512, 32 with AVX2).
`--jit` compiles the training step with XLA (jit_compile); `--cache` keeps each decoded image in memory after
its first decoding (a py_function in front of the augmentation). Prints the CPU with its flags; writes
WORK/bench_train_speed.json. Under ONEDNN_MAX_CPU_ISA=AVX2 the peak is AVX2's (oneDNN kept to AVX2 on this CPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("bench")
WARMUP = 5


def cpu() -> dict:
    from qatpipe.devices import cpu_flags, cpu_name

    flags = cpu_flags()
    max_khz = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    clock = [line.split(":", 1)[1] for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("cpu MHz")]
    mhz = int(max_khz.read_text()) / 1000 if max_khz.is_file() else float(clock[0]) if clock else float("nan")
    cores = len(os.sched_getaffinity(0))
    per_cycle = 64 if "avx512f" in flags else 32 if {"avx2", "fma"} <= flags else 16
    # ONEDNN_MAX_CPU_ISA=AVX2 keeps oneDNN's kernels (TensorFlow's convolutions) to AVX2 on an AVX-512 CPU: an
    # estimate for the AVX2-only machine kind on this one (other cores and clock, so not that kind's figure)
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    if isa.lower().startswith("avx2"):
        per_cycle = min(per_cycle, 32)
    shown = [flag for flag in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
             if flag in flags]
    return {"name": cpu_name(), "flags": shown, "onednn_max_cpu_isa": isa or None, "cores": cores, "mhz": mhz,
            "fp32_flop_per_cycle": per_cycle, "peak_gflops": round(cores * mhz * 1e-3 * per_cycle, 1)}


def timed(step, steps: int, batch: int) -> float:
    for _ in range(WARMUP):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="default")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--jit", action="store_true", help="XLA-compile the training step (jit_compile=True)")
    parser.add_argument("--cache", action="store_true", help="cache the decoded images in memory")
    parser.add_argument("--data", type=Path, default=Path("results/bench_data"))
    parser.add_argument("--work", type=Path, default=Path("results/bench_train_speed"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")

    import tensorflow as tf

    from qatpipe.data import pipeline
    from qatpipe.data.splits import load_split
    from qatpipe.data.synth import write_synthetic_dataset
    from qatpipe.models import get_architecture
    from qatpipe.pruning.cost import conv_flops
    from qatpipe.spec_sources import load_spec_uri
    from qatpipe.stages.train import build_optimizer
    from qatpipe.training.precision import configure_precision

    spec = load_spec_uri(args.spec, args.overrides)
    synthetic = spec.dataset.synthetic
    data = args.data / f"{synthetic.kind}_{synthetic.train_images}_{synthetic.seed}_{spec.dataset.image_size.height}x{spec.dataset.image_size.width}"
    if not (data / "train").is_dir():
        write_synthetic_dataset(data, num_train=synthetic.train_images, num_val=1, seed=synthetic.seed,
                                kind=synthetic.kind, image_height=spec.dataset.image_size.height,
                                image_width=spec.dataset.image_size.width)
    spec.dataset.train = str(data / "train")
    samples = load_split(spec, "train")
    precision = configure_precision(spec.train.use_amp)  # train.use_amp as qatpipe train applies it
    arch = get_architecture(spec)
    model = arch.build_model()
    model.compile(optimizer=build_optimizer(spec, total_steps=10_000), loss=arch.losses(), jit_compile=args.jit)
    batch = spec.train.batch_size

    if args.cache:  # decoded once, then served from memory: the decoding leaves the per-epoch work
        decode = pipeline.decode_image_file
        cache: dict[bytes, tf.Tensor] = {}

        def cached(path):
            return tf.py_function(lambda p: cache.setdefault(p.numpy(), decode(p)), [path], tf.float32)

        pipeline.decode_image_file = lambda path: tf.ensure_shape(cached(path), [None, None, 3])
    dataset, _ = pipeline.train_dataset(samples, spec, arch)
    iterator = iter(dataset)
    rates = {"input": timed(lambda: next(iterator), args.steps, batch)}
    images, targets = next(iterator)
    rates["model"] = timed(lambda: model.train_on_batch(images, targets), args.steps, batch)
    rates["train"] = timed(lambda: model.train_on_batch(*next(iterator)), args.steps, batch)

    machine = cpu()
    gflop = 3 * conv_flops(model) / 1e9
    result = {"spec": args.spec, "overrides": args.overrides, "arch": spec.model.arch,
              "backbone": spec.model.backbone.model_dump(), "image_size": spec.dataset.image_size.model_dump(),
              "batch": batch, "jit": args.jit, "cache": args.cache, "precision": precision.policy, "cpu": machine,
              "gflop_per_training_image": round(gflop, 3),
              "img_per_s": {key: round(value, 1) for key, value in rates.items()},
              "gflops": {key: round(value * gflop, 1) for key, value in rates.items() if key != "input"}}
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "bench_train_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"CPU: {machine['name']}, {machine['cores']} cores at {machine['mhz']:.0f} MHz, {' '.join(machine['flags'])}"
          f"; FP32 FMA peak {machine['peak_gflops']} GFLOP/s ({machine['fp32_flop_per_cycle']} FLOP/cycle/core)"
          + (f"; oneDNN kept to {machine['onednn_max_cpu_isa']}" if machine["onednn_max_cpu_isa"] else ""))
    print(f"{spec.model.arch} {arch_label(spec)} at {spec.dataset.image_size.height}x{spec.dataset.image_size.width}, "
          f"batch {batch}: {gflop:.2f} GFLOP per training image; jit {args.jit}, cache {args.cache}, "
          f"{precision.policy}")
    for key, label in (("input", "input pipeline alone"), ("model", "model on a fixed batch"),
                       ("train", "training as qatpipe train runs it")):
        extra = (f"  {result['gflops'][key]:7.1f} GFLOP/s  {result['gflops'][key] / machine['peak_gflops']:.0%} of peak"
                 if key in result["gflops"] else "")
        print(f"  {label:36s} {rates[key]:8.1f} img/s{extra}")


def arch_label(spec) -> str:
    from qatpipe.models.backbones import backbone_module

    return backbone_module(spec.model.backbone.name).label(spec.model.backbone)


if __name__ == "__main__":
    main()
