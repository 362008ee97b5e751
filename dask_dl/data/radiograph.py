"""Drawing synthetic chest radiographs: a chest-like background and one visual signature per NIH finding.

:func:`draw` makes one ``(size, size)`` uint8 radiograph: lungs, mediastinum, spine, heart, ribs, clavicles and
soft tissue, exposed with a gain, gamma and noise, plus each requested finding (a nodule as a small bright blob,
effusion as basal haze with a meniscus, cardiomegaly as an enlarged heart shadow, pneumothorax as a dark apical
band, ...) at a strength that varies per image. :mod:`dask_dl.data.synthetic` writes whole collections with it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
from PIL import Image
from scipy import ndimage

from dask_dl.data.schema import NIH_LABELS

__all__ = ["BOX_FINDINGS", "draw", "draw_with_boxes"]

# ---- drawing -----------------------------------------------------------------------------------------------
# Coordinates are normalized: x from -1 (image left, the patient's right) to 1, y from -1 (top) to 1. Pixels
# are "density" (0 air, ~0.6 soft tissue, more for bone) until the exposure maps them to gray levels.


@functools.lru_cache(maxsize=4)
def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    c = ((np.arange(size, dtype=np.float32) + 0.5) / size * 2 - 1).astype(np.float32)
    return np.broadcast_to(c[None, :], (size, size)), np.broadcast_to(c[:, None], (size, size))


def _ramp(d, width: float):
    """A soft step from 0 to 1 as ``d`` goes from ``-width/2`` to ``width/2``."""
    return np.clip(d / width + 0.5, 0.0, 1.0)


def _blob(chest: _Chest, x: float, y: float, r: float):
    return np.exp(-((chest.X - x) ** 2 + (chest.Y - y) ** 2) / (r * r))


class _Chest:
    """One radiograph being drawn: its geometry, its density map, and the hooks findings use."""

    def __init__(self, size: int, rng: np.random.Generator, view: str):
        # the anatomy is smooth: draw it at half resolution and add only the quantum noise at full resolution
        self.out = out = size
        self.size = size = size if size < 128 else (size + 1) // 2
        self.rng, self.ap = rng, view == "AP"
        u, v = _grid(size)
        dx, dy, rot = rng.normal(0, 0.03), rng.normal(0, 0.03), rng.normal(0, 0.03)
        scale = rng.uniform(0.9, 1.04)
        c, s = np.cos(rot), np.sin(rot)
        self.X = ((c * (u - dx) + s * (v - dy)) / scale).astype(np.float32)
        self.Y = ((-s * (u - dx) + c * (v - dy)) / scale).astype(np.float32)
        self.midline = rng.normal(0, 0.015)
        # per side (0: image left, 1: image right): apex, costophrenic level; AP films are shallower inspirations
        self.top = -0.74 + rng.normal(0, 0.02, 2) + 0.04 * self.ap
        self.base = 0.6 + rng.normal(0, 0.03, 2) - np.array([0.03, 0.0]) - 0.07 * self.ap
        self.dome = rng.uniform(0.15, 0.21)
        self.width = rng.uniform(0.8, 0.88) + 0.03 * self.ap
        # heart: centre x, y and radii; AP magnifies it (the heart is far from the detector)
        self.heart = [
            self.midline + rng.uniform(0.05, 0.09),
            rng.uniform(0.25, 0.29),
            rng.uniform(0.28, 0.35),
            rng.uniform(0.2, 0.23),
        ]
        if self.ap:
            self.heart[2:] = [r * 1.12 for r in self.heart[2:]]
            self.heart[1] -= 0.03
        self.lung_depth = rng.uniform(0.26, 0.38)
        self.markings_gain = 1.0
        self.rib_phase = rng.uniform(-0.15, 0.15)
        self.clavicle = -0.6 + rng.normal(0, 0.02) - 0.07 * self.ap
        self.heel = rng.uniform(-0.08, 0.08)
        self.bubble = rng.uniform(0.3, 1.0)
        # noise fields are drawn now, in a fixed order, so findings never shift the background's randomness
        self.vessel_phase = rng.uniform(0, 2 * np.pi, 2)
        self.vessel_profile = rng.standard_normal((2, 96)).astype(np.float32)
        self.grain = rng.standard_normal((size, size), dtype=np.float32)
        self.quantum = rng.standard_normal((out, out), dtype=np.float32)
        self.lucency = np.zeros((size, size), np.float32)
        self.opacity = np.zeros((size, size), np.float32)  # what findings add; saturates, see expose()
        self.no_markings = np.zeros((size, size), np.float32)

    # -- geometry findings use ----------------------------------------------------------------------------
    def px(self, length: float) -> float:
        return length * self.size / 2

    def lung_shape(self, t):
        """Medial and lateral edge (distance from the midline) at relative height ``t`` (0 apex, 1 base)."""
        medial = 0.19 - 0.09 * t
        lateral = 0.21 + (self.width - 0.21) * np.sqrt(np.clip(t * (2 - t), 0, 1))
        return medial, lateral

    def lung_point(self, rng, *, side=None, t=(0.2, 0.8), q=(0.25, 0.8)) -> tuple[float, float, int]:
        """A random point inside a lung: relative height ``t``, relative width ``q`` (0 medial, 1 lateral)."""
        side = int(rng.integers(2)) if side is None else side
        tt, qq = rng.uniform(*t), rng.uniform(*q)
        medial, lateral = self.lung_shape(tt)
        a = medial + qq * (lateral - medial)
        y = self.top[side] + tt * (self.base[side] - self.top[side])
        return self.midline + (a if side else -a), y, side

    def side_mask(self, side: int):
        return self.lung * (self.right if side else ~self.right)

    # -- anatomy ------------------------------------------------------------------------------------------
    def draw_anatomy(self) -> None:
        X, Y = self.X, self.Y
        self.right = np.greater(X, self.midline)
        a = np.abs(X - self.midline)
        self.a = a
        top = np.where(self.right, self.top[1], self.top[0])
        base = np.where(self.right, self.base[1], self.base[0])
        self.t = t = np.clip((Y - top) / (base - top), 0, 1)
        medial, lateral = self.lung_shape(t)
        span = lateral - medial
        self.q = q = (a - medial) / span
        floor = base - self.dome * (1 - np.clip((q - 0.35) / 0.65, -1, 1) ** 2)
        self.floor = floor
        e = 0.03
        lung = _ramp(q * span, e) * _ramp((1 - q) * span, e) * _ramp(Y - top, e) * _ramp(floor - Y, e)
        hx, hy, rx, ry = self.heart
        ct, st = np.cos(-0.6), np.sin(-0.6)
        hu, hv = (X - hx) * ct - (Y - hy) * st, (X - hx) * st + (Y - hy) * ct
        # egg-shaped: taller and narrower above the centre, where the heart runs into the mediastinum
        above = np.clip(-hv / (1.5 * ry), 0, 1)
        ry_local = np.where(hv < 0, 1.5 * ry, ry)
        heart = _ramp(1 - np.sqrt((hu / (rx * (1 - 0.3 * above))) ** 2 + (hv / ry_local) ** 2), 0.12)
        knob = _ramp(1 - np.hypot(X - self.midline - 0.1, Y + 0.28) / 0.06, 0.4)
        self.lung_behind_heart = lung
        self.lung = lung * (1 - heart) * (1 - knob)
        self.heart_mask = heart
        shoulder = np.clip((-0.7 - Y) / 0.3, 0, None)
        body = _ramp(1.08 - 0.8 * shoulder**2 - a, 0.08)
        density = body * (0.4 + 0.12 * _ramp(0.35 - a, 0.6) + 0.12 * _ramp(Y - 0.6, 0.4))
        density += 0.1 * _ramp(0.17 - a, 0.1) * _ramp(0.45 - Y, 0.3) * (1 - heart) + 0.045 * heart
        # the apices sit under the clavicles and first ribs, the bases under more soft tissue: both less dark
        density -= self.lung_depth * self.lung * (1 - 0.3 * t**2) * (0.75 + 0.25 * _ramp(t - 0.12, 0.2))
        # spine with vertebral bodies, trachea, hila
        spine = _ramp(0.065 - a, 0.02)
        density += spine * (0.05 + 0.012 * np.cos(np.pi * (Y + 1) / 0.09) ** 2) * _ramp(0.3 - Y, 0.6)
        density -= 0.1 * _ramp(0.028 - a, 0.015) * _ramp(-0.3 - Y, 0.08)
        hila = _blob(self, self.midline - 0.2, -0.04, 0.08) + _blob(self, self.midline + 0.19, -0.07, 0.07)
        density += 0.12 * hila * self.lung
        # gastric bubble under the left hemidiaphragm (image right)
        density -= (
            0.1
            * self.bubble
            * np.exp(-(((X - self.midline - 0.38) / 0.1) ** 2) - ((Y - self.base[1] - 0.02) / 0.05) ** 2)
        )
        density += self._bones(a)
        self.density = density

    def _bones(self, a):
        Y = self.Y
        cage = _ramp(self.width + 0.1 - a, 0.08) * _ramp(Y + 0.85, 0.08) * _ramp(0.6 - Y, 0.15)
        cage = cage * _ramp(self.floor + 0.06 - Y, 0.1)
        u = np.clip(Y + 0.35 * a - 0.85 * a**2 + 0.9, 0, None)
        posterior = (0.5 + 0.5 * np.cos(2 * np.pi * (12 * (u / 1.5) ** 0.85 + self.rib_phase))) ** 3
        v = Y - 0.5 * a + 0.3 * a**2
        anterior = (0.5 + 0.5 * np.cos(2 * np.pi * (v + 0.2) / 0.14)) ** 4 * _ramp(a - 0.15, 0.1)
        cage = cage * (1 - 0.7 * self.heart_mask)  # the dense heart hides the ribs behind it
        ribs = cage * (0.055 * posterior * (0.2 + 0.8 * _ramp(a - 0.15, 0.12)) + 0.025 * anterior)
        slope = 0.13 - 0.06 * self.ap
        s = np.clip((a - 0.06) / 0.55, 0, 1)
        yc = self.clavicle - slope * s + 0.035 * np.sin(np.pi * s)
        clavicles = np.exp(-(((Y - yc) / 0.036) ** 2)) * _ramp(a - 0.07, 0.04) * _ramp(0.64 - a, 0.06)
        humerus = _ramp(1 - np.hypot(a - 1.02, Y + 0.76) / 0.2, 0.3)
        scapula = _ramp(a - (0.6 if self.ap else 0.78), 0.08) * _ramp(-0.15 - Y, 0.2) * _ramp(Y + 0.72, 0.06)
        return ribs + 0.13 * clavicles + 0.1 * humerus + 0.05 * scapula

    def _markings(self):
        """Vessels: lines radiating from the hila, tapering and fading towards the periphery."""
        X, Y = self.X, self.Y
        hx = np.where(self.right, self.midline + 0.19, self.midline - 0.2)
        dx, dy = X - hx, Y + 0.05
        r = np.sqrt(dx * dx + dy * dy)
        theta = np.arctan2(dy, np.where(self.right, dx, -dx)) + 0.25 * np.sin(7 * r + self.vessel_phase[0])
        grid = np.linspace(-np.pi, np.pi, 96, dtype=np.float32)
        profile = np.where(
            self.right,
            np.interp(theta, grid, self.vessel_profile[1], period=2 * np.pi),
            np.interp(theta, grid, self.vessel_profile[0], period=2 * np.pi),
        )
        width = 0.45 * np.exp(-r / 0.5)
        vessels = np.clip(1 - np.abs(profile) / width, 0, 1) ** 2 * np.exp(-r / 0.45)
        sigma = max(0.7, self.px(0.008))
        fine = ndimage.gaussian_filter(self.grain, sigma)
        fine *= 1 / (fine.std() + 1e-6)
        fine = np.clip(1 - np.abs(fine) / 0.4, 0, 1) ** 2 * 0.4
        return (vessels + fine * np.exp(-r / 0.6)) * self.lung * (1 - self.no_markings)

    def expose(self, gain: float, gamma: float, noise: float) -> np.ndarray:
        rng = self.rng
        gain *= np.exp(rng.normal(0, 0.07))
        gamma *= np.exp(rng.normal(0, 0.07))
        # overlapping opacities saturate towards a soft-tissue-like ceiling instead of adding up to bone white
        ceiling = 0.45
        opacity = ceiling * (1 - np.exp(-self.opacity / ceiling))
        markings = 0.17 * self.markings_gain * self._markings()
        density = self.density + opacity + markings - self.lucency * self.lung
        density = ndimage.gaussian_filter(np.clip(density, 0, None), max(0.5, self.px(0.005)))
        level = 1.3 * gain * (1 + self.heel * self.X) * density**gamma
        if self.out != self.size:
            level = Image.fromarray(level.astype(np.float32))
            level = np.asarray(level.resize((self.out, self.out), Image.Resampling.BILINEAR))
        level = 255 * level + (1.5 + 3 * np.sqrt(np.clip(level, 0, 1))) * noise * self.quantum
        return np.clip(np.rint(level), 0, 255).astype(np.uint8)


def _smooth_noise(rng: np.random.Generator, size: int, cells: int) -> np.ndarray:
    """Smooth noise of unit-ish amplitude varying over about ``size / cells`` pixels."""
    coarse = ndimage.gaussian_filter(rng.standard_normal((cells, cells)), 0.8)
    coarse /= coarse.std() + 1e-9
    return ndimage.zoom(coarse, size / cells, order=1, grid_mode=True, mode="nearest").astype(np.float32)


def _cardiomegaly(chest: _Chest, rng, st) -> None:  # before the anatomy: the heart itself grows
    chest.heart[2] *= 1.12 + 0.35 * st
    chest.heart[3] *= 1.04 + 0.14 * st
    chest.heart[0] += 0.03 * st


def _emphysema(chest: _Chest, rng, st) -> None:  # before the anatomy: hyperinflated, hyperlucent, flat domes
    chest.lung_depth *= 1.1 + 0.3 * st
    chest.markings_gain *= 0.8 - 0.5 * st
    chest.base = chest.base + 0.06 * st
    chest.dome *= 0.8 - 0.4 * st


def _nodule(chest: _Chest, rng, st) -> None:
    x, y, _ = chest.lung_point(rng)
    r = rng.uniform(0.022, 0.04)
    chest.opacity += (0.06 + 0.24 * st) * _ramp(1 - np.hypot(chest.X - x, chest.Y - y) / r, 0.5)


def _mass(chest: _Chest, rng, st) -> None:
    x, y, _ = chest.lung_point(rng, t=(0.25, 0.7), q=(0.3, 0.7))
    r = rng.uniform(0.07, 0.12)
    dx, dy = chest.X - x, chest.Y - y
    theta, phase = np.arctan2(dy, dx), rng.uniform(0, 2 * np.pi, 2)
    lobes = 1 + 0.12 * np.sin(3 * theta + phase[0]) + 0.08 * np.sin(5 * theta + phase[1])
    chest.opacity += (0.08 + 0.26 * st) * _ramp(1 - np.hypot(dx, dy) / (r * lobes), 0.35)


def _sides(rng, both: float) -> list[int]:
    return [0, 1] if rng.random() < both else [int(rng.integers(2))]


def _effusion(chest: _Chest, rng, st) -> None:
    """Fluid at the base, its surface rising against the chest wall (meniscus), blunting the angle."""
    for side in _sides(rng, 0.4):
        height = (0.04 + 0.3 * st * rng.uniform(0.6, 1.0)) * (chest.base[side] - chest.top[side])
        level = chest.base[side] - height - 0.14 * np.clip(chest.q, 0, 1) ** 2
        region = (chest.right == side) * _ramp(chest.q + 0.05, 0.1) * _ramp(1.03 - chest.q, 0.06)
        region = region * _ramp(chest.Y - level, 0.05) * _ramp(chest.base[side] + 0.02 - chest.Y, 0.04)
        fluid = (0.4 + 0.55 * st) * (0.7 + 0.3 * _ramp(chest.Y - level - 0.1, 0.2))
        chest.opacity += chest.lung_depth * fluid * region * chest.lung
        chest.no_markings = np.maximum(chest.no_markings, region)


def _pneumothorax(chest: _Chest, rng, st) -> None:
    """Air between lung and chest wall at the apex and side: darker, no vessels, a thin visceral pleural line."""
    side = int(rng.integers(2))
    depth = 0.03 + 0.11 * st
    span = chest.lung_shape(chest.t)[1] - chest.lung_shape(chest.t)[0]
    top = chest.top[side]
    edge = np.minimum((1 - chest.q) * span, (chest.Y - top) * 0.8)
    upper = (chest.right == side) * _ramp(0.75 - chest.t, 0.2)
    region = chest.lung * upper * _ramp(depth - edge, 0.01)
    chest.no_markings = np.maximum(chest.no_markings, region)
    chest.lucency += (0.03 + 0.1 * st) * region
    chest.opacity += 0.06 * np.exp(-(((edge - depth) / 0.006) ** 2)) * chest.lung * upper


def _atelectasis(chest: _Chest, rng, st) -> None:
    """A dense band (plate atelectasis), widening into a wedge towards one end."""
    x, y, _ = chest.lung_point(rng, t=(0.55, 0.85), q=(0.25, 0.75))
    angle, length = rng.uniform(-0.4, 0.4), rng.uniform(0.18, 0.32)
    thick, wedge = rng.uniform(0.012, 0.025) * (0.7 + 0.6 * st), rng.uniform(0, 1.5)
    dx, dy = chest.X - x, chest.Y - y
    along, across = dx * np.cos(angle) + dy * np.sin(angle), -dx * np.sin(angle) + dy * np.cos(angle)
    width = thick * (1 + wedge * np.clip(along / length + 0.5, 0, 1))
    band = np.exp(-((across / width) ** 2)) * _ramp(length / 2 - np.abs(along), 0.04)
    chest.opacity += (0.08 + 0.24 * st) * band * (0.3 + 0.7 * chest.lung)


def _infiltration(chest: _Chest, rng, st) -> None:
    patches = _ramp(_smooth_noise(rng, chest.size, 14) - rng.uniform(0.4, 0.8), 0.6)
    zone = _ramp(chest.t - rng.uniform(0.1, 0.5), 0.3)
    lungs = sum(chest.side_mask(side) for side in _sides(rng, 0.5))
    chest.opacity += (0.05 + 0.17 * st) * patches * zone * lungs


def _consolidation(chest: _Chest, rng, st) -> None:
    """Dense opacity filling a lobe: everything below (or above) an oblique fissure in one lung."""
    side, upper = int(rng.integers(2)), rng.random() < 0.4
    fissure = chest.top[side] + rng.uniform(0.4, 0.6) * (chest.base[side] - chest.top[side]) - 0.25 * (chest.q - 0.5)
    lobe = _ramp((fissure - chest.Y) if upper else (chest.Y - fissure), 0.06)
    texture = 0.8 + 0.2 * _smooth_noise(rng, chest.size, 10)
    chest.opacity += (0.08 + 0.3 * st) * chest.side_mask(side) * lobe * texture


def _edema(chest: _Chest, rng, st) -> None:
    """Bilateral perihilar ("bat wing") haze plus a few Kerley B lines at the bases."""
    haze = np.exp(-(((chest.a - 0.24) / 0.22) ** 2) - ((chest.Y + 0.02) / 0.32) ** 2)
    kerley = (0.5 + 0.5 * np.cos(2 * np.pi * chest.Y / 0.035)) ** 8 * _ramp(chest.q - 0.82, 0.1)
    kerley = kerley * _ramp(chest.t - 0.6, 0.2)
    chest.opacity += ((0.05 + 0.2 * st) * haze + 0.06 * st * kerley) * chest.lung


def _fibrosis(chest: _Chest, rng, st) -> None:
    """Reticular lines, peripheral and basal."""
    field = ndimage.gaussian_filter(rng.standard_normal((chest.size, chest.size)), max(1.0, chest.px(0.022)))
    net = np.clip(1 - np.abs(field / (field.std() + 1e-9)) / 0.3, 0, 1) ** 2
    zone = _ramp(chest.q - 0.35, 0.4) * _ramp(chest.t - 0.3, 0.4)
    chest.opacity += (0.06 + 0.16 * st) * net * zone * chest.lung


def _pleural_thickening(chest: _Chest, rng, st) -> None:
    """A bright rim along the inside of the chest wall (or an apical cap)."""
    medial, lateral = chest.lung_shape(chest.t)
    inside = (1 - chest.q) * (lateral - medial)  # distance from the lateral lung edge
    for side in _sides(rng, 0.3):
        t0 = rng.uniform(0.0, 0.5)
        thick = 0.018 + 0.025 * st
        along = _ramp(chest.t - t0, 0.1) * _ramp(t0 + 0.45 - chest.t, 0.1)
        rim = (chest.right == side) * _ramp(thick - inside, 0.012) * _ramp(inside + 0.01, 0.02) * along
        chest.opacity += (0.07 + 0.23 * st) * rim * _ramp(chest.Y - chest.top[side] + 0.01, 0.03)


def _hernia(chest: _Chest, rng, st) -> None:
    """A hiatus hernia: a rounded opacity behind the heart at the base, often with an air-fluid level."""
    x = chest.midline + rng.normal(0, 0.04)
    y = chest.heart[1] + 0.6 * chest.heart[3]
    r = rng.uniform(0.08, 0.12) * (0.8 + 0.3 * st)
    disc = _ramp(1 - np.hypot(chest.X - x, chest.Y - y) / r, 0.25)
    chest.opacity += (0.04 + 0.05 * st) * disc
    if rng.random() < 0.6:
        chest.density -= 0.05 * disc * _ramp(y - 0.25 * r - chest.Y, 0.02)


def _pneumonia(chest: _Chest, rng, st) -> None:
    """Focal haze around a denser consolidated core."""
    x, y, side = chest.lung_point(rng, t=(0.35, 0.8), q=(0.3, 0.8))
    r = rng.uniform(0.1, 0.16)
    d = np.hypot(chest.X - x, chest.Y - y)
    haze = np.exp(-((d / r) ** 2)) * (0.75 + 0.25 * _smooth_noise(rng, chest.size, 16))
    core = _ramp(1 - d / (0.45 * r), 0.5)
    chest.opacity += ((0.05 + 0.12 * st) * haze + (0.05 + 0.16 * st) * core) * (0.2 + 0.8 * chest.side_mask(side))


_FINDINGS = {
    "Atelectasis": _atelectasis,
    "Cardiomegaly": _cardiomegaly,
    "Effusion": _effusion,
    "Infiltration": _infiltration,
    "Mass": _mass,
    "Nodule": _nodule,
    "Pneumonia": _pneumonia,
    "Pneumothorax": _pneumothorax,
    "Consolidation": _consolidation,
    "Edema": _edema,
    "Emphysema": _emphysema,
    "Fibrosis": _fibrosis,
    "Pleural_Thickening": _pleural_thickening,
    "Hernia": _hernia,
}
_SHAPE_FINDINGS = ("Cardiomegaly", "Emphysema")  # change the anatomy itself, so they act before it is drawn


def draw(
    size: int,
    labels: np.ndarray | Sequence[str],
    *,
    seed: int = 0,
    key: tuple[int, ...] = (),
    view: str = "PA",
    gain: float = 1.0,
    gamma: float = 1.0,
    noise: float = 1.0,
    strength: float | None = None,
) -> np.ndarray:
    """Draw one radiograph ``(size, size) uint8`` with the given findings (a 0/1 row or a list of names).

    The background comes from ``SeedSequence(seed, spawn_key=(*key, 0))`` and finding ``j`` from
    ``(*key, 1 + j)``, so the same seed and key give the same chest with or without any finding. Each
    finding's strength is uniform in [0, 1] (faint to obvious) unless ``strength`` fixes it.
    """
    return _draw(
        size, labels, seed=seed, key=key, view=view, gain=gain, gamma=gamma, noise=noise, strength=strength, boxes=None
    )


def draw_with_boxes(
    size: int,
    labels: np.ndarray | Sequence[str],
    *,
    seed: int = 0,
    key: tuple[int, ...] = (),
    view: str = "PA",
    gain: float = 1.0,
    gamma: float = 1.0,
    noise: float = 1.0,
    strength: float | None = None,
) -> tuple[np.ndarray, list[tuple[str, float, float, float, float]]]:
    """:func:`draw`, and the bounding box of each drawn finding of :data:`BOX_FINDINGS`.

    The pixels are those :func:`draw` returns for the same arguments. A box is ``(finding, x, y, w, h)`` in
    pixels of the returned image (x right, y down, as in NIH's ``BBox_List_2017.csv``): the smallest rectangle
    around where the finding changes the drawing by at least a tenth of its largest change. Findings drawn on
    both sides (effusion, infiltration) get one box per side; cardiomegaly's box is the heart.
    """
    found: list[tuple[str, float, float, float, float]] = []
    pixels = _draw(
        size, labels, seed=seed, key=key, view=view, gain=gain, gamma=gamma, noise=noise, strength=strength, boxes=found
    )
    return pixels, found


#: The findings NIH's ``BBox_List_2017.csv`` has boxes for (NIH spells Infiltration ``Infiltrate`` there).
BOX_FINDINGS = (
    "Atelectasis",
    "Cardiomegaly",
    "Effusion",
    "Infiltration",
    "Mass",
    "Nodule",
    "Pneumonia",
    "Pneumothorax",
)
_PER_SIDE = ("Effusion", "Infiltration")  # drawn on one side or both: one box per side, as a reader would draw
_BOX_LEVEL = 0.1  # share of a finding's largest change that counts as inside its box


def _box(chest: _Chest, mask: np.ndarray) -> tuple[float, float, float, float]:
    """``(x, y, w, h)`` in output pixels of the cells of ``mask`` (the anatomy's grid may be coarser)."""
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    scale = chest.out / chest.size
    x0, y0 = cols[0] * scale, rows[0] * scale
    return (
        round(float(x0), 3),
        round(float(y0), 3),
        round(float((cols[-1] + 1) * scale - x0), 3),
        round(float((rows[-1] + 1) * scale - y0), 3),
    )


def _finding_boxes(chest: _Chest, name: str, change: np.ndarray) -> list[tuple[str, float, float, float, float]]:
    peak = float(change.max())
    if peak <= 0:
        return []
    sides = (chest.right, ~chest.right) if name in _PER_SIDE else (np.ones(change.shape, bool),)
    found = []
    for side in sides:
        part = np.where(side, change, 0)
        if part.max() >= _BOX_LEVEL * peak:
            found.append((name, *_box(chest, part >= _BOX_LEVEL * peak)))
    return found


def _draw(size, labels, *, seed, key, view, gain, gamma, noise, strength, boxes: list | None) -> np.ndarray:
    names = labels if not isinstance(labels, np.ndarray) else [n for n, v in zip(NIH_LABELS, labels, strict=True) if v]
    present = [name in names for name in NIH_LABELS]
    chest = _Chest(size, np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(*key, 0))), view)
    findings = []
    for j, name in enumerate(NIH_LABELS):
        if present[j]:
            rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(*key, 1 + j)))
            st = rng.uniform(0.0, 1.0)
            findings.append((name, rng, st if strength is None else strength))
    for name, rng, strength in findings:
        if name in _SHAPE_FINDINGS:
            _FINDINGS[name](chest, rng, strength)
    chest.draw_anatomy()
    if boxes is not None and "Cardiomegaly" in names:
        boxes.extend(_finding_boxes(chest, "Cardiomegaly", chest.heart_mask))
    for name, rng, strength in findings:
        if name not in _SHAPE_FINDINGS:
            before = chest.opacity + chest.lucency if boxes is not None and name in BOX_FINDINGS else None
            _FINDINGS[name](chest, rng, strength)
            if before is not None:
                boxes.extend(_finding_boxes(chest, name, np.abs(chest.opacity + chest.lucency - before)))
    return chest.expose(gain, gamma, noise)
