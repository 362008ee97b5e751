"""The pieces of 1-bit SGD (``compression/quantize.py``): sign packing, groups, messages, the two-mean quantizer
and its fidelity (float64 sums, negatives summed themselves, zeros on the positive side as in CNTK)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from dask_dl.testing.compression import sim_columns, sim_grouping, sim_q, sim_uncolumns
from dask_dl.train.compression import pack_signs, unpack_signs
from dask_dl.train.compression.quantize import (
    ColumnLayout,
    _pack_signs_torch,
    _unpack_signs_torch,
    decode,
    dequantize,
    encode,
    quantize,
)

# wide linear and conv (grouped by rows), bias, scalar, wide matrix, then tall linear and conv and a square
# matrix (grouped by columns)
SHAPES = [(6, 20), (5, 3, 3, 3), (7,), (), (4, 9), (12, 5), (8, 1, 2, 2), (3, 3)]


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 1001])
def test_pack_signs_equals_numpy_packbits(n):
    bits = np.random.default_rng(n).random(n) > 0.5
    packed = pack_signs(torch.from_numpy(bits))
    assert packed.dtype == torch.uint8
    np.testing.assert_array_equal(packed.numpy(), np.packbits(bits, bitorder="little"))  # byte for byte
    np.testing.assert_array_equal(unpack_signs(packed, n).numpy(), bits)


def test_torch_packing_for_accelerators_equals_numpy_packbits():
    bits = np.random.default_rng(5).random(1001) > 0.5
    packed = _pack_signs_torch(torch.from_numpy(bits)).numpy()
    np.testing.assert_array_equal(packed, np.packbits(bits, bitorder="little"))
    unpacked = _unpack_signs_torch(torch.from_numpy(packed), 1001).numpy()
    np.testing.assert_array_equal(unpacked, bits)


def _sim_scales(shapes, flat):
    """float32 ``(n_columns, 2)``: the mean of each column's entries >= 0 and of its others (0 if none)."""
    out = []
    for c in sim_columns(shapes, flat.astype(np.float64)):
        pos = c >= 0
        out.append([c[pos].mean() if pos.any() else 0.0, c[~pos].mean() if (~pos).any() else 0.0])
    return np.array(out, dtype=np.float32)


def test_message_is_scales_then_numpy_packbits_of_signs():
    """Whole parameters: the signs are those of the bucket in memory order, whatever the grouping."""
    layout = ColumnLayout(tuple(SHAPES))
    flat = torch.randn(layout.numel)
    bits, scales = quantize(layout.blocks(flat))
    shapes = layout.block_shapes()
    message = encode(bits, scales, transposed=[s.transposed for s in shapes]).numpy()
    np.testing.assert_array_equal(message[8 * layout.n_columns :], np.packbits(flat.numpy() >= 0, bitorder="little"))
    scales_sent = message[: 8 * layout.n_columns].view(np.float32).reshape(-1, 2)
    np.testing.assert_array_equal(scales_sent, scales.numpy())
    np.testing.assert_allclose(scales_sent, _sim_scales(SHAPES, flat.numpy()), rtol=1e-6, atol=1e-7)
    decoded, decoded_scales = decode(torch.from_numpy(message), shapes)
    assert torch.equal(decoded_scales, scales)
    assert all(torch.equal(a, b) for a, b in zip(decoded, bits, strict=True))


def test_stripe_messages_round_trip_through_decode():
    """A range of columns cutting parameters of both groupings: encode, then decode, gives the bits back."""
    layout = ColumnLayout(tuple(SHAPES))
    flat = torch.randn(layout.numel)
    bits, scales = quantize(layout.blocks(flat))
    first, last = 3, layout.n_columns - 5  # inside the first (by rows) and the last-but-one (by columns)
    shapes = layout.block_shapes(first, last)
    assert shapes[0].transposed and not shapes[-1].transposed
    stripe = [bits[i][:, lo:hi] for i, lo, hi in layout.pieces(first, last)]
    message = encode(stripe, scales[first:last], 1000, transposed=[s.transposed for s in shapes])
    assert message.numel() == 1000
    got, got_scales = decode(message, shapes)
    assert torch.equal(got_scales, scales[first:last])
    assert all(torch.equal(a, b) for a, b in zip(got, stripe, strict=True))
    expected_signs = np.concatenate([c >= 0 for c in sim_columns(SHAPES, flat.numpy())[first:last]])
    assert sum(int(b.sum()) for b in got) == int(expected_signs.sum())


def test_two_mean_quantizer_keeps_column_sums_and_uses_the_two_means():
    layout = ColumnLayout(tuple(SHAPES))
    flat = torch.randn(layout.numel) * 3
    bits, scales = quantize(layout.blocks(flat))
    got = torch.full_like(flat, float("nan"))
    dequantize(bits, scales, out=layout.blocks(got))  # into views of a bucket, as the hooks do
    expected = sim_uncolumns(SHAPES, [sim_q(c) for c in sim_columns(SHAPES, flat.numpy())])
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(
        torch.cat([b.reshape(-1) for b in dequantize(bits, scales)]),
        torch.cat([b.reshape(-1) for b in layout.blocks(got)]),
    )
    assert layout.n_columns == 6 + 5 + 1 + 1 + 4 + 5 + 4 + 3 == len(scales)
    for residual in sim_columns(SHAPES, (flat - got).numpy()):
        np.testing.assert_allclose(residual.sum(), 0, atol=1e-5)  # per column
    assert (flat - got).abs().max() > 0.1  # a real quantization, not the identity


def test_groups_run_along_the_longer_axis():
    """Rows when prod(rest) >= out (a (16, 144) weight: 16 groups of 144; a square one by its contiguous rows),
    else columns ((128, 14): 14 of 128)."""
    square = ColumnLayout(((8, 8),))
    flat8 = torch.randn(64)
    (block8,) = square.blocks(flat8)
    assert square.matrices[0].transposed and all(torch.equal(block8[:, j], flat8.view(8, 8)[j]) for j in range(8))
    wide, tall = ColumnLayout(((16, 144),)), ColumnLayout(((128, 14),))
    assert wide.n_columns == 16 and set(np.diff(wide.column_starts)) == {144}
    assert tall.n_columns == 14 and set(np.diff(tall.column_starts)) == {128}
    flat = torch.randn(16 * 144)
    (block,) = wide.blocks(flat)
    assert block.shape == (144, 16) and block.data_ptr() == flat.data_ptr()  # a view, not a copy
    assert all(torch.equal(block[:, j], flat.view(16, 144)[j]) for j in range(16))
    bits, scales = quantize([block])
    rows = flat.view(16, 144).double().numpy()
    expected = [[r[r >= 0].mean(), r[r < 0].mean()] for r in rows]
    np.testing.assert_allclose(scales.numpy(), expected, rtol=1e-6)
    flat = torch.randn(128 * 14)
    (block,) = tall.blocks(flat)
    assert torch.equal(block, flat.view(128, 14))
    counts = {s: ColumnLayout((s,)).n_columns for s in [(16, 16, 3, 3), (16, 1, 3, 3), (7,), (), (1, 5), (3, 3)]}
    assert counts == {(16, 16, 3, 3): 16, (16, 1, 3, 3): 9, (7,): 1, (): 1, (1, 5): 1, (3, 3): 3}


# ---- fidelity ----------------------------------------------------------------------------------------------


def _reference(column: np.ndarray) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Quantize one float32 column with the eager reference (a (n, 1) block: the column is a real column)."""
    return quantize([torch.from_numpy(column.reshape(-1, 1))])


@pytest.mark.parametrize("n", [9, 4096, 6400])
def test_a_nearly_cancelling_column_keeps_its_negative_mean_exact(n):
    """``rand(n) + 0.5`` with one entry -1e-3: sum_all - sum_pos in float32 was off by 4e-4 at n=9, 2.3% at
    n=4096 and 46% at n=6400. Summing the negatives themselves (in float64) gives -1e-3 exactly."""
    column = (np.random.default_rng(n).random(n) + 0.5).astype(np.float32)
    column[n // 3] = np.float32(-1e-3)
    _, scales = _reference(column)
    assert scales[0, 1].item() == np.float32(-1e-3)
    positive = np.delete(column, n // 3).astype(np.float64).mean()
    assert scales[0, 0].item() == np.float32(positive)  # float64 sums: the float32 rounding of the exact mean


def test_a_lone_negative_entry_leaves_no_residual():
    """Its mean is itself: the error is exactly 0 (it was 6e-8, which flipped the next step's side)."""
    column = (np.random.default_rng(0).random(6400) + 0.5).astype(np.float32)
    column[17] = np.float32(-1e-3)
    bits, scales = _reference(column)
    rebuilt = dequantize(bits, scales)[0].reshape(-1).numpy()
    assert rebuilt[17] - column[17] == 0.0
    assert not bits[0][17, 0] and bits[0].sum() == 6399


def test_zeros_go_to_the_positive_side_as_in_cntk():
    """CNTK quantizes ``u >= 0`` as 1: exact zeros (common after ReLU) are rebuilt as the positive mean."""
    column = np.array([0.0, 0.0, 3.0, -1.0, -2.0, 0.0], dtype=np.float32)
    bits, scales = _reference(column)
    assert bits[0].reshape(-1).tolist() == [True, True, True, False, False, True]
    assert scales.tolist() == [[0.75, -1.5]]
    assert pack_signs(torch.from_numpy(column >= 0)).tolist() == [0b00100111]  # entry k is bit k


# ---- stripes -----------------------------------------------------------------------------------------------


def test_stripes_follow_parameters_not_buckets():
    """A column's stripe depends on its parameter (name, shape) and N only: the same in any bucket layout."""
    shapes, names = [(256, 100), (256,), (64, 3, 3, 3), (3, 3)], ["a.weight", "a.bias", "conv.weight", "m"]
    for n in (1, 2, 3, 4):
        pieces = ColumnLayout(tuple(shapes)).stripe_pieces(names, n)
        owner = {(names[i], c): k for k, stripe in enumerate(pieces) for i, lo, hi in stripe for c in range(lo, hi)}
        layout = ColumnLayout(tuple(shapes))
        every = [(name, c) for name, m in zip(names, layout.matrices, strict=True) for c in range(m.cols)]
        assert sorted(owner) == sorted(every)
        reordered = ColumnLayout(tuple(shapes[::-1])).stripe_pieces(names[::-1], n)
        again = {
            (names[::-1][i], c): k for k, stripe in enumerate(reordered) for i, lo, hi in stripe for c in range(lo, hi)
        }
        assert again == owner
        for stripe in pieces:  # pieces in bucket order, contiguous runs of each parameter
            assert [i for i, _, _ in stripe] == sorted(i for i, _, _ in stripe)
        for name, m in zip(names, layout.matrices, strict=True):  # each parameter split evenly, rotated by name
            counts = [sum(1 for (p, _), k in owner.items() if p == name and k == j) for j in range(n)]
            assert max(counts) - min(counts) <= 1 and sum(counts) == m.cols
            if m.cols >= n:
                assert owner[(name, 0)] == zlib.crc32(name.encode()) % n


def test_grouping_rule_of_the_simulation_matches_the_layout():
    for shape in SHAPES:
        out, rest, by_rows = sim_grouping(shape)
        assert ColumnLayout((shape,)).n_columns == (out if by_rows else rest)
