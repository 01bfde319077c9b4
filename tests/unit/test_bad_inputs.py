"""Bad inputs seen in one process: where a load's warnings point, and how arguments that differ
between ranks are named. Bad checkpoints on every rank: tests/distributed/test_bad_inputs.py."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

import zload


def test_load_warnings_point_at_the_callers_line(tmp_path):
    import warnings

    save_file({"weight": torch.ones(2, 3), "bias": torch.zeros(2), "extra": torch.ones(1)},
              str(tmp_path / "model.safetensors"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zload.load_into(torch.nn.Linear(3, 2), tmp_path)
    (warning,) = [w for w in caught if issubclass(w.category, zload.ZloadWarning)]
    assert "extra" in str(warning.message) and warning.filename == __file__


def test_arguments_that_differ_are_named_with_what_each_rank_passed():
    from zload.distributed import Arguments

    mine = Arguments("load_into", {"verify": "sample", "staging_bytes": 256, "key_map": None})
    gathered = [mine.values, dict(mine.values, verify="full"), dict(mine.values, verify="full", staging_bytes=512)]
    error = mine.differing(gathered, "zload: cannot load x")
    assert isinstance(error, zload.ArgumentValueError) and error.ranks == (0, 1, 2)
    assert str(error) == ("zload: cannot load x: the ranks passed load_into different arguments (verify: 'sample' "
                          "on rank 0, 'full' on ranks 1, 2; staging_bytes: 256 on ranks 0, 1, 512 on rank 2); every "
                          "rank must call load_into with the same arguments and the same model")
    many = [dict(mine.values, staging_bytes=n) for n in range(10)]
    assert "staging_bytes: 0 on rank 0, 1 on rank 1, 2 on rank 2, 3 on rank 3, ... (6 more))" in \
        str(mine.differing(many, "x"))
