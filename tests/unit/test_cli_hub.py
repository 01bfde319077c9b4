"""``zload inspect``, ``plan`` and ``validate`` of a Hub repo id read only its safetensors headers,
by HTTP range requests, and validate them as strictly as a local file's; a repo of PyTorch ``.bin``
weights says what to do.

The Hub is a local HTTP server speaking the part of its protocol huggingface_hub uses (model info,
HEAD and ranged GET of ``resolve`` URLs), pointed at by ``HF_ENDPOINT`` in a ``zload`` process:
every byte served is recorded, and nothing leaves the machine. Repo ids read from the cache:
tests/unit/test_hub.py.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import subprocess
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support import python
from tests.support.checkpoints import save_sharded

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
STATE = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.bias": torch.ones(4, dtype=torch.bfloat16),
         "c.weight": torch.zeros(3, 5)}


class FakeHub:
    """Repos by id, each a dict of file name -> bytes at ``COMMIT``, served as the Hub serves
    them; ``served`` records (file, Range header, bytes sent) of each GET of a file."""

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.served: list[tuple[str, str | None, int]] = []
        self.ranges = True  # False: answer a ranged GET with the whole file, as some servers do
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._answer(body=True)

            def do_HEAD(self):
                self._answer(body=False)

            def _send(self, status: int, data: bytes, headers: dict, body: bool):
                self.send_response(status)
                for key, value in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(key, value)
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _answer(self, body: bool):
                path = self.path.split("?")[0]
                info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/[^/]+(/.*)?)?", path)
                if info and info[1] in hub.repos:
                    files = hub.repos[info[1]]
                    if info[2] != "tree":
                        listing = {"id": info[1], "sha": COMMIT,
                                   "siblings": [{"rfilename": n, "size": len(d)} for n, d in files.items()]}
                    else:
                        listing = [{"type": "file", "path": n, "size": len(d),
                                    "oid": hashlib.sha1(d).hexdigest()} for n, d in files.items()]
                    return self._send(200, json.dumps(listing).encode(), {"Content-Type": "application/json"}, body)
                file = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
                if info or not file or file[1] not in hub.repos:
                    return self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"}, body)
                if file[2] not in hub.repos[file[1]]:
                    return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
                data = hub.repos[file[1]][file[2]]
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                           "Accept-Ranges": "bytes"}
                asked = self.headers.get("Range")
                status = 200
                if asked and hub.ranges:
                    first, last = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", asked).groups())
                    headers["Content-Range"] = f"bytes {first}-{min(last, len(data) - 1)}/{len(data)}"
                    data, status = data[first:last + 1], 206
                if body:
                    hub.served.append((file[2], asked, len(data)))
                self._send(status, data, headers, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo: str, folder: Path) -> None:
        self.repos[repo] = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}

    def weight_bytes_served(self, repo: str) -> dict[str, int]:
        """Bytes of each safetensors file served, against the size of its length and header."""
        return {name: sum(n for f, _, n in self.served if f == name)
                for name in self.repos[repo] if name.endswith(".safetensors")}


@contextmanager
def fake_hub():
    hub = FakeHub()
    thread = threading.Thread(target=hub.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.server.shutdown()
        hub.server.server_close()


def _header_size(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def _zload(hub: FakeHub, cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": "", "NO_PROXY": "127.0.0.1"}
    return python(["-m", "zload", *args], env=env)


@pytest.fixture
def hub(tmp_path):
    with fake_hub() as hub:
        folder = save_sharded(STATE, tmp_path / "sharded", shards=2)
        (folder / "config.json").write_text(json.dumps({"model_type": "tiny"}))
        torch.save(STATE, folder / "pytorch_model.bin")  # the same weights again, never to be fetched
        hub.add("org/sharded", folder)
        (tmp_path / "single").mkdir()
        save_file(STATE, str(tmp_path / "single" / "model.safetensors"))
        hub.add("org/single", tmp_path / "single")
        yield hub


@pytest.mark.parametrize("repo", ["org/sharded", "org/single"])
def test_inspect_and_plan_of_a_repo_id_read_only_the_headers(hub, tmp_path, repo):
    done = _zload(hub, tmp_path / "cache", "inspect", repo, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["source"] == f"{repo} (revision main, commit {COMMIT})"
    assert {t["name"]: (t["dtype"], t["shape"]) for t in summary["tensors"]} == {
        "a.weight": ("F32", [2, 3]), "b.bias": ("BF16", [4]), "c.weight": ("F32", [3, 5])}
    files = hub.repos[repo]
    assert {f["path"]: f["bytes"] for f in summary["files"]} == {
        f"{hub.endpoint}/{repo}/resolve/{COMMIT}/{name}": len(data)
        for name, data in files.items() if name.endswith(".safetensors")}
    assert summary["tensor_bytes"] == sum(t.numel() * t.element_size() for t in STATE.values())

    done = _zload(hub, tmp_path / "cache", "plan", repo, "-n", "2", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sum(json.loads(done.stdout)["rank_bytes"]) == summary["tensor_bytes"]
    assert _zload(hub, tmp_path / "cache", "validate", repo).returncode == 0

    # each weight file served its length and header and no more, by range requests only; the
    # index and config whole (once: then cached); the .bin copy never
    headers = {name: _header_size(data) for name, data in files.items() if name.endswith(".safetensors")}
    assert hub.weight_bytes_served(repo) == {name: 3 * size for name, size in headers.items()}
    assert all(asked and asked.startswith("bytes=") for name, asked, _ in hub.served if name in headers)
    whole = sorted(name for name, asked, _ in hub.served if asked is None)
    assert whole == sorted({"model.safetensors.index.json", "config.json"} & set(files))
    assert "pytorch_model.bin" not in {name for name, _, _ in hub.served}


def _bad_header(folder: Path, header: bytes, data: bytes) -> None:
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("header, data, why", [
    # huggingface_hub's own parser takes the last of two keys and never checks the file's size
    (b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[2],'
     b'"data_offsets":[0,8]}}', b"\0" * 8, "duplicate key 'w'"),
    (b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 9, "5 bytes after the last tensor"),
    (b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', b"\0" * 8, "ends at byte"),
])
def test_a_repo_header_is_validated_as_strictly_as_a_local_file(hub, tmp_path, header, data, why):
    _bad_header(tmp_path / "bad", header, data)
    hub.add("org/bad", tmp_path / "bad")
    done = _zload(hub, tmp_path / "cache", "validate", "org/bad")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"zload: invalid: {hub.endpoint}/org/bad/resolve/{COMMIT}/model.safetensors: " in done.stderr
    assert why in done.stderr
    assert hub.weight_bytes_served("org/bad") == {"model.safetensors": _header_size(
        (tmp_path / "bad" / "model.safetensors").read_bytes())}


def test_a_hostile_header_length_is_refused_before_it_is_asked_for(hub, tmp_path):
    (tmp_path / "huge").mkdir()
    (tmp_path / "huge" / "model.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}")
    hub.add("org/huge", tmp_path / "huge")
    done = _zload(hub, tmp_path / "cache", "inspect", "org/huge")
    assert done.returncode == 2 and "header length 4611686018427387904 exceeds" in done.stderr
    assert hub.served == [("model.safetensors", "bytes=0-7", 8)]


def test_a_server_that_ignores_ranges_is_refused(hub, tmp_path):
    hub.ranges = False
    done = _zload(hub, tmp_path / "cache", "inspect", "org/single")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (f"{hub.endpoint}/org/single/resolve/{COMMIT}/model.safetensors: asked for bytes 0 to 7, the server "
            "answered 200, not 206 (partial content); it must serve HTTP range requests") in done.stderr


def test_a_repo_of_bin_weights_says_to_convert_them(hub, tmp_path):
    (tmp_path / "bin").mkdir()
    torch.save(STATE, tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text("{}")
    hub.add("org/bin", tmp_path / "bin")
    done = _zload(hub, tmp_path / "cache", "inspect", "org/bin")
    assert done.returncode == 2, done.stderr
    assert "holds neither model.safetensors.index.json nor model.safetensors" in done.stderr
    assert "PyTorch .bin weights (pytorch_model.bin)" in done.stderr and ".save_pretrained(OUT)" in done.stderr
    assert "pytorch_model.bin" not in {name for name, _, _ in hub.served}
    # and a repo that does not exist is named as such
    done = _zload(hub, tmp_path / "cache", "plan", "org/missing", "-n", "2")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "cannot load 'org/missing'" in done.stderr and "no such repo on the Hub" in done.stderr
