"""Checkpoints named by Hugging Face Hub repo id: resolved to a local snapshot folder.

huggingface_hub does the work (cache layout, ``HF_HUB_OFFLINE``, tokens, revisions); it is imported
only when a repo id is actually given, so that zload works without it. Only what zload reads is
fetched: safetensors files, their index and the configs, never ``*.bin`` or ``*.pt`` copies of the
same weights. One process per node downloads (local rank 0) while the others wait, so that N ranks
do not fetch the same gigabytes N times, and a failure on any rank is raised on every rank.

Commands that read no tensor data (``zload inspect``, ``plan``, ``validate``) download no weights:
``RemoteRepo`` reads each safetensors header by two HTTP range requests, as huggingface_hub's
``get_safetensors_metadata`` does. That function is not called: it returns headers it parsed
itself (loosely: a duplicate key or ``NaN`` passes, the file's size is never checked), and zload
must validate the very bytes, with its own parser, against the file's size.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from ..distributed import Problem, agree, rank_and_world, speaks_for_all
from ..errors import CheckpointError, CheckpointNotFoundError
from .files import OpenFile, absolute_path, header_only
from .index import MAX_INDEX_BYTES, header_length, pytorch_weights_hint

logger = logging.getLogger("zload")

SMALL_FILES = ["*.safetensors.index.json", "config.json", "adapter_config.json"]  # besides the weights
ALLOW_PATTERNS = ["*.safetensors", *SMALL_FILES]


def download(path: str, revision: str | None, also: tuple[str, ...] = ()) -> str:
    """The local snapshot folder of Hub repo ``path`` at ``revision``, downloaded if needed, with
    the files matching the patterns ``also`` besides the checkpoint's (a model's generation config).

    ``path`` names nothing local. When it could not be a repo id (an absolute path, ``./x``,
    ``a/b/c``, a trailing slash, a ``.safetensors`` or ``.json`` name), this is said without asking
    the Hub; when the Hub cannot find it either, the error gives both readings.
    Every rank of a job must call it (two small collectives). Any failure is a ``CheckpointError``
    naming the repo, the revision and what to do next, raised on every rank.
    """
    _check_repo_id(path)
    from huggingface_hub import snapshot_download

    problems: list[Problem] = []

    def fetch(local_files_only: bool) -> str | None:
        try:
            return snapshot_download(path, revision=revision, allow_patterns=ALLOW_PATTERNS + list(also),
                                     local_files_only=local_files_only)
        except Exception as e:  # every failure becomes one agreed CheckpointError
            problems.append(Problem.of(_failure(e, path, revision, local_files_only)))
            return None

    _, world = rank_and_world()
    first = world == 1 or int(os.environ.get("LOCAL_RANK", "0")) == 0
    what = f"cannot load '{path}'"
    local = fetch(False) if first else None
    agree(problems, what)  # the others wait here until their node's local rank 0 has downloaded
    if not first:
        local = fetch(True)  # already downloaded: read the same snapshot from the shared cache
    if local is not None:
        problems += _pytorch_weights_only(path, revision, local)
    agree(problems, what)
    if speaks_for_all():
        logger.info("Hub repo %s (revision %s) resolved to %s", path, revision or "main", local)
    return local


def _pytorch_weights_only(repo: str, revision: str | None, local: str) -> list[Problem]:
    """When the snapshot ``local`` holds no safetensors because the repo has PyTorch ``.bin``
    weights only (which are not fetched), the problem that says so and what to do: the repo's
    files are listed from huggingface_hub's cache of its tree, which the download filled."""
    try:
        if any(name.endswith(".safetensors") for name in os.listdir(local)):
            return []
        from huggingface_hub import get_cached_repo_tree

        names = [f.path for f in get_cached_repo_tree(repo, revision=revision)]
    except Exception:  # an older huggingface_hub, or no listing cached: the load's own error stands
        return []
    hint = pytorch_weights_hint(names, repr(repo))
    return [Problem.of(CheckpointNotFoundError(f"Hub repo '{repo}' (revision {revision or 'main'}) has no "
                                               f"safetensors weights{hint}", path=repo))] if hint else []


def _check_repo_id(path: str) -> None:
    """Raise unless huggingface_hub is installed and would take ``path`` (which names nothing
    local) for a repo id."""
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise CheckpointNotFoundError(f"{_no_local(path)}; to load it as a Hub repo id, install "
                                      f"huggingface_hub", path=path) from None
    if not _could_be_repo_id(path):
        raise CheckpointNotFoundError(f"{_no_local(path)}: check the path", path=path)


@dataclass(frozen=True)
class RemoteRepo:
    """Hub repo ``repo`` at commit ``commit``, read over HTTP without downloading its weights:
    ``sizes`` gives each of its files' size; ``header`` opens a safetensors file as far as its
    header; ``download`` fetches a small file (an index, a config) into the Hugging Face cache."""

    repo: str
    revision: str | None  # as the user named it
    commit: str
    sizes: dict[str, int]

    def url(self, name: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo, name, revision=self.commit)

    def download(self, name: str) -> str:
        """The local copy of the small file ``name`` (in the Hugging Face cache)."""
        from huggingface_hub import hf_hub_download

        if self.sizes[name] > MAX_INDEX_BYTES:
            raise CheckpointError(f"{self.url(name)}: {self.sizes[name]} bytes, over the {MAX_INDEX_BYTES}-byte "
                                  "limit zload sets for a JSON file", path=self.url(name))
        return self._asking(lambda: hf_hub_download(self.repo, name, revision=self.commit))

    def header(self, name: str) -> OpenFile:
        """File ``name`` opened as far as its header (``files.header_only``), fetched by two range
        requests: its first 8 bytes (the header's length, checked against the file's size before
        more is asked), then the header; never a byte of tensor data."""
        url, size = self.url(name), self.sizes.get(name)
        if size is None:
            raise CheckpointNotFoundError(f"{url}: no such file in {self.repo} at {self.commit}", path=url)
        prefix = self._range(url, 0, min(8, size))
        length = header_length(url, size, prefix)
        return header_only(url, prefix + self._range(url, 8, length), size)

    def _range(self, url: str, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)`` of the file at ``url``, asked for as huggingface_hub
        asks for a header (its session, headers, token and timeout). The answer is streamed and
        read no further than asked: a server that ignores the range never sends the weights."""
        if not length:
            return b""
        from huggingface_hub import constants
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        def get() -> tuple[int, bytes]:
            asked = {**build_hf_headers(), "range": f"bytes={start}-{start + length - 1}"}
            data = bytearray()
            with get_session().stream("GET", url, headers=asked,
                                      timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
                hf_raise_for_status(response)
                for chunk in response.iter_bytes() if response.status_code == 206 else ():
                    data += chunk
                    if len(data) > length:
                        break
            return response.status_code, bytes(data)

        status, data = self._asking(get)
        if status != 206 or len(data) != length:
            answer = (f"answered {status}, not 206 (partial content)" if status != 206 else
                      f"sent {'more than ' if len(data) > length else ''}{len(data)} bytes")
            raise CheckpointError(f"{url}: asked for bytes {start} to {start + length - 1}, the server {answer}; "
                                  "it must serve HTTP range requests", path=url)
        return data

    def _asking(self, call):
        """``call()``, any failure of huggingface_hub's a ``CheckpointError`` saying what to do."""
        try:
            return call()
        except Exception as e:
            raise _failure(e, self.repo, self.revision, False, f"cannot load '{self.repo}': ") from e


def remote_repo(path: str, revision: str | None) -> RemoteRepo | None:
    """Hub repo ``path`` at ``revision``, to be read over HTTP (one API call lists its files);
    None when huggingface_hub is offline (``HF_HUB_OFFLINE``): then only the cache can serve it
    (``download``). One process."""
    _check_repo_id(path)
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        info = HfApi().model_info(path, revision=revision, files_metadata=True)
    except Exception as e:
        raise _failure(e, path, revision, False, f"cannot load '{path}': ") from e
    return RemoteRepo(path, revision, info.sha, {s.rfilename: s.size for s in info.siblings or ()})


def _failure(e: Exception, repo: str, revision: str | None, local_files_only: bool,
             heading: str = "") -> CheckpointError:
    """``e``, raised by huggingface_hub, as the ``CheckpointError`` that says what to do."""
    kind = CheckpointNotFoundError if _not_found(e, local_files_only) else CheckpointError
    return kind(heading + _explain(e, repo, revision, local_files_only), path=repo)


def _could_be_repo_id(path: str) -> bool:
    """Whether huggingface_hub would take ``path`` for a repo id; a ``.safetensors`` or ``.json``
    name is taken for a file, so that a mistyped file name never asks the Hub."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(path)
    except ValueError:
        return False
    return not path.endswith((".safetensors", ".json"))


def _no_local(path: str) -> str:
    return f"no such local file or folder: {absolute_path(path)}"


def _explain(e: Exception, repo: str, revision: str | None, local_files_only: bool) -> str:
    """What went wrong with ``repo`` at ``revision`` and what to do about it (``agree`` heads it with
    the path). Where neither a local path nor the Hub has it, both readings, since either may have
    been meant."""
    from huggingface_hub import constants
    from huggingface_hub import utils as hf

    try:
        from huggingface_hub.errors import IncompleteSnapshotError
    except ImportError:  # older huggingface_hub
        IncompleteSnapshotError = ()
    rev = revision or "main"
    download = f"`hf download {repo}" + (f" --revision {revision}`" if revision else "`")
    both = f"{_no_local(repo)}; as a Hub repo id (revision {rev}): "
    if isinstance(e, IncompleteSnapshotError):
        return f"the cached snapshot is incomplete: complete it with {download} online"
    if isinstance(e, (hf.LocalEntryNotFoundError, hf.OfflineModeIsEnabled)):
        if local_files_only:
            return (f"local rank 0 downloaded it, but this process does not find it in "
                    f"its cache {constants.HF_HUB_CACHE}: all processes of a node must share "
                    f"HF_HUB_CACHE (or HF_HOME)")
        offline = constants.HF_HUB_OFFLINE
        return (f"{both}not in the local cache {constants.HF_HUB_CACHE} and the Hub could not be reached "
                f"({'HF_HUB_OFFLINE=1 is set' if offline else e}). If it is a local checkpoint, check the "
                f"path; if it is a repo id, download it first with {download}"
                + (", or unset HF_HUB_OFFLINE" if offline else ", or check the network"))
    if isinstance(e, hf.GatedRepoError):
        return ("the Hub repo is gated: accept its terms on the Hub, then log in with "
                "`hf auth login` or set HF_TOKEN")
    if isinstance(e, hf.RepositoryNotFoundError):
        return (f"{both}no such repo on the Hub (or it is private: log in with `hf auth login` or set "
                f"HF_TOKEN). If it is a local checkpoint, check the path")
    if isinstance(e, hf.RevisionNotFoundError):
        return f"the repo has no revision {rev!r}: pass an existing branch, tag or commit"
    if isinstance(e, hf.HfHubHTTPError):
        return f"the Hub refused the download ({e}); retry, or check access to the repo"
    return f"{type(e).__name__}: {e}"


def _not_found(e: Exception, local_files_only: bool) -> bool:
    """Whether ``e`` says the repo, revision or files are not there: on the Hub, or (offline or
    unreachable) in the cache. A gated repo is there."""
    from huggingface_hub import utils as hf

    unreachable = isinstance(e, hf.OfflineModeIsEnabled) and not local_files_only
    return (unreachable or isinstance(e, (FileNotFoundError, hf.RepositoryNotFoundError, hf.RevisionNotFoundError))
            and not isinstance(e, hf.GatedRepoError))
