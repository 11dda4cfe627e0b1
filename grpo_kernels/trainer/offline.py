"""Fail fast without the Hugging Face Hub: a dataset or model name that needs the Hub, on a machine that cannot reach
it (or with `HF_HUB_OFFLINE` / `HF_DATASETS_OFFLINE` / `TRANSFORMERS_OFFLINE` set) and without a cached copy, is
one error at once, saying how to use a local path or file, instead of the libraries' retries (tens of seconds)."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
PROBE_SECONDS = 1.0  # the connection attempt to the Hub's host


def offline_reason() -> str | None:
    """Why the Hub cannot be used (an offline variable set, the host unreachable), or None when it can."""
    for name in OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{name} is set"
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return None  # through a proxy: let the libraries try
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    reached: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
            reached.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)  # name resolution has no timeout of its own
    thread.start()
    thread.join(PROBE_SECONDS + 0.5)
    return None if reached else f"{host} cannot be reached"


def _hf_home() -> Path:
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()


def cached(repo_id: str, repo_type: str) -> bool:
    """Whether a copy of Hub repository `repo_id` (`model` or `dataset`) is in the local caches."""
    hub = Path(os.environ.get("HF_HUB_CACHE", _hf_home() / "hub")).expanduser()
    folders = [hub / f"{repo_type}s--{repo_id.replace('/', '--')}"]
    if repo_type == "dataset":
        datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE", _hf_home() / "datasets")).expanduser()
        folders.append(datasets_cache / repo_id.replace("/", "___"))
    return any(folder.is_dir() for folder in folders)


def require_model(name: str) -> None:
    """`require_hub` for a model name that is not a local directory (a Hub id such as "Qwen/Qwen2.5-0.5B")."""
    hub_id = not name.startswith((".", "/", "~")) and name.count("/") <= 1
    path = Path(name).expanduser()
    if hub_id and not path.exists() and "/" in name and path.parent.is_dir():  # runs/nope beside runs/: a local path
        raise FileNotFoundError(
            f"model {name!r}: no such directory (in {str(path.parent)!r}: "
            f"{', '.join(sorted(p.name for p in path.parent.iterdir())[:10]) or 'nothing'}); give a run directory "
            "or one of its checkpoints/step_NNNNNN"
        )
    if hub_id and not path.exists():
        local = f"no directory {name!r} either; give a local model directory (a run's checkpoints/step_NNNNNN, "
        local += "or for evaluate the run directory)"
        require_hub(f"model {name!r}", name, "model", local)


def require_hub(what: str, repo_id: str, repo_type: str, local: str) -> None:
    """Nothing when the Hub is usable or `repo_id` is cached; else an OSError (the CLI's one-line error) naming
    `what`, why the Hub cannot be used and `local`, the way to do without it."""
    if cached(repo_id, repo_type):
        return
    reason = offline_reason()
    if reason is not None:
        raise ConnectionError(
            f"{what} needs the Hugging Face Hub, which this machine cannot use ({reason}), and "
            f"no copy of {repo_id!r} is cached: {local}"
        )
