"""A DeepSpeed checkpoint is hostile input too (issue 18): each case starts from a real
``engine.save_checkpoint`` at world size 2, tampers with a copy and loads it at world size 2 into
a real zero.Init model. Every rank raises the same ZloadError naming the file (and the tensor
where one is at fault), the model stays untouched, no rank hangs, and nothing in a pickle runs.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import zload
from zload.cli import main as cli

from tests.support.harness import run_world
from tests.support.models import tiny_llama_config
from tests.support.zero3 import assert_bit_equal, assert_unchanged, build_zero, full_state, snapshot
from tests.unit.test_hostile_native import _BYTEARRAY, _binunicode

transformers = pytest.importorskip("transformers")

TIMEOUT = 120  # seconds a world may take to load or refuse: more is a hang


class NativeCheckpoint(NamedTuple):
    folder: Path  # what save_checkpoint was given: holds 'latest' and the tag folder
    tag_folder: Path


# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(native_checkpoint) -> NativeCheckpoint:
    """ZeRO-3, bf16, by 2 ranks, with frozen parameters and tied embeddings."""
    case = native_checkpoint(world=2, stage=3, dtype="bf16")
    return NativeCheckpoint(case.folder, case.tag_folder)


@pytest.fixture(scope="module")
def reference(saved) -> dict[str, torch.Tensor]:
    """What DeepSpeed itself rebuilds from the save: what a load must give."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(saved.folder))


@pytest.fixture
def ckpt(saved, tmp_path) -> NativeCheckpoint:
    """A copy of the save to tamper with."""
    folder = shutil.copytree(saved.folder, tmp_path / "ckpt")
    return NativeCheckpoint(folder, folder / saved.tag_folder.name)


def optim(ckpt: NativeCheckpoint, rank: int) -> Path:
    (path,) = ckpt.tag_folder.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return path


def model_states(ckpt: NativeCheckpoint, rank: int) -> Path:
    return ckpt.tag_folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


class Outcome(NamedTuple):
    error: tuple | None  # (class name, message, path, tensor) of the ZloadError raised
    state: dict[str, torch.Tensor] | None  # the model's every tensor, when the load succeeded


def _load_body(path, node_dirs=None, untouched: bool = True) -> Outcome:
    """Load ``path`` (with ``node_dirs``, resolved in ``node_dirs[rank]``: node-local copies); on
    an error, check the model ``untouched``."""
    from transformers import LlamaForCausalLM

    model = build_zero(lambda: LlamaForCausalLM(tiny_llama_config(tie=True)))
    before = snapshot(model)
    cwd = os.getcwd()
    try:
        if node_dirs:
            os.chdir(node_dirs[dist.get_rank()])
        zload.load_into(model, path)
    except zload.ZloadError as e:
        if untouched:
            assert_unchanged(model, before)
        return Outcome((type(e).__name__, str(e), e.path, e.tensor), None)
    finally:
        os.chdir(cwd)
    return Outcome(None, full_state(model))


def refused(path, node_dirs=None) -> tuple:
    """The one error every rank raised loading ``path``, its model untouched."""
    outcomes = run_world(2, _load_body, str(path), node_dirs, timeout=TIMEOUT)
    errors = [o.error for o in outcomes]
    assert None not in errors, f"a rank loaded a hostile checkpoint: {errors}"
    assert len(set(errors)) == 1, f"ranks disagree: {errors}"
    return errors[0]


def loaded(path, reference, node_dirs=None) -> None:
    """Every rank loads ``path`` bit for bit as DeepSpeed rebuilds it."""
    for outcome in run_world(2, _load_body, str(path), node_dirs, timeout=TIMEOUT):
        assert outcome.error is None, outcome.error
        assert sorted(outcome.state) == sorted(reference)
        for name, tensor in outcome.state.items():
            assert_bit_equal(tensor, reference[name].to(tensor.dtype), name)


def test_the_untampered_copy_loads(ckpt, reference):
    """The control: every case below fails only because of what it changed."""
    loaded(ckpt.folder, reference)


# --------------------------------------------------------------------------------------------
# 'latest' and the tag folder


@pytest.mark.parametrize("tag", ["../outside", "{outside}", "zero_to_fp32.py", "global_step9", "1MB"])
def test_latest_naming_no_tag_folder_inside(ckpt, tag):
    """'../outside' and the absolute path name a valid tag folder outside the checkpoint: it must
    be refused on the name, not followed."""
    outside = ckpt.folder.parent / "outside"
    shutil.copytree(ckpt.tag_folder, outside)
    tag = "x" * (1 << 20) if tag == "1MB" else tag.format(outside=outside)
    (ckpt.folder / "latest").write_text(tag)
    kind, message, path, _ = refused(ckpt.folder)
    latest = str(ckpt.folder / "latest")
    assert message.startswith(f"cannot load {ckpt.folder}") and f"{latest}:" in message
    if tag in ("zero_to_fp32.py", "global_step9"):
        assert kind == "CheckpointNotFoundError" and f"names the tag '{tag}'" in message and "is not a folder" in message
    elif len(tag) > 4096:
        assert kind == "InvalidCheckpointError" and "1048576 bytes" in message and path == latest
    else:
        assert kind == "InvalidCheckpointError" and f"{tag!r}, which is not a folder name inside" in message


def test_a_tag_folder_linked_from_elsewhere_is_followed(ckpt, reference):
    """Decided: as the Hub cache's snapshot links are followed. What must stay inside the
    checkpoint is the tag *name* ('latest' is checkpoint content); where a link the owner made
    points (a tag moved to another disk) is the owner's arrangement, and nothing read from there
    can run code or be read unchecked."""
    elsewhere = ckpt.folder.parent / "elsewhere" / ckpt.tag_folder.name
    elsewhere.parent.mkdir()
    shutil.move(ckpt.tag_folder, elsewhere)
    ckpt.tag_folder.symlink_to(elsewhere, target_is_directory=True)
    loaded(ckpt.folder, reference)


# --------------------------------------------------------------------------------------------
# .pt files that are not what torch.save writes


def _rewrite_archive(path: Path, *, replace: dict[str, bytes] | None = None, deflate: str = "") -> None:
    """Rewrite the zip archive at ``path`` with Python's zipfile: records whose name ends with
    ``replace``'s keys get its bytes, those ending with ``deflate`` are DEFLATE-compressed."""
    with zipfile.ZipFile(path) as source:
        records = [(info.filename, source.read(info)) for info in source.infolist()]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as target:
        for name, data in records:
            data = next((new for end, new in (replace or {}).items() if name.endswith(end)), data)
            method = zipfile.ZIP_DEFLATED if deflate and name.endswith(deflate) else zipfile.ZIP_STORED
            target.writestr(name, data, compress_type=method)
    path.write_bytes(buffer.getvalue())


@pytest.mark.parametrize("how,why", [
    ("fifo", "is a FIFO, not a regular file"),
    ("directory", "is a directory, not a regular file"),
    ("truncated", "is not an archive torch.save wrote"),
    ("not_a_zip", "is not an archive torch.save wrote"),
    ("deflated_tensor", "fp32_flat_groups[0]: "),  # its record compressed, or misplaced by it
    ("deflated_pickle", "data.pkl' is compressed; torch.save stores every record uncompressed"),
])
def test_a_pt_file_that_torch_save_did_not_write(ckpt, how, why):
    """Rank 1's optimizer states only (which rank 0 does not read at the same world size)."""
    path = optim(ckpt, 1)
    if how == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif how == "directory":
        path.unlink()
        path.mkdir()
    elif how == "truncated":
        os.truncate(path, path.stat().st_size - 100)
    elif how == "not_a_zip":
        path.write_bytes(b"not a zip archive" * 100)
    else:
        _rewrite_archive(path, deflate="data/0" if how == "deflated_tensor" else "data.pkl")
    kind, message, error_path, tensor = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and f"{path}: " in message and why in message, message
    assert error_path == str(path)
    if how == "deflated_tensor":
        assert tensor == "fp32_flat_groups[0]"


# --------------------------------------------------------------------------------------------
# pickles that would run code


class _RunsCode:
    """Pickled as the call ``function(argument)``, which unpickling would make."""

    def __init__(self, function, argument):
        self.function, self.argument = function, argument

    def __reduce__(self):
        return self.function, (self.argument,)


def _code(how: str, marker: Path) -> _RunsCode:
    touch = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    return {"os.system": _RunsCode(os.system, f"touch {marker}"), "eval": _RunsCode(eval, touch),
            "exec": _RunsCode(exec, touch)}[how]


def _resave(path: Path, change) -> None:
    state = torch.load(path, weights_only=False)
    change(state)
    torch.save(state, path)


@pytest.mark.parametrize("how", ["eval", "exec"])
def test_code_beside_what_zload_reads_stays_inert(ckpt, reference, tmp_path, how):
    """Decided: a global the pickle names that torch does not allow becomes an inert stand-in
    (a trainer's client state holds classes of its own), so code where zload reads nothing
    neither runs nor stops the load."""
    marker = tmp_path / "ran"
    _resave(model_states(ckpt, 0), lambda state: state.update(client_state=_code(how, marker)))
    loaded(ckpt.folder, reference)
    assert cli(["inspect", str(ckpt.folder)]) == 0
    assert not marker.exists(), "the checkpoint ran code"


@pytest.mark.parametrize("how", ["eval", "exec"])
def test_code_where_zload_reads_is_refused(ckpt, tmp_path, how):
    marker = tmp_path / "ran"
    path = optim(ckpt, 1)
    _resave(path, lambda state: state.update(optimizer_state_dict=_code(how, marker)))
    kind, message, error_path, _ = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and f"{path}: entry 'optimizer_state_dict' is _Inert" in message
    assert error_path == str(path)
    assert not marker.exists(), "the checkpoint ran code"


def test_os_and_sys_globals_are_refused_wherever_they_are(ckpt, tmp_path):
    """torch blocks the modules os, posix, nt and sys outright, even as stand-ins: refused, with
    torch's reason but not its advice to load with weights_only=False."""
    marker = tmp_path / "ran"
    path = model_states(ckpt, 0)
    _resave(path, lambda state: state.update(client_state=_code("os.system", marker)))
    kind, message, error_path, _ = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and error_path == str(path)
    assert f"{path}: cannot be unpickled with weights_only=True" in message
    assert "posix.system whose module posix is blocked" in message and "intact copy" in message
    assert "weights_only` set to `False`" not in message
    assert not marker.exists(), "the checkpoint ran code"


@pytest.mark.parametrize("pickled,why", [
    ("posix_system", "posix.system whose module posix is blocked"),
    ("builtins_eval", "it holds _Inert, not a dict"),
    ("stack_global", "Unsupported operand 147"),
])
def test_a_crafted_data_pkl_runs_nothing(ckpt, tmp_path, pickled, why):
    """A data.pkl written by hand, its whole content a call: GLOBAL posix.system or builtins.eval
    + REDUCE; and a STACK_GLOBAL whose names come from the memo (torch refuses the opcode)."""
    marker = tmp_path / "ran"
    command = f"touch {marker}".encode()
    code = f"__import__('pathlib').Path({str(marker)!r}).touch()".encode()
    data = {"posix_system": b"cposix\nsystem\n" + _binunicode(command),
            "builtins_eval": b"cbuiltins\neval\n" + _binunicode(code),
            "stack_global": _binunicode(b"builtins") + b"q\x00" + _binunicode(b"eval") + b"q\x01h\x00h\x01\x93"
            + _binunicode(code)}[pickled]
    data = b"\x80\x02" + data + b"\x85R."
    path = model_states(ckpt, 1)
    _rewrite_archive(path, replace={"/data.pkl": data})
    kind, message, error_path, _ = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and error_path == str(path) and why in message, message
    assert not marker.exists(), "the checkpoint ran code"
    pickle.loads(data)  # what the bytes would do to a plain unpickler
    assert marker.exists()


def _lie(entry: str):
    """A change to an unpickled state dict: one entry zload reads, of the wrong kind or size."""
    def change(state):
        if entry == "partition_count":
            state["optimizer_state_dict"]["partition_count"] = "2"
        elif entry == "buffer_names":
            state["buffer_names"] = [["model.norm.weight"]]
        else:  # a shape whose product takes minutes (the sizes 2 ** 1..300000) with no check on the way
            state["param_shapes"][0]["model.norm.weight"] = torch.Size([2] * 300_000)
    return change


@pytest.mark.parametrize("entry,why", [
    ("partition_count", "partition_count '2' is not a count of ranks"),
    ("buffer_names", "buffer_names is not a list of names"),
    ("param_shapes", "param_shapes[0] 'model.norm.weight': shape torch.Size([2, 2, 2"),
])
def test_entries_of_the_wrong_kind_or_size(ckpt, entry, why):
    path = optim(ckpt, 0) if entry == "partition_count" else model_states(ckpt, 0)
    _resave(path, _lie(entry))
    kind, message, error_path, _ = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and error_path == str(path) and f"{path}: {why}" in message, message
    assert len(message) < 2000


def _hash_bomb(depth: int) -> bytes:
    """A dict keyed by a tuple nest whose level ``i + 1`` is (level i, level i): hashing the key
    takes 2**depth steps in C code, which no signal interrupts; the pickle is a few hundred bytes."""
    get = [pickle.LONG_BINGET + i.to_bytes(4, "little") for i in range(depth)]
    put = [pickle.LONG_BINPUT + i.to_bytes(4, "little") for i in range(depth + 1)]
    levels = b"".join(get[i] + get[i] + pickle.TUPLE2 + put[i + 1] for i in range(depth))
    return (pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + pickle.BININT1 + b"\x07" + put[0] + levels
            + pickle.BININT1 + b"\x01" + pickle.SETITEM + pickle.STOP)


def test_a_pickle_that_would_take_forever_to_unpickle(ckpt):
    _rewrite_archive(optim(ckpt, 1), replace={"data.pkl": _hash_bomb(60)})
    kind, message, path, _ = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and path == str(optim(ckpt, 1))
    assert "would build an object of more than" in message


def test_a_tensor_whose_methods_the_pickle_replaces(ckpt, reference):
    """weights_only restores a tensor's attributes: ``numel`` set to a class that builds 0 must
    not change what zload reads (it calls torch's own methods)."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    def lie(state):
        state["optimizer_state_dict"]["fp32_flat_groups"][0].numel = ZeroStageEnum

    _resave(optim(ckpt, 1), lie)
    loaded(ckpt.folder, reference)


def test_rank_files_of_different_steps(ckpt):
    """Rank 1's model states left by an earlier save to the same tag, of the same sizes."""
    _resave(model_states(ckpt, 1), lambda state: state.update(global_steps=7))
    kind, message, path, _ = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and "model states are of different steps" in message


def test_a_pickle_that_is_not_a_dict(ckpt):
    path = model_states(ckpt, 0)
    torch.save([1, 2, 3], path)
    kind, message, _, _ = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and f"{path}: " in message and "it holds list, not a dict" in message


# --------------------------------------------------------------------------------------------
# files of other saves, missing, stale or of other parallelism


@pytest.fixture(scope="module")
def other_save(native_checkpoint) -> NativeCheckpoint:
    """Another model's save by 2 ranks: untied embeddings, so other partition sizes."""
    case = native_checkpoint(world=2, stage=3, dtype="bf16", tied=False)
    return NativeCheckpoint(case.folder, case.tag_folder)


def test_a_rank_file_of_another_save(ckpt, other_save):
    shutil.copy(optim(other_save, 1), optim(ckpt, 1))
    kind, message, _, _ = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and "fp32 flat groups differ in size" in message
    assert optim(ckpt, 0).name in message and optim(ckpt, 1).name in message


def test_another_ranks_file_of_the_same_size(ckpt):
    """Rank 0's optimizer states copied over rank 1's: the same sizes, other values. The archive
    inside still bears the name torch.save gave it."""
    shutil.copy(optim(ckpt, 0), optim(ckpt, 1))
    kind, message, path, _ = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and path == str(optim(ckpt, 1))
    assert f"was written as {optim(ckpt, 0).name}" in message


def test_a_partition_count_of_10_to_the_12_names_the_first_missing_ranks(ckpt):
    """A hostile count of ranks: the first missing named, and how many more (listing every one
    was a hang)."""
    def count(state):
        state["optimizer_state_dict"]["partition_count"] = 10**12
    _resave(optim(ckpt, 0), count)
    kind, message, path, _ = refused(ckpt.folder)
    assert kind == "CheckpointNotFoundError" and path == str(ckpt.tag_folder)
    assert f"of rank(s) [2, 3, 4, 5, 6, 7, 8, 9, ... ({10**12 - 10} more)] are missing" in message, message


def test_a_missing_rank_file(ckpt):
    optim(ckpt, 1).unlink()
    kind, message, path, _ = refused(ckpt.folder)
    assert kind == "CheckpointNotFoundError" and path == str(ckpt.tag_folder)
    assert "optimizer states (*_optim_states.pt) of rank(s) [1] are missing" in message


@pytest.mark.parametrize("which", ["optim", "model"])
def test_a_stale_file_of_a_rank_that_did_not_save(ckpt, which):
    """Left by an older save by 3 ranks into the same tag folder."""
    source = optim(ckpt, 0) if which == "optim" else model_states(ckpt, 0)
    stale = source.with_name(source.name.replace("rank_0_", "rank_2_"))
    shutil.copy(source, stale)
    kind, message, path, _ = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and path == str(stale)
    assert f"{stale.name}: the " in message and "beyond the 2 that saved" in message
    assert "remove the files an older save left" in message


def test_a_model_parallel_rank_file(ckpt):
    stray = ckpt.tag_folder / "zero_pp_rank_0_mp_rank_01_model_states.pt"
    shutil.copy(model_states(ckpt, 0), stray)
    kind, message, path, _ = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and path == str(stray) and "model-parallel rank's file" in message


# --------------------------------------------------------------------------------------------
# every rank's problem reaches every rank; files that change during the load


def test_one_ranks_copy_is_hostile(tmp_path, saved):
    """Node-local copies: only rank 1's holds a FIFO. Rank 0 must not wait for it forever."""
    for node in ("node0", "node1"):
        shutil.copytree(saved.folder, tmp_path / node / "ckpt")
    fifo = tmp_path / "node1" / "ckpt" / saved.tag_folder.name / optim(saved, 0).name
    fifo.unlink()
    os.mkfifo(fifo)
    kind, message, _, _ = refused("ckpt", [tmp_path / "node0", tmp_path / "node1"])
    assert kind == "InvalidCheckpointError" and "[rank 1]" in message and "is a FIFO" in message


def test_a_checkpoint_on_one_node_only(tmp_path, saved, reference):
    """Node 0 holds the save, node 1 nothing: node 1's ranks are sent their bytes."""
    shutil.copytree(saved.folder, tmp_path / "node0" / "ckpt")
    (tmp_path / "node1").mkdir()
    loaded("ckpt", reference, [tmp_path / "node0", tmp_path / "node1"])


def _load_while_rank0_changes(folder, changed):
    """Rank 0 rewrites ``changed`` in place (same size, later mtime) after every rank planned:
    the model is partly written when the change shows, as with safetensors."""
    load = importlib.import_module("zload.loading.load_into")
    real = load.execute

    def change_then_read(*args, **kwargs):
        data = Path(changed).read_bytes()
        mtime = os.stat(changed).st_mtime_ns
        Path(changed).write_bytes(data)
        os.utime(changed, ns=(mtime + 10**6, mtime + 10**6))
        return real(*args, **kwargs)

    if dist.get_rank() == 0:
        load.execute = change_then_read
    try:
        return _load_body(folder, untouched=False).error
    finally:
        load.execute = real


def test_a_pt_file_changed_between_indexing_and_reading(ckpt):
    """Read through the descriptor opened and checked at indexing; a change in place shows in
    its mtime: every rank raises, naming the file (rank 0 reads rank 0's partitions)."""
    changed = optim(ckpt, 0)
    errors = run_world(2, _load_while_rank0_changes, str(ckpt.folder), str(changed), timeout=TIMEOUT)
    assert errors[0] is not None and len(set(errors)) == 1, errors
    kind, message, _, _ = errors[0]
    assert kind == "CheckpointError" and f"{changed}: changed while it was being read" in message


# --------------------------------------------------------------------------------------------
# zload inspect


def test_inspect_lists_the_files_holding_each_tensor(saved, capsys):
    assert cli(["inspect", "--json", str(saved.folder)]) == 0
    summary = json.loads(capsys.readouterr().out)
    partitions = [str(optim(saved, rank)) for rank in range(2)]
    by_name = {t["name"]: t for t in summary["tensors"]}
    assert by_name["lm_head.weight"]["files"] == partitions  # tied to the embedding, stored once
    assert by_name["model.layers.0.mlp.up_proj.weight"]["files"] == [str(model_states(saved, r)) for r in range(2)]
    counts = {Path(f["path"]).name: f["tensors"] for f in summary["files"]}
    assert counts[optim(saved, 1).name] == counts[optim(saved, 0).name] > 0
    assert cli(["inspect", str(saved.folder)]) == 0
    out = capsys.readouterr().out
    assert f"{optim(saved, 0).name} and 1 more" in out and "valid: yes" in out


def test_inspect_refuses_a_hostile_checkpoint(ckpt, capsys):
    (ckpt.folder / "latest").write_text("../outside")
    assert cli(["inspect", str(ckpt.folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zload: error: {ckpt.folder / 'latest'}: names the tag '../outside'")


def _add_entry(path: Path, key: str, value: bytes) -> None:
    """Set ``key`` of the dict the file's pickle holds to the object the opcodes ``value`` build
    (written after that dict is built, as a hand-made pickle can), the archive written again by
    torch's own writer: every other record where torch would have put it."""
    with zipfile.ZipFile(path) as archive:
        records = {info.filename.split("/", 1)[1]: archive.read(info) for info in archive.infolist()}
    assert records["data.pkl"].endswith(pickle.STOP)
    records["data.pkl"] = records["data.pkl"][:-1] + _binunicode(key.encode()) + value + pickle.SETITEM + pickle.STOP
    writer = torch._C.PyTorchFileWriter(str(path))
    for name, data in records.items():
        if name not in ("version", ".data/serialization_id"):  # the writer adds them
            writer.write_record(name, data, len(data))
    writer.write_end_of_file()


def _status_bytes(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _load_measuring_peak_body(path) -> tuple[Outcome, int]:
    """``_load_body``, and how far this rank's peak resident memory rose above what it held
    before (the peak reset first)."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_bytes("VmRSS")
    outcome = _load_body(path)
    return outcome, _status_bytes("VmHWM") - before


def test_a_gigabyte_bytearray_under_a_key_zload_never_reads(ckpt):
    """``bytearray(1 << 30)`` is 20 bytes of pickle that torch's weights_only allows: refused
    before unpickling, on every rank, naming the file, and no rank's memory grows by it (the
    peak rose 1.2 GiB before; building the model and the load take about 0.2)."""
    path = model_states(ckpt, 1)
    _add_entry(path, "client_state", _BYTEARRAY)
    results = run_world(2, _load_measuring_peak_body, str(ckpt.folder), timeout=TIMEOUT)
    errors = [outcome.error for outcome, _ in results]
    assert None not in errors and len(set(errors)) == 1, errors
    kind, message, error_path, _ = errors[0]
    assert kind == "InvalidCheckpointError" and error_path == str(path), message
    assert (f"{path}: its pickle is refused before unpickling: it calls builtins.bytearray, which would allocate "
            "1,073,741,824 bytes") in message
    assert all(grown < 512 << 20 for _, grown in results), [grown for _, grown in results]


def test_a_value_nested_150000_deep(ckpt):
    """global_steps (which zload reads) nested 150,000 lists deep: refused before unpickling,
    naming the file, not a RecursionError."""
    path = model_states(ckpt, 1)
    _add_entry(path, "global_steps", pickle.EMPTY_LIST * 150_000 + pickle.BININT1 + b"\x07"
               + pickle.APPEND * 150_000)
    kind, message, error_path, _ = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and error_path == str(path)
    assert f"{path}: its pickle is refused before unpickling: it nests objects more than 100 deep" in message


# --------------------------------------------------------------------------------------------
# files of two runs, or of two steps


def test_a_rank_optimizer_file_of_another_run_at_another_step(ckpt, native_checkpoint, tmp_path):
    """Rank 1's optimizer states from another run (another seed), two steps in: the same sizes,
    other weights. Refused by load and convert, naming both files and both step counts."""
    other = native_checkpoint(world=2, stage=3, dtype="bf16", seed=1, steps=2)
    shutil.copy(optim(other, 1), optim(ckpt, 1))
    kind, message, path, _ = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and path == str(optim(ckpt, 1))
    assert (f"{optim(ckpt, 1)}: the base optimizer's step count is 2 here, but 1 in {optim(ckpt, 0).name}: the "
            "ranks' optimizer states are of different steps or saves; copy the save again") in message
    with pytest.raises(zload.InvalidCheckpointError, match="step count is 2 here"):
        zload.convert(ckpt.folder, tmp_path / "converted")
    assert not (tmp_path / "converted").exists()


def _copy_save(case, to: Path) -> NativeCheckpoint:
    folder = shutil.copytree(case.folder, to)
    return NativeCheckpoint(folder, folder / case.tag_folder.name)


def test_zero2_model_states_of_an_earlier_step(native_checkpoint, tmp_path):
    """ZeRO-2 writes one model-states file: from step 1 into a save of step 2, its global_steps
    allows fewer optimizer steps than the optimizer states record."""
    ckpt = _copy_save(native_checkpoint(world=2, stage=2, dtype="bf16", steps=2), tmp_path / "ckpt")
    earlier = native_checkpoint(world=2, stage=2, dtype="bf16")
    model = ckpt.tag_folder / "mp_rank_00_model_states.pt"
    shutil.copy(earlier.tag_folder / model.name, model)
    kind, message, path, _ = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and path == str(model)
    assert (f"{model}: global_steps is 1 and skipped_steps 0 here, so the optimizer stepped at most 1 times, but the "
            f"base optimizer in {optim(ckpt, 0).name} has taken 2 steps: model states of an earlier step") in message
    with pytest.raises(zload.InvalidCheckpointError, match="model states of an earlier step"):
        zload.convert(ckpt.folder, tmp_path / "converted")


GENUINE_STEPS = {
    # fp16 overflows: global_steps counts the skipped step, the optimizer's step count does not
    "z3-fp16-skipped": dict(world=2, stage=3, dtype="fp16", steps=2, overflow_steps=1),
    "z2-fp16-skipped": dict(world=2, stage=2, dtype="fp16", steps=2, overflow_steps=1),
    # saved before any step: the optimizer records no step count
    "z3-bf16-no-step": dict(world=2, stage=3, dtype="bf16", steps=0),
    "z2-bf16-no-step": dict(world=2, stage=2, dtype="bf16", steps=0),
    # resumed without the optimizer states: the optimizer counts 1 step, global_steps 3
    "z3-bf16-restarted": dict(world=2, stage=3, dtype="bf16", steps=3, restart_optimizer_after=2),
    "z2-bf16-restarted": dict(world=2, stage=2, dtype="bf16", steps=3, restart_optimizer_after=2),
}


@pytest.mark.parametrize("name", GENUINE_STEPS)
def test_genuine_saves_whose_step_counts_differ_load(native_checkpoint, name):
    """The control for the checks above (every other kind of save: tests/distributed/test_native_load.py):
    what DeepSpeed writes loads, bit for bit as its own reader rebuilds it."""
    from tests.support.native_checkpoints import deepspeed_reference

    case = native_checkpoint(**GENUINE_STEPS[name])
    loaded(case.folder, deepspeed_reference(case.folder))


# --------------------------------------------------------------------------------------------
# shapes the model states lie about: the error names the tensor at fault where the files tell


_LYING = "model.layers.0.self_attn.q_proj.weight"  # (24, 24), said to be (24, 25)


def _lie_about_a_shape(state):
    state["param_shapes"][0][_LYING] = torch.Size([24, 25])


@pytest.mark.parametrize("rank", [0, 1])
def test_a_shape_one_ranks_model_states_lie_about(ckpt, rank):
    """ZeRO-3 writes param_shapes into every rank's model states; the file whose shapes do not
    fit the fp32 flat groups is the one at fault, whichever rank's it is."""
    _resave(model_states(ckpt, rank), _lie_about_a_shape)
    kind, message, path, tensor = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and path == str(model_states(ckpt, rank)) and tensor == _LYING
    assert (f"{model_states(ckpt, rank)}: param_shapes[0]['{_LYING}'] is torch.Size([24, 25]) here, but "
            f"torch.Size([24, 24]) in {model_states(ckpt, 1 - rank).name}, whose shapes fit the sizes of the fp32 "
            "flat groups (these do not)") in message


def test_a_shape_every_ranks_model_states_lie_about(ckpt):
    """Every rank's param_shapes agree on the lie: ZeRO-3 records no size per trainable
    parameter, so the error names the group's parameters as candidates, not the last one."""
    for rank in (0, 1):
        _resave(model_states(ckpt, rank), _lie_about_a_shape)
    kind, message, path, tensor = refused(ckpt.folder)
    assert kind == "InvalidCheckpointError" and path == str(ckpt.tag_folder) and tensor is None
    assert ("the shapes param_shapes gives group 0's 17 trainable parameters ('model.embed_tokens.weight' to "
            "'model.norm.weight') take 3120 elements on each rank, but its fp32 flat group holds 3108") in message
    assert "the files do not record which" in message and "lie inside" not in message


@pytest.mark.parametrize("lie", ["param_shapes", "param_shapes and module"])
def test_a_shape_zero2_model_states_lie_about(native_checkpoint, tmp_path, lie):
    """ZeRO-2's model states hold the module's weights whole, and each rank's optimizer states
    the elements of each parameter in its partition (param_slice_mappings): either pins the
    tensor whose shape param_shapes lies about."""
    ckpt = _copy_save(native_checkpoint(world=2, stage=2, dtype="bf16"), tmp_path / "ckpt")

    def change(state):
        _lie_about_a_shape(state)
        if lie != "param_shapes":
            state["module"][_LYING] = torch.zeros(24, 25, dtype=torch.bfloat16)

    _resave(ckpt.tag_folder / "mp_rank_00_model_states.pt", change)
    kind, message, _, _ = refused(ckpt.folder)
    why = ("the module holds it as (24, 24) (mp_rank_00_model_states.pt)" if lie == "param_shapes" else
           "the optimizer states' param_slice_mappings place 576 of its elements in the ranks' fp32 partitions")
    assert kind == "InvalidCheckpointError" and f"'{_LYING}': param_shapes gives the shape (24, 25)" in message
    assert why in message and "'model.norm.weight'" not in message, message
