"""What a load or save did on this rank (``LoadReport``, ``SaveReport``), and the text helpers that
keep every message short whatever the input holds."""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from dataclasses import dataclass, field

_NESTED = reprlib.Repr()  # keyword arguments only from Python 3.12
_NESTED.maxlevel, _NESTED.maxstring, _NESTED.maxother, _NESTED.maxlong = 3, 60, 60, 60
_NESTED.maxtuple = _NESTED.maxlist = _NESTED.maxdict = _NESTED.maxset = _NESTED.maxfrozenset = 8


def brief(value, limit: int = 200) -> str:
    """``repr(value)``, cut short: a hostile header must not make a 100 MB error message that
    every rank then exchanges, nor a nest of shared lists one that takes 2**depth steps to print
    (containers are printed a few items and levels deep)."""
    text = repr(value) if isinstance(value, (str, bytes, int, float, type(None))) else _NESTED.repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"


def plural(n: int, word: str) -> str:
    """``plural(1, "file")`` -> ``"1 file"``, ``plural(1200, "file")`` -> ``"1,200 files"``."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def ranks_named(ranks) -> str:
    """``[1]`` -> ``"rank 1"``, ``[0, 2]`` -> ``"ranks 0, 2"`` (the first few of many)."""
    return f"rank{'s' if len(ranks) > 1 else ''} {shortened(ranks)}"


def ranks_listed(ranks) -> str:
    """``[0, 2]`` -> ``"[0, 2]"``; of many ranks the first few, and how many more."""
    return f"[{shortened(ranks)}]"


def shortened(names: Sequence, limit: int = 8, sep: str = ", ", total: int | None = None) -> str:
    """The first ``limit`` names, and how many more there are: of ``total`` where ``names`` holds
    only the first. Only those shown are read: ``names`` may be a ``range`` a hostile count made."""
    total = len(names) if total is None else total
    shown = sep.join(map(str, names[:limit]))
    return shown + (f"{sep}... ({total - limit} more)" if total > limit else "")


@dataclass(kw_only=True)  # fifteen fields: built by name, never by position
class LoadReport:
    """The outcome of ``load_into`` on one rank.

    ``loaded`` holds model names (the first name of tied weights); ``missing`` model tensors the
    checkpoint lacks; ``unexpected`` checkpoint tensors the model lacks; ``conversions`` maps
    "FILE_DTYPE->model_dtype" to the names converted; ``slow_path`` names tensors built by a
    checkpoint conversion on one rank and sent to the others; ``bytes_read`` counts file bytes this
    rank read, which for ZeRO-3 parameters is only its own partitions (plus, for node-local
    checkpoints, the ranges it read for ranks that lack a file: ``bytes_sent`` to them, and
    ``bytes_received`` from others for the files it lacks). ``newly_initialized``: the parameters
    ``from_pretrained`` initialised because the checkpoint lacks them (they are also ``missing``).
    """

    source: str
    rank: int
    world_size: int
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    conversions: dict[str, list[str]] = field(default_factory=dict)
    repaired_orphans: list[str] = field(default_factory=list)
    slow_path: list[str] = field(default_factory=list)
    newly_initialized: list[str] = field(default_factory=list)
    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    checkpoint_bytes: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        rate = self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0
        share = self.bytes_read / self.checkpoint_bytes if self.checkpoint_bytes else 0.0
        lines = [
            f"loaded {plural(len(self.loaded), 'tensor')} from {self.source} on rank {self.rank}/"
            f"{self.world_size} in {self.seconds:.3f} s",
            f"  read {self.bytes_read / 1e6:.2f} MB ({share:.1%} of {self.checkpoint_bytes / 1e6:.2f} MB"
            f" checkpoint) at {rate:.2f} GB/s",
        ]
        if self.bytes_sent or self.bytes_received:
            lines.append(f"  node-local files: sent {self.bytes_sent / 1e6:.2f} MB, received "
                         f"{self.bytes_received / 1e6:.2f} MB")
        for label, names in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("repaired orphans", self.repaired_orphans),
                             ("converted on one rank (slow path)", self.slow_path),
                             ("newly initialized", self.newly_initialized)):
            if names:
                lines.append(f"  {label} ({len(names)}): {shortened(names)}")
        for pair, names in self.conversions.items():
            lines.append(f"  converted {pair}: {plural(len(names), 'tensor')}")
        return "\n".join(lines)


@dataclass(kw_only=True)
class SaveReport:
    """The outcome of ``save`` on one rank."""

    path: str
    files: list[str]
    total_bytes: int  # size of all files written
    bytes_written: int  # by this rank (or sent to rank 0 when ranks share no filesystem)
    gathered: list[str]  # parameters gathered because their transformers conversion is no layout
    seconds: float

    def __str__(self) -> str:
        return (f"saved {self.path} ({plural(len(self.files), 'file')}, {self.total_bytes / 1e6:.2f} MB); "
                f"this rank wrote {self.bytes_written / 1e6:.2f} MB in {self.seconds:.3f} s")
