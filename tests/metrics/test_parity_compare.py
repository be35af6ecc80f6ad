"""The comparison the CUDA parity test relies on (tests/fixtures/parity.py), proved on the CPU."""
from __future__ import annotations

import numpy as np
from parity import compare_modes, ulp_distance


def test_ulp_distance_counts_representable_steps():
    a = np.array([1.0, -1.0, 0.0, 1e-45, np.nan], dtype=np.float32)
    b = np.array([np.nextafter(np.float32(1), np.float32(2)), -1.0, -0.0, -1e-45, np.nan], dtype=np.float32)
    assert ulp_distance(a, b).tolist() == [1, 0, 0, 2, 0]


def test_compare_modes_finds_a_flipped_code_and_a_float_ulp():
    scale = 0.5
    codes = np.arange(-8, 8, dtype=np.float32)
    ref = {"m": {"q": codes * scale, "f": np.linspace(1, 2, 16, dtype=np.float32)}}
    other_q = codes.copy()
    other_q[3] += 1
    f = ref["m"]["f"].copy()
    f[5] = np.nextafter(f[5], np.float32(3))
    other = {"m": {"q": other_q * scale, "f": f}}
    stats = {"modes": {"m": {"tensors": {"q": {"kind": "int8", "scale": scale}, "f": {"kind": "float"}}}}}
    by_tap = {d.tap: d for d in compare_modes(ref, other, stats)}
    assert by_tap["q"].codes_differ == 1 and by_tap["q"].differ == 1
    assert by_tap["f"].codes_differ == 0 and by_tap["f"].max_ulp == 1 and by_tap["f"].differ == 1
    assert 0 < by_tap["f"].rel_l2 < 1e-6
    same = {d.tap: d for d in compare_modes(ref, ref, stats)}
    assert same["q"].differ == 0 and same["f"].rel_l2 == 0.0


def test_compare_modes_counts_codes_of_a_tap_with_one_scale_per_channel():
    scales = np.array([0.5, 0.25], dtype=np.float32)
    codes = np.arange(-8, 8, dtype=np.float32).reshape(8, 2)
    ref = {"m": {"xBC": codes * scales}}
    flipped = codes.copy()
    flipped[2, 1] += 1
    stats = {"modes": {"m": {"tensors": {"xBC": {"kind": "int8", "scales": {"per": "channel", "channels": 2}}}}}}
    (d,) = compare_modes(ref, {"m": {"xBC": flipped * scales}}, stats)
    assert d.kind == "int8" and d.codes_differ == 1 and d.differ == 1
    (same,) = compare_modes(ref, ref, stats)
    assert same.codes_differ == 0
