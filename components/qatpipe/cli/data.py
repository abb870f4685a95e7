"""`qatpipe data synth | upload`: a synthetic KITTI data set, and a local one pushed to S3 for the cluster."""

from __future__ import annotations

import json
from pathlib import Path

from qatpipe.cli.common import add_overrides, at_least, log
from qatpipe.errors import QatpipeError

SPLITS = ("train", "val")


def add_commands(sub) -> None:
    from qatpipe.data.synth import KINDS
    from qatpipe.spec import ImageSize, SyntheticDataSpec, field_default

    data = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", required=True)
    synth = data.add_parser("synth", help="write a synthetic KITTI dataset (DIR/train, DIR/val)")
    synth.add_argument("--out", required=True, type=Path)
    synth.add_argument("--train", type=at_least(0), default=field_default(SyntheticDataSpec, "train_images"),
                       help="training images")
    synth.add_argument("--val", type=at_least(0), default=field_default(SyntheticDataSpec, "val_images"),
                       help="validation images")
    synth.add_argument("--seed", type=int, default=field_default(SyntheticDataSpec, "seed"))
    synth.add_argument("--height", type=at_least(32), default=field_default(ImageSize, "height"))
    synth.add_argument("--width", type=at_least(32), default=field_default(ImageSize, "width"))
    synth.add_argument("--kind", choices=sorted(KINDS), default=field_default(SyntheticDataSpec, "kind"),
                       help="shapes (3 classes by outline); glyphs, photos (10 classes by internal detail); "
                            "traffic (10 imbalanced classes in crowded scenes)")
    synth.add_argument("--object-height", type=float, nargs=2, metavar=("MIN", "MAX"),
                       help="object box sizes in px at a 192-px-high image: heights (shapes), sides (glyphs, "
                            "photos) or widths (traffic); default: the kind's")
    synth.add_argument("--overwrite", action="store_true", help="replace existing train/val folders")
    synth.set_defaults(func=cmd_synth, check=check_synth, writes=lambda a: a.out)

    upload = data.add_parser("upload", help="upload a local data set (DIR/train, DIR/val) to S3 for the cluster")
    upload.add_argument("--src", required=True, type=Path, help="the data set folder")
    upload.add_argument("--to", required=True, help="s3://bucket/prefix (credentials: the AWS_* variables)")
    upload.add_argument("-e", "--experiment-spec", help="check train/ and val/ against this spec's classes first")
    add_overrides(upload)
    upload.set_defaults(func=cmd_upload)


def check_synth(args) -> None:
    """Both splits and the object sizes, before the folder is locked or anything is written."""
    if args.object_height and not 4 <= args.object_height[0] <= args.object_height[1]:
        raise QatpipeError(f"--object-height {args.object_height[0]:g} {args.object_height[1]:g}: need "
                           f"4 <= MIN <= MAX")
    if not args.overwrite:
        for split in SPLITS:
            folder = args.out / split
            if folder.is_dir() and any(folder.iterdir()):
                raise QatpipeError(f"{folder}: exists and is not empty; choose another --out, or give --overwrite "
                                   f"to replace it")


def cmd_synth(args) -> int:
    from qatpipe.data.synth import write_synthetic_dataset

    summary = write_synthetic_dataset(
        args.out, args.train, args.val, args.seed, image_height=args.height, image_width=args.width,
        overwrite=args.overwrite, object_height_px=tuple(args.object_height) if args.object_height else None,
        kind=args.kind,
    )
    log.info("synthetic dataset written to %s: %s", args.out, json.dumps(summary))
    return 0


def cmd_upload(args) -> int:
    """Push a local data set to S3 for the cluster path; with -e, its train/ and val/ are first checked as the
    pipeline will read them (KITTI layout, labels, the spec's classes), so a bad file fails here."""
    from qatpipe.storage import parse_s3_uri, upload_dir

    parse_s3_uri(args.to)  # a wrong destination fails before the data set is read
    if args.experiment_spec:
        from qatpipe.cli.common import load_spec
        from qatpipe.data.prepare import spec_with_prepared_dataset
        from qatpipe.data.splits import load_split

        spec = spec_with_prepared_dataset(load_spec(args), args.src, dict(zip(SPLITS, SPLITS)))
        for split in SPLITS:
            log.info("%s: %d images checked", split, len(load_split(spec, split)))
    count = upload_dir(args.src, args.to)
    print(f"{count} files uploaded to {args.to} (dataset.train: {args.to.rstrip('/')}/train, dataset.val: "
          f"{args.to.rstrip('/')}/val)")
    return 0
