"""`qatpipe` command line: TAO-like verbs over the stage functions."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import qatpipe  # noqa: F401 - sets TF_USE_LEGACY_KERAS before TensorFlow loads
from qatpipe.errors import QatpipeError

log = logging.getLogger("qatpipe")


def _spec_path(value: str) -> Path:
    """A spec file path, or the name of a bundled spec (`default`, `tiny`)."""
    from qatpipe.spec import bundled_spec_path

    path = Path(value)
    if path.exists() or path.suffix in (".yaml", ".yml") or "/" in value:
        return path
    return bundled_spec_path(value)


def _load(args):
    from qatpipe.spec import load_spec

    return load_spec(_spec_path(args.experiment_spec), args.overrides)


def _add_spec_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-e", "--experiment-spec", required=True,
                        help="spec YAML file, or a bundled spec name (default, tiny)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec key, e.g. --set train.epochs=5 (repeatable)")


def cmd_data_synth(args) -> int:
    from qatpipe.data.synth import write_synthetic_dataset

    summary = write_synthetic_dataset(
        args.out, args.train, args.val, args.seed, image_height=args.height, image_width=args.width,
        overwrite=args.overwrite, object_height_px=tuple(args.object_height),
    )
    log.info("synthetic dataset written to %s: %s", args.out, json.dumps(summary))
    return 0


def cmd_train(args) -> int:
    from qatpipe.stages.train import train

    summary = train(_load(args), args.results_dir, use_amp=True if args.use_amp else None)
    log.info("training done: %s", json.dumps({k: summary[k] for k in ("model", "images_per_second", "wall_seconds")}))
    return 0


def cmd_evaluate(args) -> int:
    from qatpipe.stages.evaluate import evaluate

    result = evaluate(_load(args), args.model, args.output_dir)
    log.info("metrics: %s", result["metrics_file"])
    print(f"mAP@0.5 {result['map50']:.4f}  mAP@[.5:.95] {result['map']:.4f}")  # the answer, for scripts
    return 0


def cmd_spec_show(args) -> int:
    import yaml

    sys.stdout.write(yaml.safe_dump(_load(args).to_dict(), sort_keys=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from qatpipe.data.synth import DEFAULT_OBJECT_HEIGHT_PX

    parser = argparse.ArgumentParser(prog="qatpipe", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", required=True)
    synth = data.add_parser("synth", help="write a synthetic KITTI dataset (DIR/train, DIR/val)")
    synth.add_argument("--out", required=True, type=Path)
    synth.add_argument("--train", type=int, default=2000, help="training images")
    synth.add_argument("--val", type=int, default=300, help="validation images")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--height", type=int, default=192)
    synth.add_argument("--width", type=int, default=320)
    synth.add_argument("--object-height", type=float, nargs=2, metavar=("MIN", "MAX"),
                       default=DEFAULT_OBJECT_HEIGHT_PX, help="object box heights in px at a 192-px-high image")
    synth.add_argument("--overwrite", action="store_true", help="replace existing train/val folders")
    synth.set_defaults(func=cmd_data_synth)

    train = sub.add_parser("train", help="train the spec's detector (FP32; resumes from checkpoints)")
    _add_spec_args(train)
    train.add_argument("-r", "--results-dir", required=True, type=Path)
    train.add_argument("--use-amp", action="store_true", help="mixed precision (GPU only; FP32 on CPU)")
    train.set_defaults(func=cmd_train)

    evaluate = sub.add_parser("evaluate", help="mAP of a model on the spec's val set")
    _add_spec_args(evaluate)
    evaluate.add_argument("-m", "--model", required=True, type=Path)
    evaluate.add_argument("-o", "--output-dir", type=Path, help="default: MODEL_DIR/evaluate")
    evaluate.set_defaults(func=cmd_evaluate)

    spec = sub.add_parser("spec", help="spec tools").add_subparsers(dest="spec_command", required=True)
    show = spec.add_parser("show", help="print the validated spec with every default filled in")
    _add_spec_args(show)
    show.set_defaults(func=cmd_spec_show)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
    )
    for noisy in ("botocore", "urllib3", "matplotlib", "PIL", "h5py", "absl"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except QatpipeError as exc:
        log.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        log.error("interrupted; re-run the same command to resume from the last checkpoint")
        return 130


if __name__ == "__main__":
    sys.exit(main())
