"""A model by its hub id: ``ORG/NAME[@REVISION]`` becomes a folder in the Hugging Face cache, fetched as needed.

``resolve_model`` turns a model reference into a ``ModelSource``. A local folder stays as it is. A hub id has its
revision (a branch, a tag or a commit; ``main`` by default) resolved to a commit, and gets the small files of that
commit (config.json, the shard index, the tokenizer files the repository has) into the standard cache that transformers
shares (``HF_HOME`` / ``HF_HUB_CACHE``); the source's folder is that commit's snapshot folder. The weights come later
and only as needed: ``fetch_blocks`` downloads the shards holding some blocks' tensors (a peer's span), and
``fetch_client`` those holding the tensors outside the blocks (embeddings, final norm, LM head: a client's).

Everything goes through huggingface_hub's own functions (``HfApi.model_info``, ``hf_hub_download``): its progress
bars, its resumption of a transfer cut midway, ``token=`` or ``HF_TOKEN`` for gated repositories. The environment is
read at each call, not at import as huggingface_hub reads it: ``HF_ENDPOINT``, the cache's location, and
``HF_HUB_OFFLINE=1``, under which the commit and every file come from the cache alone.

A hub model's name in the swarm is ``ORG--NAME@<first 12 hex of the commit>``: two revisions are two models, and a
client and a peer given the same id and revision agree on it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from swarm.net.errors import ModelHubError

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"
CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"  # as swarm/spec.py names them
SHARD_INDEX = "model.safetensors.index.json"
# What a client may want beside the weights: the tokenizer and the generation defaults (fetched where they exist).
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+)(?:@(?P<revision>[^\s@]+))?")
BLOCK_TENSOR = re.compile(r"model\.layers\.(\d+)\.")
COMMIT = re.compile(r"[0-9a-f]{40}")
SHORT_COMMIT = 12


def parse_hub_id(reference: str) -> tuple[str, str | None] | None:
    """``ORG/NAME[@REVISION]`` -> (repo id, revision or None); None for anything else."""
    match = HUB_ID.fullmatch(reference)
    if match is None or ".." in match["repo"]:
        return None
    return match["repo"], match["revision"]


def model_name(repo_id: str, commit: str) -> str:
    """A hub model's name in the swarm (DHT keys, checkpoints): its repository and commit, with no ``/`` or ``:``."""
    return f"{repo_id.replace('/', '--')}@{commit[:SHORT_COMMIT]}"


def shards_for_blocks(weight_files: Mapping[str, str], blocks: Iterable[int]) -> list[str]:
    """The files (as ``weight_files`` maps tensor name -> file) that hold some tensor of ``blocks``."""
    wanted = {str(block) for block in blocks}
    return sorted({file for name, file in weight_files.items() if (m := BLOCK_TENSOR.match(name)) and m[1] in wanted})


def shards_for_client(weight_files: Mapping[str, str]) -> list[str]:
    """The files that hold some tensor outside the blocks: the embeddings, the final norm, the LM head."""
    return sorted({file for name, file in weight_files.items() if not BLOCK_TENSOR.match(name)})


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as the environment says now."""
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE"))


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def cache_dir() -> Path:
    """The hub cache transformers uses too, as the environment says now."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files come from: a local folder as it is (``repo_id`` None), or one commit of a hub
    repository, whose snapshot folder in the cache gets files as they are fetched."""

    folder: Path
    repo_id: str | None = None
    commit: str | None = None
    token: str | None = field(default=None, repr=False)

    @property
    def name(self) -> str | None:
        """The model's name in the swarm; None for a local folder (whose name is the folder's)."""
        return None if self.repo_id is None else model_name(self.repo_id, self.commit)

    def fetch_blocks(self, weight_files: Mapping[str, Path], blocks: Iterable[int]) -> list[str]:
        """Download the shards holding ``blocks``' tensors (``weight_files``: a spec's tensor name -> path); returns
        the files that were not here before (none for a local folder)."""
        if self.repo_id is None:
            return []
        blocks = list(blocks)
        return self._fetch(shards_for_blocks(self._relative(weight_files), blocks), f"blocks {_span(blocks)}")

    def blocks_on_disk(self, weight_files: Mapping[str, Path], num_blocks: int) -> list[int]:
        """The blocks whose shards are all here (every block of a local folder): a move onto them downloads
        nothing."""
        if self.repo_id is None:
            return list(range(num_blocks))
        relative = self._relative(weight_files)
        return [
            block
            for block in range(num_blocks)
            if all((self.folder / file).is_file() for file in shards_for_blocks(relative, [block]))
        ]

    def bytes_per_block(self, num_blocks: int) -> float:
        """About what one block's shards weigh: the checkpoint's size (its index says it) over its blocks; 0 for a
        local folder or a checkpoint without a size in its index."""
        index = self.folder / SHARD_INDEX
        if self.repo_id is None or not index.is_file():
            return 0.0
        try:
            total = json.loads(index.read_text())["metadata"]["total_size"]
        except (ValueError, KeyError, TypeError):
            return 0.0
        return float(total) / max(1, num_blocks) if isinstance(total, int | float) else 0.0

    def fetch_client(self, weight_files: Mapping[str, Path]) -> list[str]:
        """Download the shards holding the tensors a client reads (embeddings, final norm, LM head)."""
        if self.repo_id is None:
            return []
        return self._fetch(shards_for_client(self._relative(weight_files)), "the embeddings and the LM head")

    def _relative(self, weight_files: Mapping[str, Path]) -> dict[str, str]:
        return {name: Path(path).relative_to(self.folder).as_posix() for name, path in weight_files.items()}

    def _fetch(self, files: list[str], what: str) -> list[str]:
        missing = [file for file in files if not (self.folder / file).is_file()]
        if missing:
            logger.info("downloading %d shard(s) of %s for %s: %s", len(missing), self.repo_id, what, missing)
        for file in missing:
            _download(self.repo_id, file, self.commit, self.token, f"shard {file} (for {what})")
        return missing


def resolve_model(reference: str | Path, revision: str | None = None, token: str | None = None) -> ModelSource:
    """A local folder as it is; ``ORG/NAME[@REVISION]`` (or ``revision=``) resolved to a commit, with its small files
    (config, shard index, tokenizer) in the cache; a single-file checkpoint (no index) is fetched whole, since every
    peer and client needs it. Raises ModelHubError with what to do next."""
    path = Path(reference)
    parsed = None if isinstance(reference, Path) or path.is_dir() else parse_hub_id(str(reference))
    if parsed is None:
        if revision is not None:
            raise ModelHubError(f"{reference}: a revision applies to a hub id (ORG/NAME), not to a local folder")
        return ModelSource(path)
    repo_id, named = parsed
    if named is not None and revision is not None and named != revision:
        raise ModelHubError(f"{reference}: two revisions given ({named} and --revision {revision}); give one")
    revision = named or revision or DEFAULT_REVISION
    if offline():
        return _resolve_offline(repo_id, revision)
    info = _model_info(repo_id, revision, token)
    files = {sibling.rfilename for sibling in info.siblings or ()}
    if CONFIG not in files:
        raise ModelHubError(f"{repo_id}@{revision} has no {CONFIG}: it is not a Hugging Face transformers model")
    # by the revision's name, so that the cache records which commit it names (offline, that is how it resolves)
    config = _download(repo_id, CONFIG, revision, token, CONFIG)
    commit = config.parent.name
    if commit != info.sha:  # the branch moved between the two calls: the files of the commit the config came from
        files = {sibling.rfilename for sibling in _model_info(repo_id, commit, token).siblings or ()}
    if SHARD_INDEX in files:
        weights = [SHARD_INDEX]
    elif SINGLE_FILE in files:
        weights = [SINGLE_FILE]  # its tensors' names are in its header only: fetched whole
    else:
        raise ModelHubError(
            f"{repo_id}@{revision} has neither {SHARD_INDEX} nor {SINGLE_FILE}; only safetensors checkpoints are "
            "supported"
        )
    for file in [*weights, *(name for name in SIDE_FILES if name in files)]:
        _download(repo_id, file, commit, token, file)
    logger.info("%s@%s is commit %s: %s", repo_id, revision, commit, config.parent)
    return ModelSource(config.parent, repo_id, commit, token)


def _resolve_offline(repo_id: str, revision: str) -> ModelSource:
    """The commit ``revision`` names as the cache last saw it, and its snapshot folder, without the network."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        config = Path(hf_hub_download(repo_id, CONFIG, revision=revision, cache_dir=cache_dir(), local_files_only=True))
    except LocalEntryNotFoundError:
        raise ModelHubError(
            f"HF_HUB_OFFLINE is set and the cache at {cache_dir()} holds no {repo_id}@{revision}: run once with the "
            "network to fetch it (or unset HF_HUB_OFFLINE)"
        ) from None
    folder = config.parent
    if not COMMIT.fullmatch(folder.name):
        raise ModelHubError(f"{folder}: not a snapshot folder of the hub cache")
    if not (folder / SHARD_INDEX).is_file() and not (folder / SINGLE_FILE).is_file():
        raise ModelHubError(
            f"HF_HUB_OFFLINE is set and the cache holds no {SHARD_INDEX} (nor {SINGLE_FILE}) of {repo_id}@{revision}"
            ": run once with the network to fetch it"
        )
    return ModelSource(folder, repo_id, folder.name)


def _model_info(repo_id: str, revision: str, token: str | None):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return HfApi(endpoint=endpoint(), token=token).model_info(repo_id, revision=revision, token=token)
    except GatedRepoError as e:
        raise _gated(repo_id) from e
    except RevisionNotFoundError:
        raise ModelHubError(
            f"{repo_id} has no revision {revision!r}: give a branch, a tag or a commit it has (ORG/NAME@REVISION or "
            "--revision)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelHubError(
            f"no model repository {repo_id} at {endpoint()} (nor a local folder of that path): check the name; if "
            "the repository is private, pass --token or set HF_TOKEN"
        ) from None
    except _network_errors() as e:
        raise _unreachable(repo_id, e) from None
    except HfHubHTTPError as e:
        raise _hub_failed(repo_id, e) from None


def _download(repo_id: str, file: str, commit: str, token: str | None, what: str) -> Path:
    """One file of the commit into the cache (a no-op when it is there), by huggingface_hub (progress bar, resumption
    of a cut transfer); offline, from the cache only."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return Path(
            hf_hub_download(
                repo_id,
                file,
                revision=commit,
                cache_dir=cache_dir(),
                token=token,
                endpoint=endpoint(),
                local_files_only=offline(),
            )
        )
    except GatedRepoError as e:
        raise _gated(repo_id) from e
    except RepositoryNotFoundError:
        raise ModelHubError(
            f"{repo_id} refused {what}: if the repository is private, pass --token or set HF_TOKEN"
        ) from None
    except RemoteEntryNotFoundError:
        raise ModelHubError(f"{repo_id}@{commit} lists {file} but does not serve it; try again later") from None
    except LocalEntryNotFoundError as e:
        if offline():
            raise ModelHubError(
                f"HF_HUB_OFFLINE is set and the cache at {cache_dir()} lacks {what} of {repo_id}@{commit}: run once "
                "with the network to fetch it"
            ) from None
        raise _unreachable(repo_id, e) from None
    except _network_errors() as e:
        raise _unreachable(repo_id, e) from None
    except HfHubHTTPError as e:
        raise _hub_failed(repo_id, e) from None


def _gated(repo_id: str) -> ModelHubError:
    return ModelHubError(
        f"{repo_id} is a gated repository: pass --token or set HF_TOKEN, and accept the license at "
        f"{endpoint()}/{repo_id}"
    )


def _unreachable(repo_id: str, error: Exception) -> ModelHubError:
    return ModelHubError(
        f"cannot reach {endpoint()} for {repo_id} ({type(error).__name__}: {error}): check the network (or HF_ENDPOINT"
        "), or set HF_HUB_OFFLINE=1 to use what the cache holds"
    )


def _hub_failed(repo_id: str, error: Exception) -> ModelHubError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ModelHubError(f"{endpoint()} failed to serve {repo_id} ({first}): try again later")


def _network_errors() -> tuple[type[Exception], ...]:
    """What huggingface_hub raises when the hub cannot be reached: its HTTP library's transport errors (httpx2 in
    huggingface_hub 2, httpx before), and its own offline error."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    errors: list[type[Exception]] = [OfflineModeIsEnabled]
    for module in ("httpx2", "httpx"):
        try:
            errors.append(__import__(module).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def _span(blocks: list[int]) -> str:
    return f"{min(blocks)}:{max(blocks) + 1}" if blocks else "none"
