"""How every gpupool process authenticates to etcd: TLS (CA, client certificate) and etcd users.

No gRPC here: the training process resolves and checks these settings itself, then hands the
frozen, picklable :class:`EtcdSecurity` to its I/O helper process, which opens the channel.

Each setting comes from, in order: an explicit argument (CLI flag), ``GPUPOOL_ETCD_*``, then the
variable ``etcdctl`` reads (``ETCDCTL_*``), so a shell where ``etcdctl`` works also works for
``gpupool``:

==========  ===================  ================================  ======================================
setting     CLI flag             environment                       meaning
==========  ===================  ================================  ======================================
cacert      ``--etcd-cacert``    GPUPOOL_ETCD_CACERT, ETCDCTL_CACERT  CA bundle that signed etcd's certificate
cert        ``--etcd-cert``      GPUPOOL_ETCD_CERT, ETCDCTL_CERT      client certificate (mTLS)
key         ``--etcd-key``       GPUPOOL_ETCD_KEY, ETCDCTL_KEY        its private key (unencrypted PEM)
user        ``--etcd-user``      GPUPOOL_ETCD_USER, ETCDCTL_USER      etcd user; the env value may be
                                                                      ``user:password``
password    ``--etcd-password-file``  GPUPOOL_ETCD_PASSWORD_FILE,   never a flag value (``ps`` shows
                                      GPUPOOL_ETCD_PASSWORD,        those)
                                      ETCDCTL_PASSWORD
==========  ===================  ================================  ======================================

TLS is on when a CA or a client certificate is set, or an endpoint is written ``https://``; with
no CA the system's trust store verifies etcd's certificate.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.store.endpoints import endpoints_scheme

CACERT_ENV = "GPUPOOL_ETCD_CACERT"
CERT_ENV = "GPUPOOL_ETCD_CERT"
KEY_ENV = "GPUPOOL_ETCD_KEY"
USER_ENV = "GPUPOOL_ETCD_USER"
PASSWORD_ENV = "GPUPOOL_ETCD_PASSWORD"
PASSWORD_FILE_ENV = "GPUPOOL_ETCD_PASSWORD_FILE"

#: Per setting: the CLI flag, then the environment variables in the order they are read.
SOURCES: dict[str, tuple[str, ...]] = {
    "cacert": ("--etcd-cacert", CACERT_ENV, "ETCDCTL_CACERT"),
    "cert": ("--etcd-cert", CERT_ENV, "ETCDCTL_CERT"),
    "key": ("--etcd-key", KEY_ENV, "ETCDCTL_KEY"),
    "user": ("--etcd-user", USER_ENV, "ETCDCTL_USER"),
    "password": ("--etcd-password-file", PASSWORD_FILE_ENV, PASSWORD_ENV, "ETCDCTL_PASSWORD"),
}

#: Every environment variable read by :meth:`EtcdSecurity.from_env` (to scrub or copy them).
SECURITY_ENV_VARS: tuple[str, ...] = tuple(v for names in SOURCES.values() for v in names if not v.startswith("--"))


def describe(name: str) -> str:
    """``cacert`` -> ``--etcd-cacert / GPUPOOL_ETCD_CACERT / ETCDCTL_CACERT`` (for messages)."""
    return " / ".join(SOURCES[name])


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes read from the files of an :class:`EtcdSecurity`, ready for ``grpc.ssl_channel_credentials``."""

    root_certificates: bytes | None
    private_key: bytes | None
    certificate_chain: bytes | None


@dataclass(frozen=True)
class EtcdSecurity:
    """TLS and authentication settings of an etcd connection (a plain, picklable value).

    Args:
        cacert: PEM CA bundle that signed etcd's server certificate (None: the system's roots).
        cert: PEM client certificate, for etcd started with ``--client-cert-auth``.
        key: the client certificate's private key (PEM, not encrypted).
        user: etcd user (``etcdctl user add``), for etcd with ``auth enable``.
        password: that user's password (not shown by ``repr``).
        tls: use TLS even with no file set (an ``https://`` endpoint); set automatically.
        origins: where each setting came from (``(name, "$ENV")`` pairs), named in errors.

    Raises:
        ConfigError: a certificate without its key or the reverse, a password without a user,
            a user containing ``:`` (give the password separately); the message names the setting.

    Example:
        >>> EtcdSecurity(cacert="/etc/etcd/ca.pem", user="trainer", password="s3cret")
        EtcdSecurity(cacert='/etc/etcd/ca.pem', cert=None, key=None, user='trainer', tls=False)
        >>> EtcdSecurity().use_tls
        False
    """

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    origins: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("cacert", "cert", "key", "user", "password"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike) and name in ("cacert", "cert", "key"):
                value = os.fspath(value)
            if value is not None and not isinstance(value, str):
                raise ConfigError(name, f"must be a string (a file path for certificates), got {type(value).__name__}")
            object.__setattr__(self, name, value or None)  # "" means unset, as for etcdctl
        if self.cert and not self.key:
            raise ConfigError(
                self._name("key"), f"the client certificate {self.cert!r} needs its private key; set {describe('key')}"
            )
        if self.key and not self.cert:
            raise ConfigError(
                self._name("cert"), f"a client key ({self.key!r}) was given without its certificate; set {describe('cert')}"
            )
        if self.user is not None and ":" in self.user:
            raise ConfigError(
                self._name("user"),
                f"{self.user.split(':', 1)[0]!r}:... holds a password; give the user alone and the password through "
                f"{PASSWORD_ENV} or --etcd-password-file (a flag value is visible to every user in `ps`)",
            )
        if self.password is not None and self.user is None:
            raise ConfigError(self._name("password"), f"a password was given without a user; set {describe('user')}")

    # ------------------------------------------------------------------ views

    @property
    def use_tls(self) -> bool:
        """True when connections use TLS."""
        return bool(self.tls or self.cacert or self.cert)

    @property
    def use_auth(self) -> bool:
        """True when the connection authenticates as an etcd user (a token on every call)."""
        return self.user is not None

    def origin(self, name: str) -> str | None:
        """The flag or variable the setting ``name`` came from, if known."""
        return dict(self.origins).get(name)

    def _name(self, name: str) -> str:
        got = self.origin(name)
        return f"{name} ({got})" if got else name

    def summary(self) -> str:
        """One line for logs: ``TLS (CA /x/ca.pem, client cert /x/c.pem), user alice``."""
        if not self.use_tls and not self.use_auth:
            return "plaintext, no auth"
        parts = []
        if self.use_tls:
            what = [f"CA {self.cacert}" if self.cacert else "system CA roots"]
            if self.cert:
                what.append(f"client cert {self.cert}")
            parts.append(f"TLS ({', '.join(what)})")
        else:
            parts.append("plaintext")
        if self.user:
            parts.append(f"user {self.user}")
        return ", ".join(parts)

    def environment(self) -> dict[str, str]:
        """The ``GPUPOOL_ETCD_*`` variables that make a child process resolve these same settings.

        ``gpupool run`` passes them to the script it starts, so that settings given as flags reach
        the script's own connections (its time-slicing gate, a direct client). A password read
        from a file is passed as that file's path, never as its text; one given as an argument is
        passed in ``GPUPOOL_ETCD_PASSWORD`` (the environment, unlike an argument, is private to
        the user).

        Example:
            >>> EtcdSecurity(cacert="/etc/etcd/ca.pem", user="trainer").environment()
            {'GPUPOOL_ETCD_CACERT': '/etc/etcd/ca.pem', 'GPUPOOL_ETCD_USER': 'trainer'}
        """
        env: dict[str, str] = {}
        for name, var in (("cacert", CACERT_ENV), ("cert", CERT_ENV), ("key", KEY_ENV), ("user", USER_ENV)):
            value = getattr(self, name)
            if value:
                env[var] = value
        if self.password is not None:
            origin = self.origin("password") or ""
            flag = "--etcd-password-file "
            if origin.startswith(flag):
                env[PASSWORD_FILE_ENV] = origin[len(flag):]
            elif not origin.startswith("$"):  # from the environment: the child inherits it as is
                env[PASSWORD_ENV] = self.password
        return env

    # ------------------------------------------------------------------ building

    @classmethod
    def resolve(
        cls,
        *,
        cacert: str | os.PathLike[str] | None = None,
        cert: str | os.PathLike[str] | None = None,
        key: str | os.PathLike[str] | None = None,
        user: str | None = None,
        password: str | None = None,
        password_file: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> EtcdSecurity:
        """Explicit values (CLI flags) first, then ``GPUPOOL_ETCD_*``, then ``ETCDCTL_*``, setting by setting.

        A user read from the environment may be ``user:password`` (as ``ETCDCTL_USER``); that
        password is used only with that user and only when no password is set otherwise.

        Raises:
            ConfigError: as :class:`EtcdSecurity`, or a password file that cannot be read.
        """
        environ = os.environ if env is None else env
        origins: dict[str, str] = {}
        values: dict[str, str | None] = {}
        explicit = {"cacert": cacert, "cert": cert, "key": key}
        for name, given in explicit.items():
            values[name] = _pick(name, os.fspath(given) if given is not None else None, environ, origins)
        if user is not None and ":" in user:
            raise ConfigError(
                "--etcd-user",
                f"{user.split(':', 1)[0]!r}:... holds a password; give the user alone and the password through "
                f"{PASSWORD_ENV} or --etcd-password-file (a flag value is visible to every user in `ps`)",
            )
        the_user = _pick("user", user or None, environ, origins)
        embedded: str | None = None
        if the_user is not None and ":" in the_user:
            the_user, embedded = the_user.split(":", 1)
        pw: str | None = None
        if password:
            pw = password
            origins["password"] = "argument"
        elif password_file:
            pw = read_password_file(os.fspath(password_file), "--etcd-password-file")
            origins["password"] = f"--etcd-password-file {os.fspath(password_file)}"
        elif environ.get(PASSWORD_FILE_ENV):
            pw = read_password_file(environ[PASSWORD_FILE_ENV], PASSWORD_FILE_ENV)
            origins["password"] = f"${PASSWORD_FILE_ENV}"
        else:
            for var in (PASSWORD_ENV, "ETCDCTL_PASSWORD"):
                if environ.get(var):
                    pw = environ[var]
                    origins["password"] = f"${var}"
                    break
            else:
                if embedded:
                    pw = embedded
                    origins["password"] = f"{origins.get('user', 'user')} (user:password)"
        return cls(
            cacert=values["cacert"],
            cert=values["cert"],
            key=values["key"],
            user=the_user,
            password=pw,
            origins=tuple(sorted(origins.items())),
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EtcdSecurity:
        """The settings from ``GPUPOOL_ETCD_*`` / ``ETCDCTL_*`` alone (plaintext and no auth when unset)."""
        return cls.resolve(env=env)

    def for_endpoints(self, endpoints: str | Sequence[str] | None) -> EtcdSecurity:
        """These settings with TLS switched on when the endpoints are written ``https://``.

        Raises:
            ConfigError: ``http://`` endpoints with TLS files set, or a mix of schemes.
        """
        scheme = endpoints_scheme(endpoints)
        if scheme == "https" and not self.tls:
            return replace(self, tls=True)
        if scheme == "http" and self.use_tls:
            given = "--etcd-cacert" if self.cacert else "--etcd-cert"
            raise ConfigError(
                "endpoints",
                f"the endpoints say http:// (plaintext) but TLS settings are set ({given}); write the endpoints "
                "https://host:port, or drop the TLS settings if etcd really serves plaintext",
            )
        return self

    # ------------------------------------------------------------------ files

    def load(self) -> TlsMaterial | None:
        """Read and check the certificate files (None without TLS).

        With no CA file, the system's CA bundle (``ssl.get_default_verify_paths()``) is read if
        there is one; else gRPC's own roots are used.

        Raises:
            ConfigError: a file is missing, unreadable, not PEM, an encrypted key, or a key that
                does not match its certificate; names the setting, its source and the fix.
        """
        if not self.use_tls:
            return None
        if self.cacert:
            roots: bytes | None = self._read("cacert", b"-----BEGIN CERTIFICATE-----", "a PEM CA certificate")
            try:
                ssl.create_default_context(cafile=self.cacert)
            except (ssl.SSLError, ValueError) as exc:
                raise ConfigError(self._name("cacert"), f"{self.cacert!r} is not a usable PEM CA bundle ({exc})") from None
        else:
            roots = _system_roots()
        key = chain = None
        if self.cert and self.key:
            chain = self._read("cert", b"-----BEGIN CERTIFICATE-----", "a PEM certificate")
            key = self._read("key", b"PRIVATE KEY-----", "a PEM private key")
            if b"ENCRYPTED" in key:
                raise ConfigError(
                    self._name("key"),
                    f"{self.key!r} is encrypted; gRPC needs an unencrypted key: "
                    f"`openssl pkey -in {self.key} -out key-plain.pem` and keep that file readable by this user only",
                )
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            try:
                ctx.load_cert_chain(self.cert, self.key, password=_no_password)
            except (ssl.SSLError, ValueError) as exc:
                raise ConfigError(
                    self._name("key"),
                    f"{self.key!r} does not go with the certificate {self.cert!r} ({getattr(exc, 'reason', None) or exc}); "
                    f"give the key the certificate was issued for",
                ) from None
        return TlsMaterial(root_certificates=roots, private_key=key, certificate_chain=chain)

    def _read(self, name: str, marker: bytes, what: str) -> bytes:
        path = getattr(self, name)
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            raise ConfigError(self._name(name), f"{path!r} does not exist; fix the path in {describe(name)}") from None
        except IsADirectoryError:
            raise ConfigError(self._name(name), f"{path!r} is a directory; give the file ({what})") from None
        except OSError as exc:
            raise ConfigError(
                self._name(name), f"cannot read {path!r} ({exc.strerror}); make it readable by this user (uid {os.getuid()})"
            ) from None
        if marker not in data:
            raise ConfigError(self._name(name), f"{path!r} is not {what} (no {marker.decode().strip('-')} block)")
        return data


def read_password_file(path: str, source: str) -> str:
    """The first line of a password file (``source`` names the flag or variable in errors)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(source, f"cannot read the password file {path!r} ({exc.strerror}); fix the path or its permissions") from None
    pw = text.splitlines()[0] if text else ""
    if not pw:
        raise ConfigError(source, f"the password file {path!r} is empty; put the etcd user's password on its first line")
    return pw


def _pick(name: str, given: str | None, env: Mapping[str, str], origins: dict[str, str]) -> str | None:
    flag, *envs = SOURCES[name]
    if given:
        origins[name] = flag
        return given
    for var in envs:
        if env.get(var):
            origins[name] = f"${var}"
            return env[var]
    return None


def _no_password() -> str:
    raise ssl.SSLError("the key is encrypted")


def _system_roots() -> bytes | None:
    cafile = ssl.get_default_verify_paths().cafile
    if cafile:
        try:
            return Path(cafile).read_bytes()
        except OSError:
            return None
    return None
