"""Checkpoints named by Hugging Face Hub repo id: resolved to a local snapshot folder.

huggingface_hub does the work (cache layout, ``HF_HUB_OFFLINE``, tokens, revisions); it is imported
only when a repo id is actually given, so that zload works without it. Only what zload reads is
fetched: safetensors files, their index and the configs, never ``*.bin`` or ``*.pt`` copies of the
same weights. One process per node downloads (local rank 0) while the others wait, so that N ranks
do not fetch the same gigabytes N times, and a failure on any rank is raised on every rank.
"""

from __future__ import annotations

import logging
import os

from .distributed import Problem, agree, rank_and_world
from .errors import CheckpointError, CheckpointNotFoundError

logger = logging.getLogger("zload")

ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json", "adapter_config.json"]


def download(path: str, revision: str | None, also: tuple[str, ...] = ()) -> str:
    """The local snapshot folder of Hub repo ``path`` at ``revision``, downloaded if needed, with
    the files matching the patterns ``also`` besides the checkpoint's (a model's generation config).

    Every rank of a job must call it (two small collectives). Any failure is a ``CheckpointError``
    naming the repo, the revision and what to do next, raised on every rank.
    """
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        raise CheckpointNotFoundError(f"{path}: no such file or directory (to load it as a Hub repo id, "
                                      f"install huggingface_hub)", path=path) from None
    try:
        validate_repo_id(path)
    except ValueError:
        raise CheckpointNotFoundError(f"{path}: no such file or directory, and not a valid Hub repo id "
                                      f"('name' or 'org/name')", path=path) from None

    problems: list[Problem] = []

    def fetch(local_files_only: bool) -> str | None:
        try:
            return snapshot_download(path, revision=revision, allow_patterns=ALLOW_PATTERNS + list(also),
                                     local_files_only=local_files_only)
        except Exception as e:  # every failure becomes one agreed CheckpointError
            kind = CheckpointNotFoundError if _not_found(e) else CheckpointError
            problems.append(Problem.of(kind(_explain(e, path, revision, local_files_only), path=path)))
            return None

    _, world = rank_and_world()
    first = world == 1 or int(os.environ.get("LOCAL_RANK", "0")) == 0
    what = f"cannot load Hub repo '{path}' (revision {revision or 'main'})"
    local = fetch(False) if first else None
    agree(problems, what)  # the others wait here until their node's local rank 0 has downloaded
    if not first:
        local = fetch(True)  # already downloaded: read the same snapshot from the shared cache
    agree(problems, what)
    logger.info("Hub repo %s (revision %s) resolved to %s", path, revision or "main", local)
    return local


def _explain(e: Exception, repo: str, revision: str | None, local_files_only: bool) -> str:
    """What went wrong with ``repo`` at ``revision`` and what to do about it (``agree`` names both)."""
    from huggingface_hub import constants
    from huggingface_hub import utils as hf

    try:
        from huggingface_hub.errors import IncompleteSnapshotError
    except ImportError:  # older huggingface_hub
        IncompleteSnapshotError = ()
    rev = revision or "main"
    download = f"`hf download {repo}" + (f" --revision {revision}`" if revision else "`")
    if isinstance(e, IncompleteSnapshotError):
        return f"the cached snapshot is incomplete: complete it with {download} online"
    if isinstance(e, (hf.LocalEntryNotFoundError, hf.OfflineModeIsEnabled)):
        if local_files_only:
            return (f"local rank 0 downloaded it, but this process does not find it in "
                    f"its cache {constants.HF_HUB_CACHE}: all processes of a node must share "
                    f"HF_HUB_CACHE (or HF_HOME)")
        if constants.HF_HUB_OFFLINE:
            return (f"no such local path, this revision is not in the local cache "
                    f"{constants.HF_HUB_CACHE}, and HF_HUB_OFFLINE=1 is set: download it first "
                    f"with {download}, or unset HF_HUB_OFFLINE")
        return (f"not in the local cache {constants.HF_HUB_CACHE} and the Hub cannot be "
                f"reached ({e}): check the network, or download it first with {download}")
    if isinstance(e, hf.GatedRepoError):
        return ("the repo is gated: accept its terms on the Hub, then log in with "
                "`hf auth login` or set HF_TOKEN")
    if isinstance(e, hf.RepositoryNotFoundError):
        return ("no such local path, and no such repo on the Hub (or it is private: log "
                "in with `hf auth login` or set HF_TOKEN)")
    if isinstance(e, hf.RevisionNotFoundError):
        return f"the repo has no revision {rev!r}: pass an existing branch, tag or commit"
    if isinstance(e, hf.HfHubHTTPError):
        return f"the Hub refused the download ({e}); retry, or check access to the repo"
    return f"{type(e).__name__}: {e}"


def _not_found(e: Exception) -> bool:
    """Whether ``e`` says the repo, revision or files are not there: on the Hub, or (offline) in
    the cache. A gated repo is there."""
    from huggingface_hub import utils as hf

    return (isinstance(e, (FileNotFoundError, hf.RepositoryNotFoundError, hf.RevisionNotFoundError))
            and not isinstance(e, hf.GatedRepoError))
