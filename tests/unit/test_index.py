"""Unit tests for zload.index: where every tensor's bytes are, and refusing headers that lie.

Valid checkpoints are written with the safetensors library itself and checked against it (dtype,
shape) and against the raw file bytes (start, nbytes). Invalid ones are crafted byte by byte.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import zload
from zload import CheckpointError, open_checkpoint
from zload.checkpoint.index import DTYPES, MAX_HEADER_BYTES, read_header

from tests.support.checkpoints import save_sharded


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write_raw(path, header=None, data: bytes = b"", *, header_bytes: bytes | None = None,
              declared_len: int | None = None):
    """A safetensors file by hand: 8-byte little-endian header length, header, data."""
    if header_bytes is None:
        header_bytes = json.dumps(header).encode()
    length = len(header_bytes) if declared_len is None else declared_len
    path.write_bytes(struct.pack("<Q", length) + header_bytes + data)
    return path


def f32(begin: int, end: int, shape=None) -> dict:
    """A header entry of F32 elements at data offsets [begin, end)."""
    return {"dtype": "F32", "shape": [(end - begin) // 4] if shape is None else shape,
            "data_offsets": [begin, end]}


def random_tensors(seed: int, names) -> dict[str, torch.Tensor]:
    """Distinct random tensors of assorted dtypes, so a wrong offset reads different bytes."""
    g = torch.Generator().manual_seed(seed)
    makers = [
        lambda: torch.randn(3, 5, generator=g),
        lambda: torch.randn(7, generator=g).to(torch.float16),
        lambda: torch.randn(2, 3, 2, generator=g).to(torch.bfloat16),
        lambda: torch.randint(-2**40, 2**40, (5,), generator=g),
        lambda: torch.randint(0, 256, (9,), generator=g, dtype=torch.uint8),
        lambda: torch.randint(0, 2, (4,), generator=g).bool(),
        lambda: torch.randn(3, generator=g).double(),
        lambda: torch.randint(-100, 100, (3, 1), generator=g, dtype=torch.int32),
    ]
    return {name: makers[i % len(makers)]() for i, name in enumerate(names)}


def assert_index_matches_files(index, expected: dict[str, torch.Tensor]):
    """Every entry agrees with safe_open (dtype, shape, data) and with the file's raw bytes."""
    assert set(index.tensors) == set(expected)
    assert index.total_bytes == sum(t.numel() * t.element_size() for t in expected.values())
    for name, entry in index.tensors.items():
        assert entry.name == name
        assert entry.file in index.files
        with safe_open(index.path(entry.file), framework="pt") as f:
            sl = f.get_slice(name)
            assert entry.dtype == sl.get_dtype()
            assert list(entry.shape) == list(sl.get_shape())
            stored = f.get_tensor(name)
        assert entry.numel == expected[name].numel()
        assert entry.nbytes == entry.numel * DTYPES[entry.dtype][1] == len(raw_bytes(stored))
        with open(index.path(entry.file), "rb") as f:
            f.seek(entry.start)
            assert f.read(entry.nbytes) == raw_bytes(expected[name]) == raw_bytes(stored)


# --------------------------------------------------------------------------------------------
# valid checkpoints


NAMES = ["embed.weight", "layers.0.w", "layers.0.b", "layers.1.w", "ids", "mask", "scale",
         "counts"]


def test_single_file(tmp_path):
    """A plain .safetensors path: every tensor's byte range, dtype and shape."""
    tensors = random_tensors(0, NAMES)
    path = tmp_path / "weights.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    index = open_checkpoint(path)
    assert index.files == ("weights.safetensors",) and index.path(index.files[0]) == str(path)
    assert_index_matches_files(index, tensors)
    assert read_header(str(path)) == dict(index.tensors)


def test_directory_with_model_safetensors(tmp_path):
    """A directory holding model.safetensors resolves to that file."""
    tensors = random_tensors(1, NAMES)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    index = open_checkpoint(tmp_path)
    assert index.files == ("model.safetensors",) and index.root == str(tmp_path)
    assert_index_matches_files(index, tensors)


def test_directory_with_one_oddly_named_file(tmp_path):
    """A directory with exactly one .safetensors file uses it whatever its name."""
    tensors = random_tensors(2, NAMES[:3])
    save_file(tensors, str(tmp_path / "adapter.safetensors"))
    assert_index_matches_files(open_checkpoint(str(tmp_path)), tensors)


@pytest.mark.parametrize("via", ["directory", "index_json"])
def test_sharded_checkpoint(tmp_path, via):
    """Index + shards, opened by folder or by the index file: tensors come from the right shard."""
    tensors = random_tensors(3, NAMES)
    save_sharded(tensors, tmp_path, shards=3)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    index = open_checkpoint(tmp_path if via == "directory"
                            else tmp_path / "model.safetensors.index.json")
    assert sorted(index.files) == sorted(set(weight_map.values())) and index.root == str(tmp_path)
    for name, entry in index.tensors.items():
        assert entry.file == weight_map[name]  # a file's key is its name in the weight map
    assert_index_matches_files(index, tensors)


def test_a_single_file_beside_an_index_is_what_from_pretrained_loads(tmp_path):
    """transformers looks for model.safetensors before the index; zload does the same, and says
    so (zload.save's commit relies on both readers making the same choice)."""
    save_sharded(random_tensors(3, NAMES), tmp_path, shards=3)
    single = {"stray": torch.zeros(2)}
    save_file(single, str(tmp_path / "model.safetensors"))
    with pytest.warns(zload.ZloadWarning, match="both model.safetensors and"):
        index = open_checkpoint(tmp_path)
    assert index.files == ("model.safetensors",)
    assert_index_matches_files(index, single)


def test_zero_size_and_scalar_tensors(tmp_path):
    """Shapes [0], [2, 0] and [] are indexed: zero-byte ranges in place, scalars one element."""
    tensors = {
        "empty": torch.zeros(0),
        "a": torch.arange(3, dtype=torch.float32),
        "empty2d": torch.zeros(2, 0, dtype=torch.bfloat16),
        "scalar": torch.tensor(-2.5, dtype=torch.float64),
        "scalar_i": torch.tensor(7, dtype=torch.int64),
        "z": torch.zeros(0, dtype=torch.int64),
    }
    path = tmp_path / "zeros.safetensors"
    save_file(tensors, str(path))
    index = open_checkpoint(path)
    assert_index_matches_files(index, tensors)
    assert index.tensors["empty2d"].shape == (2, 0)
    assert index.tensors["empty2d"].nbytes == 0
    assert index.tensors["scalar"].shape == ()
    assert index.tensors["scalar"].numel == 1
    assert index.tensors["scalar"].nbytes == 8


def test_hand_written_zero_size_tensors_share_offsets(tmp_path):
    """Zero-size tensors at the same offset as a real tensor, or at the very end, are valid."""
    data = raw_bytes(torch.tensor([1.5, -3.0]))
    header = {"__metadata__": {"k": "v"}, "a": f32(0, 8), "e0": f32(0, 0, [0]),
              "e1": f32(8, 8, [2, 0]), "s": {"dtype": "U8", "shape": [], "data_offsets": [8, 9]}}
    path = write_raw(tmp_path / "x.safetensors", header, data + b"\x2a")
    entries = read_header(str(path))
    header_end = path.stat().st_size - 9
    assert {n: (e.start - header_end, e.nbytes, e.shape) for n, e in entries.items()} == {
        "a": (0, 8, (2,)), "e0": (0, 0, (0,)), "e1": (8, 0, (2, 0)), "s": (8, 1, ())}


# --------------------------------------------------------------------------------------------
# invalid single files

BAD_FILES = [
    # id, file contents, message fragment, tensor named in the message (or None)
    ("empty_file", b"", "too short", None),
    ("shorter_than_8", b"\x02\x00\x00", "too short", None),
    ("header_past_end", dict(header={}, declared_len=1000), "runs past the end", None),
    ("header_over_limit", dict(header={}, declared_len=MAX_HEADER_BYTES + 1), "exceeds", None),
    ("non_utf8", dict(header_bytes=b'{"\xff\xfe": 1}'), "not valid JSON", None),
    ("not_json", dict(header_bytes=b'{"a": '), "not valid JSON", None),
    ("leading_space", dict(header_bytes=b' {}'), "does not start with '{'", None),
    ("json_array", dict(header_bytes=b'[]'), "does not start with '{'", None),
    ("duplicate_key", dict(header_bytes=b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": '
                                        b'[0, 4]}, "w": {"dtype": "F32", "shape": [1], '
                                        b'"data_offsets": [0, 4]}}', data=b"\0" * 4),
     "duplicate key", "w"),
    ("entry_not_object", dict(header={"w": [0, 4]}), "exactly dtype, shape and data_offsets", "w"),
    ("entry_extra_key", dict(header={"w": {**f32(0, 4), "x": 1}}, data=b"\0" * 4),
     "exactly dtype, shape and data_offsets", "w"),
    ("entry_missing_key", dict(header={"w": {"dtype": "F32", "shape": [1]}}),
     "exactly dtype, shape and data_offsets", "w"),
    ("unknown_dtype", dict(header={"w": {**f32(0, 4), "dtype": "F128"}}, data=b"\0" * 4),
     "unknown dtype", "w"),
    ("shape_negative", dict(header={"w": f32(0, 4, [-1])}, data=b"\0" * 4), "shape must be", "w"),
    ("shape_float", dict(header={"w": f32(0, 4, [1.0])}, data=b"\0" * 4), "shape must be", "w"),
    ("shape_bool", dict(header={"w": f32(0, 4, [True])}, data=b"\0" * 4), "shape must be", "w"),
    ("shape_not_list", dict(header={"w": f32(0, 4, 1)}, data=b"\0" * 4), "shape must be", "w"),
    ("offsets_reversed", dict(header={"w": {**f32(0, 4), "data_offsets": [4, 0]}}, data=b"\0" * 4),
     "data_offsets must be", "w"),
    ("offsets_one_value", dict(header={"w": {**f32(0, 4), "data_offsets": [4]}}, data=b"\0" * 4),
     "data_offsets must be", "w"),
    ("offsets_three_values", dict(header={"w": {**f32(0, 4), "data_offsets": [0, 4, 8]}},
                                  data=b"\0" * 4), "data_offsets must be", "w"),
    ("offsets_negative", dict(header={"w": {**f32(0, 4), "data_offsets": [-4, 0]}}),
     "data_offsets must be", "w"),
    ("offsets_string", dict(header={"w": {**f32(0, 4), "data_offsets": [0, "4"]}}, data=b"\0" * 4),
     "data_offsets must be", "w"),
    ("bytes_not_numel_times_itemsize", dict(header={"w": f32(0, 4, [2])}, data=b"\0" * 4),
     "needs 8", "w"),
    ("overlap", dict(header={"a": f32(0, 8), "b": f32(4, 12)}, data=b"\0" * 12), "overlaps 'a'",
     "b"),
    ("gap_between", dict(header={"a": f32(0, 4), "b": f32(8, 12)}, data=b"\0" * 12),
     "gap", "b"),
    ("gap_at_start", dict(header={"a": f32(4, 8)}, data=b"\0" * 8), "gap", "a"),
    ("truncated_data", dict(header={"a": f32(0, 4), "b": f32(4, 12)}, data=b"\0" * 10),
     "truncated", "b"),
    ("trailing_bytes", dict(header={"a": f32(0, 4)}, data=b"\0" * 7),
     "3 bytes after the last tensor", None),
    ("metadata_not_strings", dict(header={"__metadata__": {"k": 1}}), "__metadata__", None),
    ("metadata_not_object", dict(header={"__metadata__": ["k"]}), "__metadata__", None),
]


@pytest.mark.parametrize("contents, fragment, tensor", [c[1:] for c in BAD_FILES],
                         ids=[c[0] for c in BAD_FILES])
def test_invalid_file_is_refused(tmp_path, contents, fragment, tensor):
    """Each way a header can lie is a CheckpointError naming the file and, if any, the tensor."""
    path = tmp_path / "bad.safetensors"
    if isinstance(contents, bytes):
        path.write_bytes(contents)
    else:
        write_raw(path, **contents)
    for opener in (read_header, open_checkpoint):
        with pytest.raises(CheckpointError) as err:
            opener(str(path))
        message = str(err.value)
        assert str(path) in message
        assert fragment in message
        if tensor is not None:
            assert f"'{tensor}'" in message


def test_hand_written_header_is_accepted_before_corruption(tmp_path):
    """The helper writes valid files, so the refusals above are due to the corruption alone."""
    path = write_raw(tmp_path / "ok.safetensors", {"a": f32(0, 4), "b": f32(4, 12)}, b"\0" * 12)
    assert sorted(read_header(str(path))) == ["a", "b"]


# --------------------------------------------------------------------------------------------
# invalid sharded checkpoints and paths


def _corrupt_shards(folder, how: str) -> tuple[str, str | None]:
    """Break a valid 2-shard folder one way; returns (file the error must name, tensor or None)."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    wm = index["weight_map"]
    first, second = sorted(set(wm.values()))
    in_first = sorted(n for n, s in wm.items() if s == first)[0]
    if how == "missing_shard":
        (folder / second).unlink()
        return second, None
    if how == "listed_but_absent":
        wm["ghost.weight"] = second
        index_path.write_text(json.dumps(index))
        return second, "ghost.weight"
    if how == "mapped_to_other_shard":
        wm[in_first] = second
        index_path.write_text(json.dumps(index))
        return first, in_first
    if how == "not_in_weight_map":
        del wm[in_first]
        index_path.write_text(json.dumps(index))
        return first, in_first
    if how == "in_two_shards":
        # The second shard also carries a tensor the weight_map assigns to the first one.
        with safe_open(str(folder / second), framework="pt") as f:
            part = {n: f.get_tensor(n) for n in f.keys()}
        part[in_first] = torch.ones(3)
        save_file(part, str(folder / second))
        return second, in_first
    if how == "bad_shard_header":
        (folder / second).write_bytes(b"\x05")
        return second, None
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["missing_shard", "listed_but_absent", "mapped_to_other_shard",
                                 "not_in_weight_map", "in_two_shards", "bad_shard_header"])
def test_inconsistent_shards_are_refused(tmp_path, how):
    """Index and shards must agree exactly; the error names the shard and the tensor."""
    save_sharded(random_tensors(4, NAMES), tmp_path, shards=2)
    open_checkpoint(tmp_path)  # valid before the corruption
    shard, tensor = _corrupt_shards(tmp_path, how)
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(tmp_path)
    message = str(err.value)
    assert str(tmp_path / shard) in message
    if tensor is not None:
        assert f"'{tensor}'" in message


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"weight_map": {"a": 3}}',
                                  '{"weight_map": ["a"]}', '{"metadata": {}}'])
def test_invalid_index_file_is_refused(tmp_path, text):
    """A malformed index .json is a CheckpointError naming the index file."""
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(text)
    for target in (path, tmp_path):
        with pytest.raises(CheckpointError, match="weight_map|not a valid index") as err:
            open_checkpoint(target)
        assert str(path) in str(err.value)


@pytest.mark.parametrize("layout", ["nonexistent", "empty_dir", "no_safetensors", "two_singles"])
def test_unresolvable_path_is_refused(tmp_path, layout):
    """A path that is neither a checkpoint file nor a folder with exactly one is refused."""
    target = tmp_path / "ckpt"
    if layout != "nonexistent":
        target.mkdir()
    if layout == "no_safetensors":
        (target / "config.json").write_text("{}")
        (target / "model.bin").write_bytes(b"\0" * 16)
    if layout == "two_singles":
        for name in ("a.safetensors", "b.safetensors"):
            save_file({"w": torch.zeros(1)}, str(target / name))
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(target)
    assert str(target) in str(err.value)
    expected = {"nonexistent": "no such file", "empty_dir": "no safetensors files",
                "no_safetensors": "no safetensors files",
                "two_singles": "a.safetensors, b.safetensors"}[layout]
    assert expected in str(err.value)


def test_dot_dot_after_a_link_reads_the_shards_beside_the_index(tmp_path):
    """``latest/../ckpt``, with ``latest`` a link into ``runs/``, is ``runs/ckpt`` to the kernel,
    which opens that index. Its shards were looked for in ``./ckpt`` (``os.path.abspath`` drops the
    pair as text): another checkpoint's shards of the same names, loaded without a word."""
    (tmp_path / "runs" / "run-7").mkdir(parents=True)
    (tmp_path / "latest").symlink_to(tmp_path / "runs" / "run-7")
    wanted = {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.ones(2)}
    save_sharded(wanted, tmp_path / "runs" / "ckpt", shards=2)
    save_sharded({k: -v for k, v in wanted.items()}, tmp_path / "ckpt", shards=2)  # not the one named
    model = torch.nn.Linear(3, 2)
    zload.load_into(model, f"{tmp_path}/latest/../ckpt")
    assert torch.equal(model.weight.detach(), wanted["weight"]) and torch.equal(model.bias.detach(), wanted["bias"])


def test_absolute_path_resolves_the_links_above_the_last_component(tmp_path, monkeypatch):
    """The kernel's reading of a path, not the text's: the last component stays as given (a link
    there is seen as a link); a dangling link on the way, a NUL byte or a removed working folder
    (with an absolute path) leave the path to the kernel to refuse, as ``os.path.abspath`` did."""
    from zload.checkpoint.files import absolute_path

    (tmp_path / "runs" / "run-7").mkdir(parents=True)
    (tmp_path / "latest").symlink_to(tmp_path / "runs" / "run-7")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "deep")
    monkeypatch.chdir(tmp_path)
    assert absolute_path("latest/../other") == str(tmp_path / "runs" / "other")
    assert absolute_path("latest/..") == str(tmp_path / "runs")
    assert absolute_path("latest") == absolute_path("latest/") == str(tmp_path / "latest")
    assert absolute_path(".") == absolute_path("") == str(tmp_path)
    assert absolute_path("/") == "/"
    assert absolute_path("dangling/x") == str(tmp_path / "dangling" / "x")  # not nowhere/deep/x
    assert absolute_path("a\0b/c") == str(tmp_path / "a\0b" / "c")
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert absolute_path(str(tmp_path / "latest" / ".." / "x")) == str(tmp_path / "runs" / "x")
