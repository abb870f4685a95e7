"""Make the packaged backbone start (`model.pretrained: qatpipe:<name>`) and its card, with the CLI's own verbs.

    python bench/packaged_start.py [--work DIR] [--images 4000] [--spec full] [--install]

In WORK (relative paths, so the card's commands run anywhere): the synthetic `shapes` and `photos` sets,
IMAGES training images each (seed 7; the default data is seed 0), then `qatpipe pretrain` of the spec's backbone
on both sets' object and background crops. Writes WORK/<name>.json, the card: what the start is and is not, the
exact commands, the data, the held-back top-1 against chance, and the SHA-256 of the weights file. `--install`
copies the weights and the card into components/qatpipe/weights/, where `qatpipe:<name>` finds them. Re-running
skips a step whose output is there.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

log = logging.getLogger("bench")
REPO = Path(__file__).resolve().parent.parent
SEED = 7
KINDS = ("shapes", "photos")


def run(command: list[str], cwd: Path) -> float:
    log.info("$ %s", " ".join(command))
    started = time.perf_counter()
    subprocess.run(command, cwd=cwd, check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("results/packaged_start"))
    parser.add_argument("--images", type=int, default=4000, help="training images of each synthetic set")
    parser.add_argument("--spec", default="full", help="the spec whose model.backbone and pretrain section are used")
    parser.add_argument("--install", action="store_true", help="copy the start into components/qatpipe/weights/")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from qatpipe.devices import cpu_name
    from qatpipe.models.backbones import backbone_module
    from qatpipe.spec import bundled_spec_path, load_spec
    from qatpipe.weights import FIT_FIELDS, sha256

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    qatpipe = str(Path(sys.executable).with_name("qatpipe"))
    commands, seconds = [], {}
    for kind in KINDS:
        command = ["qatpipe", "data", "synth", "--kind", kind, "--out", f"data/{kind}", "--train", str(args.images),
                   "--val", "1", "--seed", str(SEED)]
        commands.append(" ".join(command))
        if not (work / "data" / kind / "train").is_dir():
            seconds[f"synth_{kind}"] = round(run([qatpipe, *command[1:]], work), 1)
    data = ", ".join(f"data/{kind}/train" for kind in KINDS)
    command = ["qatpipe", "pretrain", "-e", args.spec, "-r", "pretrain", "--set", f"pretrain.data=[{data}]"]
    commands.append(" ".join(command[:-1]) + f" '{command[-1]}'")
    if not (work / "pretrain" / "weights.keras").is_file():
        seconds["pretrain"] = round(run([qatpipe, *command[1:]], work), 1)

    summary = json.loads((work / "pretrain" / "pretrain_summary.json").read_text())
    backbone = load_spec(bundled_spec_path(args.spec)).model.backbone
    fit = {name: getattr(backbone, name) for name in FIT_FIELDS}
    label = backbone_module(backbone.name).label(backbone)
    name = f"{backbone.name}{backbone.depth if backbone.name == 'resnet' else ''}-{backbone.width:g}-shapes-photos"
    weights = work / "pretrain" / "weights.keras"
    card = {
        "name": name,
        "file": f"{name}.keras",
        "sha256": sha256(weights),
        "bytes": weights.stat().st_size,
        "backbone": fit,
        "backbone_label": label,
        "what": (f"The {label} backbone (with its pretraining classifier head, which detectors ignore) trained by "
                 "qatpipe's own pretrain stage to classify object and background crops of two of its synthetic "
                 "data sets. A start for the embedded synthetic data and data like it, so that a short training "
                 "reaches what a long one from random weights does. It is not an ImageNet replacement: it has "
                 "seen no photograph of the real world, and the `shapes` set comes from the same generator as "
                 "the default data set (another seed), so on that data it is in-domain."),
        "commands": commands,
        "data": {kind: {"kind": kind, "train_images": args.images, "seed": SEED} for kind in KINDS},
        "pretrain": {key: summary[key] for key in ("classes", "num_classes", "epochs", "images", "crops",
                                                   "background_crops", "train_crops", "val_crops", "crop_size")},
        "top1": summary["top1"],
        "chance": summary["chance"],
        "majority": summary["majority"],
        "made": {"date": date.today().isoformat(), "cpu": cpu_name(), "spec": args.spec,
                 "seconds": seconds or "steps reused", "pretrain_wall_seconds": summary["wall_seconds"]},
    }
    card_path = work / f"{name}.json"
    card_path.write_text(json.dumps(card, indent=2) + "\n")
    log.info("%s: top-1 %.4f (chance %.4f) on %d held-back crops; SHA-256 %s; card %s", name, card["top1"],
             card["chance"], summary["val_crops"], card["sha256"], card_path)
    if args.install:
        target = REPO / "components" / "qatpipe" / "weights"
        shutil.copyfile(weights, target / card["file"])
        shutil.copyfile(card_path, target / card_path.name)
        log.info("installed into %s", target)


if __name__ == "__main__":
    main()
