"""Part ownership for reduce_scatter: every row in exactly one part, parts balanced by bytes."""

import random

import pytest
import torch

from muloco.sync.parts import Piece, assign_parts, row_count


def random_shapes(rng: random.Random, n: int) -> list[torch.Size]:
    shapes = []
    for _ in range(n):
        kind = rng.choice(["matrix", "vector", "scalar", "conv"])
        if kind == "matrix":
            shapes.append(torch.Size([rng.randint(1, 300), rng.randint(1, 64)]))
        elif kind == "vector":
            shapes.append(torch.Size([rng.randint(1, 500)]))
        elif kind == "scalar":
            shapes.append(torch.Size([]))
        else:
            shapes.append(torch.Size([rng.randint(1, 40), 3, 2, 2]))
    return shapes


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("seed", range(5))
def test_every_row_is_in_exactly_one_part_in_order(parts, seed):
    rng = random.Random(seed)
    shapes = random_shapes(rng, rng.randint(1, 12))
    costs = [float(max(1, torch.Size(s).numel()) * rng.choice([0.25, 0.5, 4.0])) for s in shapes]
    owned = assign_parts(shapes, costs, parts)
    assert len(owned) == parts
    flat = [piece for part in owned for piece in part]
    # Parts are contiguous runs of rows, in tensor order: concatenated, they walk every row once.
    expected_next = (0, 0)
    for piece in flat:
        assert (piece.tensor, piece.start) == expected_next or (
            piece.start == 0 and expected_next == (piece.tensor - 1, row_count(shapes[piece.tensor - 1]))
        )
        assert 0 <= piece.start < piece.stop <= row_count(shapes[piece.tensor])
        expected_next = (piece.tensor, piece.stop)
    covered = {}
    for piece in flat:
        for r in range(piece.start, piece.stop):
            key = (piece.tensor, r)
            assert key not in covered, f"row {key} in two parts"
            covered[key] = True
    assert len(covered) == sum(row_count(s) for s in shapes)


@pytest.mark.parametrize("parts", [2, 4, 8])
def test_parts_are_balanced_within_one_row(parts):
    shapes = [torch.Size([512, 64]), torch.Size([64]), torch.Size([256, 64]), torch.Size([1000, 16])]
    costs = [float(torch.Size(s).numel()) / 4 for s in shapes]  # 2 bits per element
    owned = assign_parts(shapes, costs, parts)
    per_part = [
        sum(costs[p.tensor] * (p.stop - p.start) / row_count(shapes[p.tensor]) for p in o) for o in owned
    ]
    largest_row = max(c / row_count(s) for c, s in zip(costs, shapes, strict=True))
    target = sum(costs) / parts
    assert max(per_part) - target <= largest_row + 1e-9
    assert target - min(per_part) <= largest_row + 1e-9


def test_small_tensors_are_never_cut_and_pieces_view_their_rows():
    owned = assign_parts([torch.Size([10]), torch.Size([])], [40.0, 4.0], 8)
    pieces = [p for part in owned for p in part]
    assert pieces == [Piece(0, 0, 1), Piece(1, 0, 1)]
    t = torch.arange(12.0).reshape(6, 2)
    piece = Piece(0, 2, 4)
    assert torch.equal(piece.of(t), t[2:4]) and piece.of(t).data_ptr() == t[2:4].data_ptr()
    assert piece.shape((6, 2)) == (2, 2) and Piece(0, 0, 1).shape((5,)) == (5,)
    assert piece.key("w") == "w[2:4]"


def test_the_cut_depends_only_on_shapes_and_costs():
    shapes, costs = [torch.Size([97, 13]), torch.Size([31, 7])], [97 * 13 / 2, 31 * 7 / 2]
    assert assign_parts(shapes, costs, 5) == assign_parts(list(shapes), list(costs), 5)
