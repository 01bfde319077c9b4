"""The ``zload`` command line, run in-process through ``main`` (and once as ``python -m zload``).

Expected numbers are computed here from the tensors and files themselves, not from the index, so a
wrong total or share in the CLI cannot agree with itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import zload

from zload.cli import _parser, human_bytes, main

from tests.support import REPO, python
from tests.support.checkpoints import bin_weights_folder, save_sharded


def make_state() -> dict[str, torch.Tensor]:
    """Mixed dtypes and awkward sizes: 7 elements pad at world sizes 2 and 3, a scalar pads at
    every world size above 1, and 12 layers check that names sort naturally."""
    state = {f"layers.{i}.weight": torch.randn(5, 30) for i in range(12)}
    state["embed.weight"] = torch.randn(10, 4, dtype=torch.bfloat16)
    state["odd"] = torch.arange(7, dtype=torch.float16)
    state["step"] = torch.tensor(3, dtype=torch.int64)
    state["mask"] = torch.ones(2, 2, dtype=torch.bool)
    return state


def tensor_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@pytest.fixture
def state():
    return make_state()


@pytest.fixture
def single(tmp_path, state) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    return path


@pytest.fixture
def sharded(tmp_path, state) -> Path:
    return save_sharded(state, tmp_path / "sharded", shards=3)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv) -> dict:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0 and not err, err
    return json.loads(out)


def test_inspect_text_lists_files_dtypes_tensors_and_totals(capsys, sharded, state):
    code, out, err = run(capsys, "inspect", sharded)
    assert code == 0 and not err
    for shard in sorted(sharded.glob("*.safetensors")):
        assert shard.name in out
    for name in state:
        assert name in out
    for dtype in ("F32", "BF16", "F16", "I64", "BOOL"):
        assert dtype in out
    assert f"tensors: {len(state)}" in out
    assert f"({tensor_bytes(state):,} bytes)" in out
    assert "[10, 4]" in out
    assert out.index("layers.2.weight") < out.index("layers.10.weight")
    assert out.rstrip().endswith("valid: yes")


def test_inspect_json_numbers(capsys, sharded, state):
    summary = run_json(capsys, "inspect", sharded)
    assert summary["valid"] is True
    assert summary["tensor_count"] == len(state)
    assert summary["tensor_bytes"] == tensor_bytes(state)
    shards = sorted(sharded.glob("*.safetensors"))
    assert [Path(f["path"]).name for f in summary["files"]] == [s.name for s in shards]
    for f in summary["files"]:
        assert f["bytes"] == os.path.getsize(f["path"])
    assert summary["file_bytes"] == sum(os.path.getsize(s) for s in shards)
    assert sum(f["tensors"] for f in summary["files"]) == len(state)

    by_name = {t["name"]: t for t in summary["tensors"]}
    assert set(by_name) == set(state)
    for name, tensor in state.items():
        assert by_name[name]["shape"] == list(tensor.shape)
        assert by_name[name]["bytes"] == tensor.numel() * tensor.element_size()
    assert summary["dtypes"]["F32"] == {"tensors": 12, "bytes": 12 * 150 * 4}
    assert summary["dtypes"]["BF16"] == {"tensors": 1, "bytes": 80}


def test_inspect_limits_the_table_unless_asked(capsys, sharded, state):
    code, out, _ = run(capsys, "inspect", sharded, "--limit", 3)
    assert code == 0
    assert f"... {len(state) - 3} more" in out and "valid: yes" in out
    table = out[out.index("tensors (first 3"):]
    assert sum(name in table for name in state) == 3

    _, out, _ = run(capsys, "inspect", sharded, "--all")
    assert "more" not in out and all(name in out for name in state)

    _, out, _ = run(capsys, "inspect", sharded, "--no-tensors")
    assert "layers.0.weight" not in out and "valid: yes" in out

    assert "tensors" not in run_json(capsys, "inspect", sharded, "--no-tensors")
    # JSON is for machines: every tensor, whatever the text limit
    assert len(run_json(capsys, "inspect", sharded, "--limit", 2)["tensors"]) == len(state)


def test_no_tensors_leaves_out_the_more_line(capsys, sharded):
    code, out, _ = run(capsys, "inspect", sharded, "--no-tensors")
    assert code == 0 and "more" not in out and "--all" not in out


def test_counts_of_one_are_singular(tmp_path, capsys):
    report = zload.save(torch.nn.Linear(2, 1, bias=False), tmp_path / "one")
    assert f"saved {tmp_path / 'one'} (1 file, " in str(report)
    assert run(capsys, "validate", tmp_path / "one")[1].endswith(" in 1 file)\n")


def test_the_readme_synopsis_lists_every_option():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("**Command line**"):readme.index("**Progress and logging.**")]
    synopsis = section.split("```")[1]
    for option in ("--json", "--limit N", "--all", "--no-tensors", "--world-size N", "-n N", "--full"):
        assert option in synopsis, option


def test_the_demo_says_why_the_ranks_read_more_than_the_checkpoint():
    """At world size 3 the demo's ranks read its 1,016-byte buffer three times over."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo", REPO / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    assert demo.read_in_all(28_040_000, 28_040_000) == "28.04 MB read in all of a 28.04 MB checkpoint"
    assert demo.read_in_all(28_042_032, 28_040_000) == (
        "28.04 MB read in all of a 28.04 MB checkpoint (2,032 bytes more: each rank reads its partition of "
        "every parameter, but every buffer whole)")


def test_inspect_single_file(capsys, single, state):
    summary = run_json(capsys, "inspect", single)
    assert len(summary["files"]) == 1
    assert summary["files"][0]["bytes"] == os.path.getsize(single)
    assert summary["tensor_bytes"] == tensor_bytes(state)


def expected_rank_bytes(state, world: int, rank: int) -> int:
    """ZeRO-3 share from first principles: ceil(numel / world) elements per rank, clipped."""
    total = 0
    for t in state.values():
        size = math.ceil(t.numel() / world)
        valid = max(0, min(size, t.numel() - rank * size))
        total += valid * t.element_size()
    return total


@pytest.mark.parametrize("world", [1, 2, 3])
def test_plan_json_per_rank_bytes(capsys, sharded, state, world):
    plan = run_json(capsys, "plan", sharded, "--world-size", world)
    ranks = plan["rank_bytes"]
    assert len(ranks) == world
    assert sum(ranks) == plan["tensor_bytes"] == tensor_bytes(state)
    assert ranks == [expected_rank_bytes(state, world, r) for r in range(world)]
    assert plan["max_min_ratio"] == pytest.approx(max(ranks) / min(ranks))
    padding = sum(math.ceil(t.numel() / world) * world - t.numel() for t in state.values())
    assert plan["padding_elements"] == padding
    def share(name):  # rank 0 holds the biggest share of every tensor
        return math.ceil(state[name].numel() / world) * state[name].element_size()

    assert plan["largest_partition"]["bytes"] == share(plan["largest_partition"]["name"])
    assert plan["largest_partition"]["bytes"] == max(map(share, state))


def test_plan_text_and_a_rank_that_reads_nothing(capsys, tmp_path):
    path = tmp_path / "tiny.safetensors"
    save_file({"w": torch.ones(3)}, str(path))
    code, out, err = run(capsys, "plan", path, "-n", 4)
    assert code == 0 and not err
    assert "rank 3" in out and "unbounded" in out and "largest partition: w" in out
    assert "padding: 1 element\n" in out
    assert run_json(capsys, "plan", path, "-n", 4)["max_min_ratio"] is None


def test_validate(capsys, sharded, tmp_path):
    code, out, err = run(capsys, "validate", sharded)
    assert code == 0 and out.startswith("valid:") and not err
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage")
    code, out, err = run(capsys, "validate", bad)
    assert code == 1 and not out and err.count("\n") == 1 and "bad.safetensors" in err


def corrupt_shard(sharded: Path) -> Path:
    """Truncate one shard: its header now promises bytes the file lacks."""
    shard = sorted(sharded.glob("*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 4)
    return shard


@pytest.mark.parametrize("command", [["inspect"], ["inspect", "--json"], ["plan", "-n", "2"]])
def test_corrupt_file_is_a_clear_error(capsys, sharded, command):
    shard = corrupt_shard(sharded)
    code, out, err = run(capsys, *command, sharded)
    assert code == 2 and not out
    assert err.startswith("zload: error:") and shard.name in err and "truncated" in err
    assert "Traceback" not in err


def test_missing_path_and_usage_errors(capsys, tmp_path, sharded):
    code, _, err = run(capsys, "inspect", tmp_path / "nope")
    assert code == 2 and "zload: error:" in err and "nope" in err
    assert run(capsys, "plan", sharded)[0] == 2  # --world-size is required
    assert run(capsys, "plan", sharded, "-n", 0)[0] == 2
    assert run(capsys, "frobnicate")[0] == 2
    assert run(capsys)[0] == 2
    assert run(capsys, "--version")[0] == 0


def test_python_dash_m_exit_codes(sharded, tmp_path):
    def zload(*argv):
        return subprocess.run([sys.executable, "-m", "zload", *map(str, argv)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    ok = zload("inspect", sharded)
    assert ok.returncode == 0 and "valid: yes" in ok.stdout, ok.stderr
    missing = zload("inspect", tmp_path / "nope")
    assert missing.returncode == 2 and missing.stderr.startswith("zload: error:")
    assert "Traceback" not in missing.stderr
    corrupt_shard(sharded)
    assert zload("validate", sharded).returncode == 1


def test_validate_full_checks_the_digests_zload_save_recorded(tmp_path, capsys):
    from zload.cli import main

    model = torch.nn.Linear(300, 200)
    zload.save(model, tmp_path / "ckpt", max_shard_size=100_000)
    save_file({"x": torch.ones(3)}, str(tmp_path / "plain.safetensors"))
    assert main(["validate", "--full", str(tmp_path / "ckpt")]) == 0
    assert "data: 2 files matched the digest zload.save recorded" in capsys.readouterr().out
    assert main(["validate", "--full", str(tmp_path / "plain.safetensors")]) == 0
    assert "1 file recorded none (not checked)" in capsys.readouterr().out
    shard = sorted((tmp_path / "ckpt").glob("model-*.safetensors"))[1]
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0x10
    shard.write_bytes(raw)
    assert main(["validate", str(tmp_path / "ckpt")]) == 0  # the headers alone are fine
    capsys.readouterr()
    assert main(["validate", "--full", str(tmp_path / "ckpt")]) == 1
    assert f"{shard}: its data do not match the digest recorded" in capsys.readouterr().err


def test_human_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(999) == "999 B"
    assert human_bytes(1234) == "1.23 KB"
    assert human_bytes(4_560_000_000) == "4.56 GB"
    assert human_bytes(2 * 10**12) == "2.00 TB"


# --- a newcomer's first commands: answered at once, every argument explained, .bin weights named

HEAVY = ("torch", "numpy", "safetensors", "huggingface_hub", "deepspeed", "transformers")
TIMED = """
import sys, time, contextlib, io
start = time.perf_counter()
from zload.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    status = main(sys.argv[1:])
elapsed = time.perf_counter() - start
print(status, round(elapsed, 3), sorted(m for m in {heavy} if m in sys.modules), out.getvalue().splitlines()[0])
""".replace("{heavy}", repr(HEAVY))


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["inspect", "--help"], ["plan", "--help"],
                                  ["validate", "--help"], ["convert", "--help"]])
def test_version_and_help_import_no_torch(args):
    done = python(["-c", TIMED, *args])
    status, elapsed, heavy, first = done.stdout.split(" ", 3)
    assert (status, heavy) == ("0", "[]"), done.stdout + done.stderr
    assert float(elapsed) < 0.5, f"{args}: {elapsed} s"
    assert first.startswith("zload 0.1.0" if args == ["--version"] else "usage: zload")


def test_the_module_and_console_entry_points_import_no_torch():
    code = "import sys, zload, zload.cli, zload.__main__; print(sorted(m for m in {} if m in sys.modules))"
    assert python(["-c", code.format(repr(HEAVY))]).stdout.strip() == "[]"
    done = python(["-X", "importtime", "-m", "zload", "--version"])
    assert done.stdout.strip() == f"zload {zload.__version__}"
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()}
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def _actions(parser: argparse.ArgumentParser, prefix: str = "zload"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {choice.dest for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", name in helped
                yield from _actions(sub, f"{prefix} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield f"{prefix} {'/'.join(action.option_strings) or action.dest}", bool(action.help)


def test_every_command_and_argument_has_a_help_text():
    actions = dict(_actions(_parser()))
    assert {"zload inspect", "zload plan PATH", "zload convert --single-process"} - set(actions) == {"zload plan PATH"}
    assert len(actions) > 20
    assert [name for name, helped in actions.items() if not helped] == []


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_a_folder_of_bin_weights_says_to_convert_them(tmp_path, kind, capsys):
    folder = bin_weights_folder(tmp_path / kind, kind)
    with pytest.raises(zload.CheckpointNotFoundError) as info:
        zload.open_checkpoint(folder)
    message = str(info.value)
    assert "found no safetensors files and no DeepSpeed checkpoint; it holds PyTorch .bin weights (" in message
    assert "training_args.bin" not in message
    assert "zload reads safetensors only: convert them once with transformers" in message
    assert "save_pretrained(OUT, safe_serialization=True)" in message
    assert main(["inspect", str(folder)]) == 2
    assert "PyTorch .bin weights" in capsys.readouterr().err


def test_a_bin_file_or_index_says_to_convert_it(tmp_path):
    folder = bin_weights_folder(tmp_path / "sharded", "sharded")
    for path in (folder / "pytorch_model-00001-of-00002.bin", folder / "pytorch_model.bin.index.json"):
        with pytest.raises(zload.InvalidCheckpointError, match=r"not a safetensors file or index; it holds PyTorch "
                           r"\.bin weights \(pytorch_model"):
            zload.open_checkpoint(path)
