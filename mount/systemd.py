"""systemd's readiness protocol (sd_notify), the few lines of it a ``Type=notify`` unit needs.

systemd passes a unix datagram socket in ``NOTIFY_SOCKET`` (a path, or an abstract name written
with a leading ``@``); the service sends ``READY=1`` once it serves and ``STOPPING=1`` when it
begins to stop. A unit ordered after kvfs then starts only once the mount answers.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("kvfs.mount")


def notify(*fields: str) -> bool:
    """Send ``fields`` (``READY=1``, ``STATUS=...``) to systemd; False if not run by it.

    A failure is logged, never raised: the mount serves either way, and systemd itself reports
    a service that never said it was ready.
    """
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # an abstract socket name
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(fields).encode(), address)
    except OSError as err:
        log.warning("cannot notify systemd at %s: %s", os.environ["NOTIFY_SOCKET"], err)
        return False
    return True
