"""Whether the Hugging Face hub may be, and can be, reached: read by model loading and by the named data sets.

Both ask before they try a download, so that an offline machine gets a clear error at once instead of a
download that hangs on name resolution.
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlparse

HUB_PROBE_TIMEOUT_S = 3.0
_TRUTHY = {"1", "true", "yes", "on"}


def env_offline() -> bool:
    """True when the user asked the Hugging Face libraries to stay offline."""
    return any(os.environ.get(var, "").strip().lower() in _TRUTHY for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub endpoint opens within ``timeout_s``.

    Runs in a daemon thread because name resolution ignores socket timeouts and can block for
    minutes on a machine without network."""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    outcome: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(True)
        except OSError:
            outcome.append(False)

    thread = threading.Thread(target=probe, name="quantkit-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(outcome and outcome[0])
