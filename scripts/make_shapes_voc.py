#!/usr/bin/env python
"""A VOC-format detection dataset of drawn shapes on varied backgrounds, for training SSD
detectors without downloading one:

    python scripts/make_shapes_voc.py OUT [--train 3000] [--test 500] [--seed 1]
                                          [--sizes 0.08,0.6] [--max-objects 4]

OUT gets JPEGImages/*.jpg, Annotations/*.xml (VOC: size, object name / difficult / bndbox in
pixels), trainval.txt and test.txt ("JPEGImages/x.jpg Annotations/x.xml" lines, as the SSD
fork's create_list.sh writes) and labelmap.prototxt. Five classes (circle, square, triangle,
star, ring) in random colours, 1-4 objects per image at 8-60% of the image's side (both
adjustable), images of
random size and aspect (160-280 px) over gradients, stripes, noise, blobs and clutter that
shares the objects' colours. An object mostly hidden by a later one is marked difficult.
The same seed gives the same files.
"""
import argparse
import math
import os
import sys

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

CLASSES = ("circle", "square", "triangle", "star", "ring")


def background(rng, w, h):
    kind = rng.integers(4)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    if kind == 0:                                            # linear gradient
        a = rng.uniform(0, 2 * np.pi)
        t = (x * np.cos(a) + y * np.sin(a))
        t = (t - t.min()) / max(t.max() - t.min(), 1)
    elif kind == 1:                                          # stripes
        a = rng.uniform(0, np.pi)
        period = rng.uniform(8, 40)
        t = 0.5 + 0.5 * np.sin((x * np.cos(a) + y * np.sin(a)) * 2 * np.pi / period)
    elif kind == 2:                                          # smooth noise
        small = rng.uniform(0, 1, (max(2, h // 24), max(2, w // 24)))
        t = np.asarray(Image.fromarray((small * 255).astype(np.uint8)).resize(
            (w, h), Image.BICUBIC), np.float32) / 255
    else:                                                    # radial
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        t = np.sqrt((x - cx) ** 2 + (y - cy) ** 2)
        t = t / max(t.max(), 1)
    img = c0[None, None] * (1 - t[..., None]) + c1[None, None] * t[..., None]
    img += rng.normal(0, rng.uniform(2, 14), img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def clutter(draw, rng, w, h):
    """Lines and small blobs, some in object-like colours, that are not objects."""
    for _ in range(rng.integers(0, 8)):
        color = tuple(int(v) for v in rng.integers(0, 256, 3))
        if rng.random() < 0.6:
            pts = [(float(rng.uniform(0, w)), float(rng.uniform(0, h))) for _ in range(2)]
            draw.line(pts, fill=color, width=int(rng.integers(1, 4)))
        else:
            r = rng.uniform(1, 4)
            cx, cy = rng.uniform(0, w), rng.uniform(0, h)
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)


def star_points(cx, cy, r, turn):
    pts = []
    for k in range(10):
        rad = r if k % 2 == 0 else r * 0.45
        a = turn + k * np.pi / 5
        pts.append((cx + rad * np.sin(a), cy - rad * np.cos(a)))
    return pts


def draw_shape(draw, name, box, color, rng):
    x0, y0, x1, y1 = box
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    r = (x1 - x0) / 2
    if name == "circle":
        draw.ellipse(box, fill=color)
    elif name == "square":
        draw.rectangle(box, fill=color)
    elif name == "triangle":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=color)
    elif name == "star":
        draw.polygon(star_points(cx, cy, r, 0.0), fill=color)
    elif name == "ring":
        width = max(2, int(r * rng.uniform(0.25, 0.45)))
        draw.ellipse(box, outline=color, width=width)


def tight_box(name, box):
    """The pixel box of the drawn shape (the star's points reach its box's edges only on
    some sides)."""
    x0, y0, x1, y1 = box
    if name != "star":
        return box
    pts = np.array(star_points((x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, 0.0))
    return (pts[:, 0].min(), pts[:, 1].min(), pts[:, 0].max(), pts[:, 1].max())


def make_image(rng, sizes=(0.08, 0.6), max_objects=4):
    w = int(rng.integers(160, 281))
    h = int(rng.integers(160, 281))
    img = background(rng, w, h)
    draw = ImageDraw.Draw(img)
    clutter(draw, rng, w, h)
    objects = []
    masks = []
    for _ in range(int(rng.integers(1, max_objects + 1))):
        name = CLASSES[int(rng.integers(len(CLASSES)))]
        side = rng.uniform(*sizes) * min(w, h)
        x0, y0 = rng.uniform(0, w - side), rng.uniform(0, h - side)
        box = (x0, y0, x0 + side, y0 + side)
        color = tuple(int(v) for v in rng.integers(0, 256, 3))
        draw_shape(draw, name, box, color, rng)
        mask = Image.new("L", (w, h), 0)
        draw_shape(ImageDraw.Draw(mask), name, box, 255, rng)
        masks.append(np.asarray(mask) > 0)
        objects.append([name, tight_box(name, box)])
    # Hidden parts: an object whose visible area is under 40% of its own is difficult.
    for k, (name, box) in enumerate(objects):
        own = masks[k]
        later = np.zeros_like(own)
        for m in masks[k + 1:]:
            later |= m
        visible = (own & ~later).sum() / max(own.sum(), 1)
        objects[k].append(visible < 0.4)
        objects[k].append(visible == 0)
    if rng.random() < 0.3:
        img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.2)))
    kept = [(n, b, d) for n, b, d, gone in objects if not gone]
    return img, kept


def voc_xml(stem, w, h, objects):
    lines = ["<annotation>", "  <folder>shapes</folder>", f"  <filename>{stem}.jpg</filename>",
             "  <size>", f"    <width>{w}</width>", f"    <height>{h}</height>",
             "    <depth>3</depth>", "  </size>"]
    for name, (x0, y0, x1, y1), difficult in objects:
        xmin, ymin = max(1, int(math.floor(x0)) + 1), max(1, int(math.floor(y0)) + 1)
        xmax, ymax = min(w, int(math.ceil(x1))), min(h, int(math.ceil(y1)))
        lines += ["  <object>", f"    <name>{name}</name>", "    <pose>Unspecified</pose>",
                  "    <truncated>0</truncated>", f"    <difficult>{int(difficult)}</difficult>",
                  "    <bndbox>", f"      <xmin>{xmin}</xmin>", f"      <ymin>{ymin}</ymin>",
                  f"      <xmax>{xmax}</xmax>", f"      <ymax>{ymax}</ymax>", "    </bndbox>",
                  "  </object>"]
    lines.append("</annotation>")
    return "\n".join(lines) + "\n"


def label_map_text():
    items = [("none_of_the_above", 0, "background")] + \
        [(name, k, name) for k, name in enumerate(CLASSES, 1)]
    return "".join(f'item {{\n  name: "{n}"\n  label: {k}\n  display_name: "{d}"\n}}\n'
                   for n, k, d in items)


def make_dataset(out, train=3000, test=500, seed=1, quality=90, sizes=(0.08, 0.6),
                 max_objects=4):
    """Write the dataset into `out`; returns the number of (train, test) images. `sizes`: the
    range of an object's side as a fraction of the image's shorter side."""
    os.makedirs(os.path.join(out, "JPEGImages"), exist_ok=True)
    os.makedirs(os.path.join(out, "Annotations"), exist_ok=True)
    for split, count, offset in (("trainval", train, 0), ("test", test, train)):
        lines = []
        for k in range(count):
            index = offset + k
            stem = f"{index:06d}"
            rng = np.random.default_rng([seed, index])
            img, objects = make_image(rng, sizes, max_objects)
            img.save(os.path.join(out, "JPEGImages", stem + ".jpg"), quality=quality)
            with open(os.path.join(out, "Annotations", stem + ".xml"), "w") as f:
                f.write(voc_xml(stem, img.width, img.height, objects))
            lines.append(f"JPEGImages/{stem}.jpg Annotations/{stem}.xml\n")
        with open(os.path.join(out, f"{split}.txt"), "w") as f:
            f.writelines(lines)
    with open(os.path.join(out, "labelmap.prototxt"), "w") as f:
        f.write(label_map_text())
    return train, test


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--train", type=int, default=3000)
    ap.add_argument("--test", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sizes", default="0.08,0.6",
                    help="min,max side of an object as a fraction of the image's shorter side")
    ap.add_argument("--max-objects", type=int, default=4)
    args = ap.parse_args(argv)
    sizes = tuple(float(v) for v in args.sizes.split(","))
    n = make_dataset(args.out, args.train, args.test, args.seed, sizes=sizes,
                     max_objects=args.max_objects)
    print(f"wrote {n[0]} training and {n[1]} test images to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
