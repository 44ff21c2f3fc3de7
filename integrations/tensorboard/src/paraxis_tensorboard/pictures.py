"""Pictures for TensorBoard's image panel, as uint8 arrays (height, width, RGB).

TensorBoard shows raster images only, and the run's pictures are SVG documents (the
pipeline's measured timeline) or arrays of numbers (the MoE load per layer and expert):

* :func:`load_heatmap` paints the layer x expert tokens assigned, one cell per expert,
  shaded by its load over its layer's mean on the scale paraxis-wandb's heatmap uses
  (white: none, mid blue: the mean, dark: twice the mean or more);
* :func:`svg_picture` paints an SVG document's rectangles (fill and a one-pixel
  stroke) in document order (the timeline is rectangles: a pass per cell, idle in
  grey). Its text is not drawn: the SVG itself, with its labels, is written in the
  run's directory.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import numpy as np

from paraxis.parallel.metric_names import MoeArrays

__all__ = ["load_heatmap", "svg_picture"]

CELL = 24  # pixels per heatmap cell
NAMED = {"white": (255, 255, 255), "black": (0, 0, 0), "grey": (128, 128, 128),
         "gray": (128, 128, 128), "red": (255, 0, 0), "green": (0, 128, 0),
         "blue": (0, 0, 255)}


def _shade(ratio: float) -> tuple[int, int, int]:
    shade = min(max(ratio, 0.0) / 2.0, 1.0)
    return (int(255 - 225 * shade), int(255 - 165 * shade), int(255 - 55 * shade))


def load_heatmap(arrays: MoeArrays, kind: str = "assigned") -> np.ndarray:
    """Layers (rows, in layer order) x experts (columns), a white gap between cells."""
    blocks = [b for b in arrays if kind in arrays[b]]
    experts = max((len(arrays[b][kind]) for b in blocks), default=0)
    image = np.full((max(1, len(blocks)) * CELL, max(1, experts) * CELL, 3), 255, np.uint8)
    for row, block in enumerate(blocks):
        values = arrays[block][kind]
        mean = sum(values) / len(values) if values else 0.0
        for e, v in enumerate(values):
            y, x = row * CELL, e * CELL
            image[y:y + CELL - 1, x:x + CELL - 1] = _shade(v / mean if mean else 0.0)
    return image


def _color(text: str | None) -> tuple[int, int, int] | None:
    if not text or text == "none":
        return None
    text = text.strip().lower()
    if text.startswith("#") and len(text) in (4, 7):
        digits = text[1:] if len(text) == 7 else "".join(c * 2 for c in text[1:])
        return tuple(int(digits[i:i + 2], 16) for i in (0, 2, 4))  # type: ignore[return-value]
    hit = re.fullmatch(r"rgb\(\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\)", text)
    if hit:
        return tuple(min(255, int(c)) for c in hit.groups())  # type: ignore[return-value]
    return NAMED.get(text)


def _number(value: str | None) -> float:
    """``12.5``, ``12px``: the leading number; 0 for none."""
    hit = re.match(r"-?\d+(?:\.\d*)?", (value or "").strip())
    return float(hit[0]) if hit else 0.0


def svg_picture(svg: str) -> np.ndarray | None:
    """The rectangles of ``svg`` painted on white at its own size, or None when it is not
    an SVG document with a size."""
    try:
        root = ET.fromstring(svg)
    except ET.ParseError:
        return None
    if not root.tag.endswith("svg") or "width" not in root.attrib:
        return None
    width, height = int(_number(root.get("width"))), int(_number(root.get("height")))
    if width <= 0 or height <= 0:
        return None
    image = np.full((height, width, 3), 255, np.uint8)
    for rect in root.iter():
        if not rect.tag.endswith("rect"):
            continue
        fill = _color(rect.get("fill"))
        if fill is None:
            continue
        x, y = _number(rect.get("x")), _number(rect.get("y"))
        x0, y0 = max(0, round(x)), max(0, round(y))
        x1 = min(width, round(x + _number(rect.get("width"))))
        y1 = min(height, round(y + _number(rect.get("height"))))
        if x1 > x0 and y1 > y0:
            image[y0:y1, x0:x1] = fill
            stroke = _color(rect.get("stroke"))
            if stroke is not None:  # its outline, one pixel (cells apart, as drawn)
                image[y0:y1, [x0, x1 - 1]] = stroke
                image[[y0, y1 - 1], x0:x1] = stroke
    return image
