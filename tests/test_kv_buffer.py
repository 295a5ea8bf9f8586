"""`KvBuffer` against a plain list of rows: appends, clipping to `keep`, growth and compaction
never lose or reorder a live row, and memory stays bounded when windowed."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from larql.kv.buffers import KvBuffer, commit_step, step_slots

HEADS, DIM = 2, 3


def rows(start: int, n: int) -> torch.Tensor:
    """n distinct rows numbered start.. : [HEADS, n, DIM]."""
    values = torch.arange(start, start + n, dtype=torch.float32)
    return values.view(1, n, 1).expand(HEADS, n, DIM).clone()


@settings(max_examples=200, deadline=None)
@given(
    keep=st.one_of(st.none(), st.integers(0, 40)),
    appends=st.lists(st.integers(1, 30), min_size=1, max_size=60),
)
def test_matches_a_list_of_rows(keep: int | None, appends: list[int]) -> None:
    buffer = KvBuffer(keep=keep)
    model: list[float] = []
    counter = 0
    for n in appends:
        new = rows(counter, n)
        keys, values = buffer.append(new, -new)
        model += [float(counter + i) for i in range(n)]
        counter += n
        assert keys[0, :, 0].tolist() == model  # every live row plus the new ones, in order
        assert torch.equal(values, -keys)
        buffer.clip()
        if keep is not None:
            model = model[len(model) - min(keep, len(model)) :]
        assert len(buffer) == len(model)
        if model:
            assert buffer.keys[0, :, 0].tolist() == model


def test_windowed_buffer_memory_is_bounded() -> None:
    buffer = KvBuffer(keep=7)
    buffer.append(rows(0, 500), rows(0, 500))  # a long prefill
    buffer.clip()
    shrunk = buffer.nbytes()
    for i in range(1000):
        buffer.append(rows(500 + i, 1), rows(0, 1))
        buffer.clip()
    assert buffer.nbytes() == shrunk < 500 * HEADS * DIM * 4 * 2
    assert buffer.keys[0, :, 0].tolist() == [float(x) for x in range(1493, 1500)]


def test_replace_and_truncate() -> None:
    buffer = KvBuffer()
    buffer.append(rows(0, 5), rows(0, 5))
    buffer.replace_row(2, rows(99, 1), rows(98, 1))
    assert buffer.keys[0, :, 0].tolist() == [0.0, 1.0, 99.0, 3.0, 4.0]
    assert buffer.values[0, 2, 0].item() == 98.0
    buffer.truncate(3)
    assert len(buffer) == 3
    assert buffer.live_nbytes() == 2 * HEADS * 3 * DIM * 4 <= buffer.nbytes()


def test_rows_written_in_place_through_decode_slots() -> None:
    """A compiled decode layer writes its row into the storage itself, across regrowths and a
    window's clips; the buffer then holds what appends would have."""
    slotted, appended = KvBuffer(keep=20), KvBuffer(keep=20)
    assert slotted.decode_slots() is None  # nothing to write into before the first append
    first_k, first_v = torch.randn(2, 5, 4), torch.randn(2, 5, 4)  # [Hkv, S, D]
    slotted.append(first_k, first_v)
    appended.append(first_k, first_v)
    for step in range(60):
        k, v = torch.full((2, 1, 4), float(step)), torch.full((2, 1, 4), -float(step))
        keys, values, first, row = slotted.decode_slots()
        assert row - first == len(slotted) and row < keys.shape[0]
        keys[row], values[row] = k[:, 0], v[:, 0]
        slotted.commit_rows()
        appended.append(k, v)
        slotted.clip()
        appended.clip()
        assert torch.equal(slotted.keys, appended.keys)
        assert torch.equal(slotted.values, appended.values)


def test_a_sessions_layers_take_a_step_row_at_once() -> None:
    """`step_slots` hands out each layer's storage at the one place every layer's next row
    goes, growing them all alike where they are full; written there and counted
    (`commit_step`), the layers hold what appends would have. Layers whose rows are not at the
    same places, that clip to a window or that hold nothing yet are refused (None)."""
    layers = [KvBuffer() for _ in range(3)]
    appended = [KvBuffer() for _ in range(3)]
    for i, (slotted, plain) in enumerate(zip(layers, appended, strict=True)):
        prompt = torch.full((2, 5, 4), float(i))
        slotted.append(prompt, -prompt)
        plain.append(prompt, -prompt)
    capacities = set()
    for step in range(60):
        reserved = step_slots(layers)
        assert reserved is not None
        capacities.add(reserved[0][0].shape[0])
        keys, values, first, row = reserved
        assert first == 0 and row == len(layers[0])
        for i, (k_store, v_store) in enumerate(zip(keys, values, strict=True)):
            k_store[row], v_store[row] = float(100 * i + step), -float(100 * i + step)
            appended[i].append(
                torch.full((2, 1, 4), float(100 * i + step)),
                torch.full((2, 1, 4), -float(100 * i + step)),
            )
        commit_step(layers)
    assert len(capacities) > 1  # the storage grew on the way
    for slotted, plain in zip(layers, appended, strict=True):
        assert torch.equal(slotted.keys, plain.keys) and torch.equal(slotted.values, plain.values)

    layers[1].truncate(len(layers[1]) - 1)  # one layer a row behind
    assert step_slots(layers) is None
    windowed = [KvBuffer(keep=8), KvBuffer(keep=8)]
    for buffer in windowed:
        buffer.append(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))
    assert step_slots(windowed) is None
    assert step_slots([KvBuffer()]) is None  # empty: nothing to write into yet


def test_a_sessions_layers_take_a_chunk_of_rows_at_once() -> None:
    """`step_slots(layers, n)`: room for n rows in every layer at once (a prompt's next chunk
    riding in a batched step), the storage growing alike where fewer than n rows are left;
    the rows written there and counted with `commit_step(layers, n)` are what appends of the
    same chunks would hold."""
    layers = [KvBuffer() for _ in range(2)]
    appended = [KvBuffer() for _ in range(2)]
    for slotted, plain in zip(layers, appended, strict=True):
        slotted.append(torch.ones(2, 3, 4), -torch.ones(2, 3, 4))
        plain.append(torch.ones(2, 3, 4), -torch.ones(2, 3, 4))
    capacities = set()
    for chunk in (5, 1, 9, 7, 16):
        reserved = step_slots(layers, chunk)
        assert reserved is not None
        keys, values, first, row = reserved
        assert first == 0 and row == len(layers[0])
        capacities.add(keys[0].shape[0])
        for i, (k_store, v_store) in enumerate(zip(keys, values, strict=True)):
            assert k_store.shape[0] >= row + chunk
            rows = torch.arange(chunk, dtype=torch.float32).view(chunk, 1, 1) + 10 * i + row
            k_store[row : row + chunk] = rows.expand(chunk, 2, 4)
            v_store[row : row + chunk] = -rows.expand(chunk, 2, 4)
            new = rows.expand(chunk, 2, 4).transpose(0, 1)  # [Hkv, chunk, D]
            appended[i].append(new, -new)
        commit_step(layers, chunk)
    assert len(capacities) > 1  # grown on the way
    for slotted, plain in zip(layers, appended, strict=True):
        assert torch.equal(slotted.keys, plain.keys) and torch.equal(slotted.values, plain.values)


def test_expected_rows_are_allocated_at_once() -> None:
    """`expect(n)`: the first allocation makes room for n rows, so appends and step rows up to
    n never move the storage (a short generation's K/V is allocated once); past n it grows as
    before, keeping every row. A buffer that keeps a window ignores the hint."""
    hinted, plain = KvBuffer(), KvBuffer()
    hinted.expect(70)
    for buffer in (hinted, plain):
        buffer.append(rows(0, 6), -rows(0, 6))
    storage = hinted._k._data
    assert hinted._k.capacity == 70 and plain._k.capacity < 70
    plain_capacities = {plain._k.capacity}
    for step in range(64):
        for buffer in (hinted, plain):
            keys, values, _, row = step_slots([buffer])  # type: ignore[misc]
            keys[0][row], values[0][row] = float(6 + step), -float(6 + step)
            commit_step([buffer])
        assert hinted._k._data is storage  # 70 rows: never moved
        plain_capacities.add(plain._k.capacity)
    assert len(plain_capacities) > 1  # without the hint the same rows moved on the way
    hinted.append(rows(70, 3), -rows(70, 3))  # past the hint: grows, keeps every row
    assert hinted._k._data is not storage
    assert hinted.keys[0, :, 0].tolist() == [float(i) for i in range(73)]
    assert torch.equal(hinted.keys[:, :70], plain.keys) and torch.equal(hinted.values, -hinted.keys)
    windowed = KvBuffer(keep=8)
    windowed.expect(1000)
    windowed.append(rows(0, 3), -rows(0, 3))
    assert windowed._k.capacity < 100
