"""CurveZMQ for remote workers: key files, the broker's allow-list, the worker's client keys.

Remote workers reach the broker's back socket over TCP. That socket is then a CURVE server
(RFC 26 "CurveZMQ": every connection is encrypted and the client proves it holds a secret key);
a ZAP handler (RFC 27, pyzmq's ``zmq.auth.thread.ThreadAuthenticator``) admits only client public
keys found in an allow-list directory. A worker without keys (NULL mechanism) or with a key that
is not listed fails the handshake and never reaches the broker's code: it cannot register.

Key files use the ZeroMQ certificate format (ZPL text, as written by czmq and ``zmq.auth``):
``NAME.key`` holds the public key, ``NAME.key_secret`` the public and the secret key. Layout
written by ``laneserve keys generate`` (``generate_keys``) under ``$LANESERVE_HOME/keys`` (0700
directories, 0600 files)::

    keys/server.key              broker public key      -> worker --curve-server-public
    keys/server.key_secret       broker key pair        -> broker --curve-server-key
    keys/allowed/NAME.key        client public keys     -> broker --curve-allow (the allow-list)
    keys/clients/NAME.key_secret client key pair        -> worker --curve-client-key (copy it to
                                                           the worker's host)

Revoking a worker = deleting its ``allowed/NAME.key``; the broker rereads the directory when it
changes (checked at each handshake), so neither adding nor revoking needs a broker restart. A
connection already established stays up until it reconnects (restart the broker to cut it).
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from laneserve.contracts import env

logger = logging.getLogger(__name__)

SERVER_NAME = "server"
ZAP_DOMAIN = "laneserve"  # the back socket's ZAP domain; the allow-list serves only it
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class CurveKeyError(ValueError):
    """A key file or key directory is missing, unreadable, malformed or too open."""


@dataclass(frozen=True, slots=True)
class KeyPaths:
    """Where ``generate_keys`` wrote the keys (see the module docstring for the layout)."""

    keys_dir: Path
    server_public: Path
    server_secret: Path
    allow_dir: Path
    clients: dict[str, Path]  # client name -> its .key_secret file


def default_keys_dir() -> Path:
    return env.laneserve_home() / "keys"


def _write_cert(path: Path, public: bytes, secret: bytes | None, force: bool) -> None:
    """Write a ZeroMQ certificate file created 0600 (never world-readable, even briefly)."""
    kind = "Secret" if secret else "Public"
    lines = [
        f"#   ****  Generated on {datetime.datetime.now():%Y-%m-%d %H:%M:%S} by laneserve  ****",
        f"#   ZeroMQ CURVE {kind} Certificate",
        "#   Exchange securely, or use a secure mechanism to verify the contents",
        "#   of this file after exchange. Store public certificates in your home",
        "#   directory, in the .curve subdirectory.",
        "",
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(path, 0o600)


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def generate_keys(
    keys_dir: Path | None = None, clients: list[str] | None = None, *, force: bool = False
) -> KeyPaths:
    """Create the server key pair (once) and one key pair per client name.

    Existing keys are kept (adding a client never rotates the server key) unless ``force``.
    Names: 1-64 characters of ``[A-Za-z0-9_.-]``. Raises ``CurveKeyError`` on a bad name and
    ``RuntimeError`` when libzmq was built without CURVE.
    """
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support (needs libsodium)")
    keys_dir = _private_dir(Path(keys_dir or default_keys_dir()))
    allow_dir = _private_dir(keys_dir / "allowed")
    clients_dir = _private_dir(keys_dir / "clients")
    names = list(dict.fromkeys(clients if clients is not None else ["worker"]))
    for name in names:
        if not _NAME_RE.match(name) or name == SERVER_NAME:
            raise CurveKeyError(f"bad client name {name!r}: use 1-64 of [A-Za-z0-9_.-]")
    server_public = keys_dir / f"{SERVER_NAME}.key"
    server_secret = keys_dir / f"{SERVER_NAME}.key_secret"
    if force or not server_secret.exists():
        public, secret = zmq.curve_keypair()
        _write_cert(server_secret, public, secret, force=True)
        _write_cert(server_public, public, None, force=True)
    out: dict[str, Path] = {}
    for name in names:
        secret_path = clients_dir / f"{name}.key_secret"
        if force or not secret_path.exists():
            public, secret = zmq.curve_keypair()
            _write_cert(secret_path, public, secret, force=True)
            _write_cert(allow_dir / f"{name}.key", public, None, force=True)
        out[name] = secret_path
    return KeyPaths(keys_dir, server_public, server_secret, allow_dir, out)


def load_public(path: str | os.PathLike) -> bytes:
    """The Z85 public key (40 bytes) in a ``.key`` or ``.key_secret`` file."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read CURVE key {path}: {exc}") from exc
    if len(public) != 40:
        raise CurveKeyError(f"{path}: not a Z85 CURVE public key")
    return public


def load_secret(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """``(public, secret)`` Z85 keys from a ``.key_secret`` file that only its owner can read."""
    try:
        mode = os.stat(path).st_mode
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read CURVE key {path}: {exc}") from exc
    if not secret or len(secret) != 40 or len(public) != 40:
        raise CurveKeyError(f"{path}: no CURVE secret key (use the .key_secret file)")
    if mode & 0o077:
        raise CurveKeyError(f"{path}: secret key readable by others (chmod 600 it)")
    return public, secret


class AllowList:
    """Client public keys allowed to connect: the ``*.key`` files of one directory.

    ``callback(domain, key)`` is pyzmq's ZAP credentials-provider hook (called on the
    authenticator's thread, once per handshake); it rereads the directory when its mtime changed,
    so adding or deleting a key file takes effect for the next connection.
    ``refused`` counts denied handshakes.
    """

    def __init__(self, allow_dir: str | os.PathLike) -> None:
        self.allow_dir = Path(allow_dir)
        if not self.allow_dir.is_dir():
            raise CurveKeyError(f"CURVE allow-list directory {self.allow_dir} does not exist")
        self._lock = threading.Lock()
        self._mtime = -1
        self._keys: set[bytes] = set()
        self.refused = 0
        self._last_log = 0.0
        self._reload()
        if not self._keys:
            logger.warning("CURVE allow-list %s is empty: every worker is refused", allow_dir)

    def _reload(self) -> None:
        mtime = self.allow_dir.stat().st_mtime_ns
        if mtime == self._mtime:
            return
        self._mtime = mtime
        self._keys = set(zmq.auth.load_certificates(self.allow_dir))

    def callback(self, domain: str, key: bytes) -> bool:
        with self._lock:
            try:
                self._reload()  # one stat per handshake; rereads only when the directory changed
            except OSError:
                logger.exception("cannot reread CURVE allow-list %s", self.allow_dir)
            if key in self._keys:
                return True
            self.refused += 1
            now = time.monotonic()
            if now - self._last_log > 1.0:
                self._last_log = now
                logger.warning(
                    "refused CURVE client key %s (not in %s; %d refused so far)",
                    key.decode(errors="replace")[:40],
                    self.allow_dir,
                    self.refused,
                )
            return False


class CurveServer:
    """Makes a socket a CURVE server admitting only allow-listed clients.

    ``CurveServer(ctx, server_secret_file, allow_dir).apply(sock)`` before ``sock.bind``;
    ``close()`` stops the ZAP thread. Raises ``CurveKeyError`` on bad key files.
    """

    def __init__(
        self, ctx: zmq.Context, server_secret_file: str | os.PathLike, allow_dir: str | os.PathLike
    ) -> None:
        self.public, self.secret = load_secret(server_secret_file)
        self.allow = AllowList(allow_dir)
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("laneserve.broker.curve.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self.allow)

    def apply(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())

    def close(self) -> None:
        if self.auth.is_alive():
            self.auth.stop()


def apply_client(
    sock: zmq.Socket, server_public_file: str | os.PathLike, client_secret_file: str | os.PathLike
) -> None:
    """Make ``sock`` a CURVE client of the server whose public key is in ``server_public_file``,
    authenticating with the key pair in ``client_secret_file``. Call before ``connect``.
    Raises ``CurveKeyError`` on bad key files."""
    server_public = load_public(server_public_file)
    public, secret = load_secret(client_secret_file)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def curve_server(
    ctx: zmq.Context, back: str, server_key: str | None, allow: str | None
) -> CurveServer | None:
    """The broker back socket's CURVE server, or None for a local-only back socket.

    Raises ValueError when only one of ``server_key``/``allow`` is given, or when the back
    socket ``back`` would listen beyond loopback without CURVE (remote workers must use
    CurveZMQ, DESIGN.md "Wire protocol"); :class:`CurveKeyError` on bad key files.
    """
    from laneserve.broker.addresses import is_local_endpoint

    if bool(server_key) != bool(allow):
        raise ValueError("CURVE needs both a server key (--curve-server-key) and --curve-allow")
    if not server_key:
        if not is_local_endpoint(back):
            raise ValueError(
                f"back socket {back} is reachable from other hosts: remote workers must "
                "use CurveZMQ (--curve-server-key and --curve-allow; `laneserve keys generate`)"
            )
        return None
    return CurveServer(ctx, server_key, allow)
