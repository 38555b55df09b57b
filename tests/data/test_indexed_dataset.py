"""The .bin/.idx files match Megatron-LM's MMapIndexedDataset byte for byte, and
broken files are rejected with a message naming the file and the problem."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest

from megazero.data.indexed_dataset import (
    AtomicDatasetWriter, IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, best_fitting_dtype,
)

DOCS = [[1, 2, 3], [], [65000, 7], [9] * 10]


def write(prefix, docs, dtype=np.uint16):
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for d in docs:
        b.add_item(np.array(d))
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return str(prefix)


def parse_idx(path):
    """Independent reader of Megatron's .idx layout, straight from the bytes."""
    data = open(path, "rb").read()
    assert data[:9] == b"MMIDIDX\x00\x00"
    version, = struct.unpack_from("<Q", data, 9)
    code, = struct.unpack_from("<B", data, 17)
    n_seq, n_doc = struct.unpack_from("<QQ", data, 18)
    off = 34
    sizes = struct.unpack_from(f"<{n_seq}i", data, off)
    off += 4 * n_seq
    pointers = struct.unpack_from(f"<{n_seq}q", data, off)
    off += 8 * n_seq
    doc_idx = struct.unpack_from(f"<{n_doc}q", data, off)
    off += 8 * n_doc
    assert off == len(data), "no trailing bytes"
    return version, code, list(sizes), list(pointers), list(doc_idx)


@pytest.mark.parametrize("dtype, code, itemsize", [(np.uint16, 8, 2), (np.int32, 4, 4)])
def test_idx_layout_matches_megatron(tmp_path, dtype, code, itemsize):
    prefix = write(tmp_path / "d", DOCS, dtype)
    version, got_code, sizes, pointers, doc_idx = parse_idx(f"{prefix}.idx")
    assert version == 1 and got_code == code
    assert sizes == [3, 0, 2, 10]
    assert pointers == [0, 3 * itemsize, 3 * itemsize, 5 * itemsize]
    assert doc_idx == [0, 1, 2, 3, 4]
    raw = np.fromfile(f"{prefix}.bin", dtype=np.dtype(dtype).newbyteorder("<"))
    assert raw.tolist() == [t for d in DOCS for t in d]


def test_dtype_choice():
    assert best_fitting_dtype(32000) is np.uint16
    assert best_fitting_dtype(65499) is np.uint16
    assert best_fitting_dtype(65500) is np.int32
    assert best_fitting_dtype(128256) is np.int32


def test_reader(tmp_path):
    ds = IndexedDataset(write(tmp_path / "d", DOCS))
    assert len(ds) == 4 and ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(4)] == DOCS
    assert ds[-1].tolist() == DOCS[-1] and [a.tolist() for a in ds[0:2]] == DOCS[:2]
    assert ds.get(2, offset=1).tolist() == [7]
    assert ds.get(3, offset=2, length=3).tolist() == [9, 9, 9]
    assert ds.sizes.tolist() == [3, 0, 2, 10] and ds.doc_idx.tolist() == [0, 1, 2, 3, 4]
    assert ds.num_tokens == 15
    assert not ds[0].flags.owndata  # a view into the memory map, no copy
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)
    with pytest.raises(IndexError):
        ds[4]
    clone = pickle.loads(pickle.dumps(ds))  # pickles the path, not the data
    assert len(pickle.dumps(ds)) < 200 and clone[3].tolist() == DOCS[3]


def test_empty_dataset(tmp_path):
    ds = IndexedDataset(write(tmp_path / "e", []))
    assert len(ds) == 0 and ds.doc_idx.tolist() == [0]


def test_add_index_merges(tmp_path):
    a = write(tmp_path / "a", DOCS[:2])
    b = write(tmp_path / "b", DOCS[2:])
    builder = IndexedDatasetBuilder(tmp_path / "ab.bin", np.uint16)
    builder.add_index(a)
    builder.add_index(b)
    builder.finalize(tmp_path / "ab.idx")
    merged = IndexedDataset(tmp_path / "ab")
    assert [merged[i].tolist() for i in range(4)] == DOCS
    assert merged.doc_idx.tolist() == [0, 1, 2, 3, 4]
    c = write(tmp_path / "c", DOCS, np.int32)
    with pytest.raises(ValueError, match="dtype"):
        IndexedDatasetBuilder(tmp_path / "x.bin", np.uint16).add_index(c)


def test_token_out_of_dtype_range(tmp_path):
    b = IndexedDatasetBuilder(tmp_path / "o.bin", np.uint16)
    with pytest.raises(ValueError, match="do not fit"):
        b.add_item([70000])


def test_atomic_writer_leaves_nothing_on_failure(tmp_path):
    with pytest.raises(RuntimeError):
        with AtomicDatasetWriter(tmp_path / "w", np.uint16) as w:
            w.builder.add_item([1, 2])
            w.builder.end_document()
            raise RuntimeError("simulated crash")
    assert list(tmp_path.iterdir()) == []
    with AtomicDatasetWriter(tmp_path / "w", np.uint16) as w:
        w.builder.add_item([1, 2])
        w.builder.end_document()
        w.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.bin", "w.idx"]


def corrupt(path, mutate):
    data = bytearray(open(path, "rb").read())
    data = mutate(data)
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("target, mutate, message", [
    ("idx", lambda d: d[:-5], "index truncated"),
    ("idx", lambda d: d[:20], "truncated"),
    ("idx", lambda d: d + b"\0" * 8, "trailing bytes"),
    ("idx", lambda d: b"PK\x03\x04" + d[4:], "not a Megatron"),
    ("idx", lambda d: d[:9] + struct.pack("<Q", 2) + d[17:], "version 2"),
    ("idx", lambda d: d[:17] + bytes([99]) + d[18:], "unknown dtype code 99"),
    ("bin", lambda d: d[:-2], "data file truncated"),
    ("bin", lambda d: d + b"\0\0", "longer than its index"),
])
def test_broken_files_are_rejected(tmp_path, target, mutate, message):
    prefix = write(tmp_path / "d", DOCS)
    path = f"{prefix}.{target}"
    corrupt(path, mutate)
    with pytest.raises(IndexedDatasetError, match=message) as info:
        IndexedDataset(prefix)
    assert path in str(info.value)
    assert isinstance(info.value, ValueError)


def test_corrupt_pointers_and_missing_files(tmp_path):
    prefix = write(tmp_path / "d", DOCS)
    # Swap in a wrong byte offset for sequence 2 (offsets start at byte 34 + 4*4).
    corrupt(f"{prefix}.idx", lambda d: d[:34 + 16 + 16] + struct.pack("<q", 1) + d[34 + 16 + 24:])
    with pytest.raises(IndexedDatasetError, match="offsets"):
        IndexedDataset(prefix)
    with pytest.raises(IndexedDatasetError, match="not found"):
        IndexedDataset(tmp_path / "missing")
    # The .bin given where the .idx is expected (a common mix-up) is foreign too.
    write(tmp_path / "e", DOCS)
    (tmp_path / "e.idx").write_bytes((tmp_path / "e.bin").read_bytes())
    with pytest.raises(IndexedDatasetError, match="not a Megatron"):
        IndexedDataset(tmp_path / "e")


def test_merge_datasets_tool(tmp_path, capsys):
    from tools.merge_datasets import main

    shards = tmp_path / "shards"
    shards.mkdir()
    write(shards / "s0", DOCS[:1])
    write(shards / "s1", DOCS[1:3])
    write(shards / "s2", DOCS[3:])
    assert main(["--input", str(shards), "--output-prefix", str(tmp_path / "all")]) == 0
    merged = IndexedDataset(tmp_path / "all")
    assert [merged[i].tolist() for i in range(len(merged))] == DOCS
    assert main(["--input", str(shards / "s2"), str(shards / "s0.idx"),
                 "--output-prefix", str(tmp_path / "two")]) == 0
    two = IndexedDataset(tmp_path / "two")
    assert [two[i].tolist() for i in range(len(two))] == [DOCS[3], DOCS[0]]
    assert main(["--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "x")]) == 1
    assert "not found" in capsys.readouterr().err
