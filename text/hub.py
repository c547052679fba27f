"""Models, tokenizers and datasets named by their Hugging Face hub id (`nvidia/...`): read from the local hub
cache when there, downloaded when the hub can be reached, and otherwise refused at once with the local-path way
out, never left hanging on a network that is not there."""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from ..errors import UsageError

#: what a hub repository id looks like: `owner/name` (a bare name is taken for a local path)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: seconds to wait for the hub before calling the machine offline
PROBE_SECONDS = 3.0


class HubError(UsageError):
    """A hub id that is neither cached nor reachable."""


def is_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and not Path(name).exists() and not name.endswith((".json", ".toml", ".py"))


def online() -> bool:
    """Whether the hub answers (a TCP connection within PROBE_SECONDS); HF_HUB_OFFLINE=1 says no without asking."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=PROBE_SECONDS):
            return True
    except OSError:
        return False


def resolve(name: str, what: str = "model") -> Path:
    """A local directory for `name`: itself when it exists on disk, else the hub snapshot of that id."""
    if not is_hub_id(name):
        return Path(name)
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise HubError(f"{name} is not a path on this machine, and reading it from the hub needs huggingface_hub "
                       "(pip install huggingface_hub); or pass a local directory") from None
    try:
        return Path(snapshot_download(name, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    except Exception as e:  # a malformed id, a broken cache entry
        raise HubError(f"{name}: not a local path, and not a usable hub id ({type(e).__name__}: {e})") from None
    if not online():
        raise HubError(f"{name} does not exist on this machine, and as a hub id it is not in the local hub cache and "
                       f"the hub cannot be reached (offline); download the {what} on a connected machine "
                       f"(huggingface-cli download {name} --local-dir DIR) and pass DIR instead")
    try:
        return Path(snapshot_download(name))
    except Exception as e:
        raise HubError(f"cannot download {name} from the hub ({type(e).__name__}: {e}); pass a local directory "
                       "instead") from None
