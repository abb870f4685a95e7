"""The `traffic` synthetic set's statistics, as quoted in docs/synthetic-data.md.

    python bench/traffic_stats.py [--images 2000] [--seed 0] [--height 192] [--width 320]

Generates the train split's images in memory (the same images `qatpipe data synth --kind traffic` writes) and
prints objects per image, box widths, class counts, occlusion and truncation, and how SSD's matching (the default
spec's priors at this size, SSD.encode's rule) serves the objects: how many share their best prior with another
object in the image (only one of them keeps it; TAO's bipartite match would move the other to its next-best
prior), and how many of those are then left with no prior at all (none other reaches pos_iou_threshold).
"""

from __future__ import annotations

import argparse
import collections

import numpy as np

from qatpipe.data.synth import traffic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--height", type=int, default=192)
    parser.add_argument("--width", type=int, default=320)
    args = parser.parse_args()
    small = 28.0 * args.height / 192.0
    per_image, rows, boxes = [], [], []
    for i in range(args.images):
        _, objects = traffic.generate_traffic(np.random.default_rng([args.seed, 0, i]), args.height, args.width)
        per_image.append(len(objects))
        boxes.append(np.array([o["box"] for o in objects], float).reshape(-1, 4))
        rows += [(o["class"], o["box"][2] - o["box"][0], o["box"][3] - o["box"][1], o["occluded"], o["hidden"],
                  o["truncated"]) for o in objects]
    per_image = np.array(per_image)
    classes = [r[0] for r in rows]
    width, height, occluded, hidden, truncated = (np.array([r[k] for r in rows], float) for k in range(1, 6))
    counts = collections.Counter(classes)
    print(f"{args.images} images {args.height}x{args.width}, seed {args.seed}: {len(rows)} objects")
    print(f"objects per image: min {per_image.min()}, mean {per_image.mean():.2f}, max {per_image.max()}; "
          f"images with 2..10: {np.bincount(per_image, minlength=11)[2:].tolist()}")
    print(f"box width px: min {width.min():.1f}, p5/25/50/75/95 "
          f"{'/'.join(f'{v:.1f}' for v in np.percentile(width, [5, 25, 50, 75, 95]))}, max {width.max():.1f}; "
          f"under {small:.0f} px: {(width < small).mean():.1%}")
    print(f"box height px: min {height.min():.1f}, median {np.median(height):.1f}, max {height.max():.1f}")
    print("classes (count, share, median width, under %.0f px):" % small)
    for cls in traffic.TRAFFIC_CLASSES:
        w = width[np.array(classes) == cls]
        share = counts[cls] / len(rows)
        print(f"  {cls:10s} {counts[cls]:6d} {share:6.1%} {np.median(w):6.1f} {(w < small).mean():6.1%}")
    print(f"most / least common: {max(counts.values()) / min(counts.values()):.1f}")
    print(f"occluded 0/1/2: {'/'.join(f'{(occluded == k).mean():.1%}' for k in range(3))}; any pixel hidden "
          f"{(hidden > 0).mean():.1%}; hidden >= 30% {(hidden >= 0.3).mean():.1%}; max hidden {hidden.max():.3f}")
    ssd_matching(boxes, args.height, args.width, small)
    cut = truncated[truncated > 0]
    print(f"truncated > 0: {(truncated > 0).mean():.1%} (mean {cut.mean():.2f}, max {cut.max():.2f}); "
          f">= 0.3: {(truncated >= 0.3).mean():.1%}")


def ssd_matching(boxes: list[np.ndarray], height: int, width: int, small: float) -> None:
    """Per image: each object's best prior (argmax IoU); where several objects share one, the last keeps it
    (SSD.encode's scatter); a loser is served only by priors whose best object it is at >= pos_iou_threshold."""
    from qatpipe.boxes import centres_to_corners, iou_matrix
    from qatpipe.models.ssd import SSD
    from qatpipe.spec import bundled_spec_path, load_spec

    spec = load_spec(bundled_spec_path("full"), ["model.arch=ssd", f"dataset.image_size.height={height}",
                                                    f"dataset.image_size.width={width}"])
    priors = centres_to_corners(SSD(spec).priors) * [width, height, width, height]
    threshold = spec.model.target.pos_iou_threshold
    lost = unserved = lost_small = unserved_small = 0
    for image in boxes:
        if not len(image):
            continue
        ious = iou_matrix(image, priors)  # (objects, priors)
        best = ious.argmax(axis=1)
        best_object = ious.argmax(axis=0)
        for i, prior in enumerate(best):
            if (best[i + 1:] == prior).any():  # a later object takes it
                narrow = image[i, 2] - image[i, 0] < small
                lost += 1
                lost_small += narrow
                if not ((ious[i] >= threshold) & (best_object == i)).any():
                    unserved += 1
                    unserved_small += narrow
    total = sum(len(image) for image in boxes)
    print(f"SSD matching ({len(priors)} priors, pos_iou_threshold {threshold}): {lost} of {total} objects "
          f"({lost / total:.2%}) share their best prior and lose it ({lost_small} under {small:.0f} px); "
          f"{unserved} ({unserved / total:.2%}; {unserved_small} under {small:.0f} px) are then left with no prior")


if __name__ == "__main__":
    main()
