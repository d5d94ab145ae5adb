"""TLS and etcd authentication against real etcd servers started with certificates.

A throwaway CA, a server certificate (SAN 127.0.0.1 and localhost) and a client certificate
are made with the ``openssl`` command line in a temporary directory; a second, unrelated CA
plays the "wrong CA". Two etcd servers run for the module: one with mutual TLS
(``--client-cert-auth``), one with server TLS and etcd users (``auth enable``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from testkit import start_gpupool_etcd, stop_groups, wait_for

from gpupool_sdk.errors import ConfigError, StoreAuthError, StoreTLSError, StoreUnavailableError
from gpupool_sdk.resources import Allocation
from gpupool_sdk.store import (
    EtcdSecurity,
    EtcdServer,
    EtcdServerTLS,
    EtcdStore,
    Keyspace,
    WatchEvent,
    find_etcdctl_binary,
)
from gpupool_sdk.store.security import SECURITY_ENV_VARS

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command line")

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------- certificates


@dataclass(frozen=True)
class Pki:
    """One CA and the certificates it signed, as file paths."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(d: Path, client_cn: str = "gpupool-client") -> Pki:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, in ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", "-new", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", f"/CN=test-ca-{d.name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    leaf = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
    for name, cn, ext in (
        ("server", "localhost", leaf + "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"),
        ("client", client_cn, leaf + "extendedKeyUsage=clientAuth\n"),
    ):
        _openssl("req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
        (d / f"{name}.ext").write_text(ext)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return Pki(*(str(d / f) for f in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki-good"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """An unrelated CA: its certificates are not trusted by the servers, nor its CA by clients."""
    return make_pki(tmp_path_factory.mktemp("pki-other"))


@pytest.fixture(scope="module")
def mtls_etcd(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """etcd serving https with ``--client-cert-auth`` (mutual TLS)."""
    server = EtcdServer(
        data_dir=tmp_path_factory.mktemp("etcd-mtls") / "data",
        name="mtls",
        tls=EtcdServerTLS(pki.server_cert, pki.server_key, trusted_ca_file=pki.ca),
    )
    server.start(timeout=60)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def mtls(pki: Pki) -> EtcdSecurity:
    return EtcdSecurity(cacert=pki.ca, cert=pki.client_cert, key=pki.client_key)


ROOT_PW = "root-pw"
ALICE_PW = "alice-pw"


@pytest.fixture(scope="module")
def auth_etcd(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """etcd serving https (server certificate only) with auth on: users root and alice (read-write on /pool/ only)."""
    server = EtcdServer(
        data_dir=tmp_path_factory.mktemp("etcd-auth") / "data",
        name="auth",
        tls=EtcdServerTLS(pki.server_cert, pki.server_key),
    )
    server.start(timeout=60)
    env = {k: v for k, v in os.environ.items() if k not in SECURITY_ENV_VARS}
    env["ETCDCTL_API"] = "3"
    base = [find_etcdctl_binary(), f"--endpoints={server.client_url}", f"--cacert={pki.ca}"]
    try:
        for args in (
            ["user", "add", f"root:{ROOT_PW}"],
            ["user", "grant-role", "root", "root"],
            ["user", "add", f"alice:{ALICE_PW}"],
            ["role", "add", "pool"],
            ["role", "grant-permission", "pool", "--prefix=true", "readwrite", "/pool/"],
            ["user", "grant-role", "alice", "pool"],
            ["auth", "enable"],
        ):
            r = subprocess.run([*base, *args], capture_output=True, text=True, env=env, timeout=30)
            # etcd 3.5 grants root the root role itself on `user add root`; a second grant is refused.
            assert r.returncode == 0 or "already" in r.stderr or args[:2] == ["user", "grant-role"], (args, r.stderr)
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _no_security_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start every test from a shell with no GPUPOOL_ETCD_* / ETCDCTL_* settings."""
    for var in SECURITY_ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def open_store(endpoint: str, security: EtcdSecurity | None, prefix: str = "/pool/t", timeout_s: float = 3.0) -> EtcdStore:
    return EtcdStore(endpoint, keyspace=Keyspace(prefix), timeout_s=timeout_s, security=security)


# ---------------------------------------------------------------------------------------- mutual TLS


def test_store_reads_writes_leases_and_watches_over_mutual_tls(mtls_etcd: EtcdServer, mtls: EtcdSecurity) -> None:
    with open_store(mtls_etcd.client_url, mtls) as store:
        assert store.security.use_tls
        seen: list[str] = []
        got = threading.Event()

        def on_events(events: list[WatchEvent]) -> None:
            seen.extend(e.kv.key for e in events)
            got.set()

        w = store.watch_prefix("/pool/t/", on_events)
        assert w.wait_ready(10)
        lease = store.grant_lease(5)
        assert store.create("/pool/t/a", b"1", lease=lease)
        assert not store.create("/pool/t/a", b"2")  # a lost compare stays False over TLS
        kv = store.get("/pool/t/a")
        assert kv is not None and kv.value == b"1" and kv.lease == lease
        assert got.wait(10) and seen == ["/pool/t/a"]
        assert store.refresh_lease(lease) > 0
        assert store.revoke_lease(lease)
        assert store.get("/pool/t/a") is None


def test_https_endpoint_and_environment_are_enough(mtls_etcd: EtcdServer, pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPOOL_ETCD_CACERT", pki.ca)
    # etcdctl's variables are read when the GPUPOOL_ ones are unset.
    monkeypatch.setenv("ETCDCTL_CERT", pki.client_cert)
    monkeypatch.setenv("ETCDCTL_KEY", pki.client_key)
    with EtcdStore(mtls_etcd.client_url, keyspace=Keyspace("/pool/env"), timeout_s=3) as store:
        assert store.security.origin("cacert") == "$GPUPOOL_ETCD_CACERT"
        assert store.security.origin("cert") == "$ETCDCTL_CERT"
        store.put("/pool/env/x", b"v")
        got = store.get("/pool/env/x")
        assert got is not None and got.value == b"v"


def test_wrong_ca_is_a_tls_error_naming_the_ca_setting(mtls_etcd: EtcdServer, pki: Pki, other_pki: Pki) -> None:
    sec = EtcdSecurity(cacert=other_pki.ca, cert=pki.client_cert, key=pki.client_key)
    with open_store(mtls_etcd.endpoint, sec) as store, pytest.raises(StoreTLSError) as info:
        store.get("/pool/t/x")
    msg = str(info.value)
    assert "not trusted by the CA" in msg and other_pki.ca in msg and "--etcd-cacert" in msg, msg


def test_missing_client_certificate_names_the_cert_setting(mtls_etcd: EtcdServer, pki: Pki) -> None:
    with open_store(mtls_etcd.endpoint, EtcdSecurity(cacert=pki.ca)) as store, pytest.raises(StoreTLSError) as info:
        store.put("/pool/t/x", b"1")
    msg = str(info.value)
    assert "requires a client certificate" in msg and "--etcd-cert" in msg and "--etcd-key" in msg, msg


def test_client_certificate_from_another_ca_is_refused(mtls_etcd: EtcdServer, pki: Pki, other_pki: Pki) -> None:
    sec = EtcdSecurity(cacert=pki.ca, cert=other_pki.client_cert, key=other_pki.client_key)
    with open_store(mtls_etcd.endpoint, sec) as store, pytest.raises(StoreTLSError) as info:
        store.get("/pool/t/x")
    assert "rejected the client certificate" in str(info.value) and other_pki.client_cert in str(info.value)


def test_https_without_a_ca_uses_the_system_roots_and_says_what_to_do(mtls_etcd: EtcdServer) -> None:
    with open_store(mtls_etcd.client_url, None) as store, pytest.raises(StoreTLSError) as info:
        store.get("/pool/t/x")
    assert store.security.use_tls and store.security.cacert is None
    msg = str(info.value)
    assert "system's trust store" in msg and "--etcd-cacert" in msg, msg


def test_plaintext_client_against_tls_etcd_hints_at_tls(mtls_etcd: EtcdServer) -> None:
    with open_store(mtls_etcd.endpoint, EtcdSecurity(), timeout_s=1) as store, pytest.raises(StoreUnavailableError) as info:
        store.get("/pool/t/x")
    assert "https" in str(info.value) and "--etcd-cacert" in str(info.value)


def test_tls_client_against_plaintext_etcd_says_so(etcd_endpoint: str, pki: Pki) -> None:
    with open_store(etcd_endpoint, EtcdSecurity(cacert=pki.ca)) as store, pytest.raises(StoreTLSError) as info:
        store.get("/pool/t/x")
    assert "plaintext" in str(info.value)


# ---------------------------------------------------------------------------------------- settings


def test_settings_errors_name_the_setting(pki: Pki, other_pki: Pki, tmp_path: Path) -> None:
    cases: list[tuple[dict[str, str], str, str]] = [
        ({"cacert": str(tmp_path / "nope.pem")}, "cacert", "does not exist"),
        ({"cacert": pki.client_key}, "cacert", "not a PEM CA certificate"),
        ({"cacert": pki.ca, "cert": pki.client_cert, "key": other_pki.client_key}, "key", "does not go with"),
        ({"cacert": pki.ca, "cert": str(tmp_path)}, "key", "needs its private key"),
    ]
    for kwargs, field, words in cases:
        with pytest.raises(ConfigError) as info:
            EtcdSecurity(**kwargs).load()
        assert info.value.field.startswith(field) and words in str(info.value), (kwargs, str(info.value))
    with pytest.raises(ConfigError, match="without its certificate"):
        EtcdSecurity(key=pki.client_key)
    with pytest.raises(ConfigError, match="without a user"):
        EtcdSecurity(password="x")
    with pytest.raises(ConfigError, match="--etcd-password-file"):
        EtcdSecurity.resolve(user="alice:secret")  # a password in a flag value is visible in `ps`
    with pytest.raises(ConfigError) as info:
        EtcdStore("https://127.0.0.1:1", security=EtcdSecurity(cert=pki.client_cert, key=str(tmp_path / "missing.key")))
    assert info.value.field == "key" and "missing.key" in str(info.value)


def test_http_endpoint_with_tls_settings_is_refused(pki: Pki) -> None:
    with pytest.raises(ConfigError) as info:
        EtcdSecurity(cacert=pki.ca).for_endpoints("http://127.0.0.1:2379")
    assert info.value.field == "endpoints" and "https://" in str(info.value)


def test_precedence_flag_then_gpupool_env_then_etcdctl_env(tmp_path: Path) -> None:
    pw_file = tmp_path / "pw"
    pw_file.write_text("from-file\nignored\n")
    env = {
        "GPUPOOL_ETCD_CACERT": "/env/ca.pem",
        "ETCDCTL_CACERT": "/etcdctl/ca.pem",
        "ETCDCTL_USER": "bob:bob-pw",
        "GPUPOOL_ETCD_CERT": "/env/c.pem",
        "ETCDCTL_KEY": "/etcdctl/c.key",
    }
    s = EtcdSecurity.resolve(cacert="/flag/ca.pem", env=env)
    assert (s.cacert, s.cert, s.key, s.user, s.password) == ("/flag/ca.pem", "/env/c.pem", "/etcdctl/c.key", "bob", "bob-pw")
    assert "bob-pw" not in repr(s)
    # A user given as a flag does not borrow the password of the environment's user:password.
    s = EtcdSecurity.resolve(user="alice", password_file=str(pw_file), env=env)
    assert (s.user, s.password, s.origin("password")) == ("alice", "from-file", f"--etcd-password-file {pw_file}")
    s = EtcdSecurity.resolve(user="alice", env={**env, "GPUPOOL_ETCD_PASSWORD": "env-pw"})
    assert s.password == "env-pw"
    assert EtcdSecurity.from_env({}) == EtcdSecurity()


# ---------------------------------------------------------------------------------------- etcd auth


def test_environment_hands_the_settings_on_without_the_password_text_when_it_came_from_a_file(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    sec = EtcdSecurity.resolve(cacert="/x/ca.pem", cert="/x/c.pem", key="/x/k.pem", user="trainer", password_file=pw, env={})
    env = sec.environment()
    assert env == {"GPUPOOL_ETCD_CACERT": "/x/ca.pem", "GPUPOOL_ETCD_CERT": "/x/c.pem", "GPUPOOL_ETCD_KEY": "/x/k.pem",
                   "GPUPOOL_ETCD_USER": "trainer", "GPUPOOL_ETCD_PASSWORD_FILE": str(pw)}  # fmt: skip
    assert EtcdSecurity.resolve(env=env) == sec  # the child resolves the same settings
    # From the environment: inherited as is, not copied; as an argument: passed in the environment.
    assert "GPUPOOL_ETCD_PASSWORD" not in EtcdSecurity.resolve(env={"GPUPOOL_ETCD_USER": "u", "GPUPOOL_ETCD_PASSWORD": "p"}).environment()
    assert EtcdSecurity.resolve(user="u", password="p", env={}).environment()["GPUPOOL_ETCD_PASSWORD"] == "p"
    assert EtcdSecurity().environment() == {}


def test_right_password_reads_writes_leases_and_watches(auth_etcd: EtcdServer, pki: Pki) -> None:
    sec = EtcdSecurity(cacert=pki.ca, user="alice", password=ALICE_PW)
    with open_store(auth_etcd.client_url, sec) as store:
        got = threading.Event()
        w = store.watch_prefix("/pool/t/", lambda events: got.set())
        assert w.wait_ready(10)
        lease = store.grant_lease(5)
        store.put("/pool/t/k", b"v", lease=lease)
        kv = store.get("/pool/t/k")
        assert kv is not None and kv.value == b"v"
        assert got.wait(10)
        # etcd forgets tokens (restart, TTL): a rejected token is replaced and the call goes through.
        store.stubs().token = "stale.1"
        assert store.get("/pool/t/k") is not None
        assert store.revoke_lease(lease)


def test_wrong_password_is_an_auth_error_naming_the_user(auth_etcd: EtcdServer, pki: Pki) -> None:
    sec = EtcdSecurity(cacert=pki.ca, user="alice", password="wrong")
    with open_store(auth_etcd.client_url, sec) as store, pytest.raises(StoreAuthError) as info:
        store.get("/pool/t/k")
    assert "'alice'" in str(info.value) and "wrong user or password" in str(info.value)


def test_no_user_on_an_auth_etcd_names_the_user_setting(auth_etcd: EtcdServer, pki: Pki) -> None:
    with open_store(auth_etcd.client_url, EtcdSecurity(cacert=pki.ca)) as store, pytest.raises(StoreAuthError) as info:
        store.get("/pool/t/k")
    assert "--etcd-user" in str(info.value)


def test_missing_permission_says_which_grant_is_needed(auth_etcd: EtcdServer, pki: Pki) -> None:
    sec = EtcdSecurity(cacert=pki.ca, user="alice", password=ALICE_PW)
    with open_store(auth_etcd.client_url, sec, prefix="/elsewhere") as store, pytest.raises(StoreAuthError) as info:
        store.put("/elsewhere/k", b"v")
    assert "grant-permission" in str(info.value) and "'alice'" in str(info.value)


# ---------------------------------------------------------------------------------------- command line


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in SECURITY_ENV_VARS and not k.startswith("GPUPOOL_")}
    return subprocess.run(
        [sys.executable, "-m", "gpupool_sdk.cli.main", *args],
        capture_output=True, text=True, cwd=ROOT, env={**base, **(env or {})}, timeout=120,
    )  # fmt: skip


def test_cli_flags_and_password_file(auth_etcd: EtcdServer, mtls_etcd: EtcdServer, pki: Pki, other_pki: Pki, tmp_path: Path) -> None:
    tls = ["--etcd-cacert", pki.ca, "--etcd-cert", pki.client_cert, "--etcd-key", pki.client_key]
    r = _cli("status", "-o", "json", "--endpoints", mtls_etcd.client_url, "--prefix", "/pool/cli", *tls)
    assert r.returncode == 0, r.stderr
    assert "nodes" in json.loads(r.stdout)
    pw = tmp_path / "pw"
    pw.write_text(ROOT_PW + "\n")
    r = _cli("status", "-o", "json", "--endpoints", auth_etcd.client_url, "--prefix", "/pool/cli",
             "--etcd-cacert", pki.ca, "--etcd-user", "root", "--etcd-password-file", str(pw))  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = _cli("status", "--endpoints", auth_etcd.client_url, "--etcd-cacert", pki.ca, "--etcd-user", "root",
             env={"GPUPOOL_ETCD_PASSWORD": "wrong"})  # fmt: skip
    assert r.returncode == 1 and "wrong user or password" in r.stderr, r.stderr
    r = _cli("status", "--endpoints", mtls_etcd.client_url, "--etcd-cacert", other_pki.ca,
             "--etcd-cert", pki.client_cert, "--etcd-key", pki.client_key)  # fmt: skip
    assert r.returncode == 3 and "not trusted by the CA" in r.stderr, r.stderr
    r = _cli("status", "--endpoints", mtls_etcd.client_url, "--etcd-cacert", str(tmp_path / "nope.pem"))
    assert r.returncode == 2 and "--etcd-cacert" in r.stderr and "does not exist" in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------- end to end

TRAINER = textwrap.dedent(
    """
    import json, sys
    from gpupool_sdk import JobSpec, PoolClient

    # No security argument: the client reads GPUPOOL_ENDPOINTS and GPUPOOL_ETCD_* itself.
    with PoolClient(node="tls-node") as pool:
        lease = pool.acquire(JobSpec(name="tls-job", memory="1GiB"), timeout=120)
        print(json.dumps({"lease": lease.etcd_lease_id, "gpus": len(lease.allocations),
                          "grpc_loaded": "grpc" in sys.modules}), flush=True)
        sys.stdin.readline()   # hold the lease until the test says so
        lease.release()
    """
)


RUN_PROBE = textwrap.dedent(
    """
    import json, os
    from gpupool_sdk.store import EtcdStore
    from gpupool_sdk.store.keyspace import Keyspace

    # A connection of the script's own (as its time-slicing gate opens): endpoints, prefix and
    # TLS settings come from the environment gpupool run gave it.
    store = EtcdStore(os.environ["GPUPOOL_ENDPOINTS"], keyspace=Keyspace.from_env(None))
    print(json.dumps({"spec_seen": store.get(store.keys.job_spec(os.environ["GPUPOOL_JOB"])) is not None}), flush=True)
    store.close()
    """
)


def test_pool_client_acquires_a_lease_over_mutual_tls_from_the_environment(
    mtls_etcd: EtcdServer, mtls: EtcdSecurity, pki: Pki, tmp_path: Path
) -> None:
    prefix = "/pool/e2e"
    env = {k: v for k, v in os.environ.items() if k not in SECURITY_ENV_VARS and not k.startswith("GPUPOOL_")}
    env.update({"PYTHONUNBUFFERED": "1", "GPUPOOL_ENDPOINTS": mtls_etcd.client_url, "GPUPOOL_PREFIX": prefix,
                "GPUPOOL_LEASE_TTL": "6", "GPUPOOL_KEEPALIVE_INTERVAL": "1", "GPUPOOL_RETRY_TIMEOUT": "1.5"})
    flags = ["--etcd-cacert", pki.ca, "--etcd-cert", pki.client_cert, "--etcd-key", pki.client_key]
    procs: list[subprocess.Popen[str]] = []

    def spawn(label: str, argv: list[str], extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
        log = open(tmp_path / f"{label}.log", "w")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                             env={**env, **(extra or {})}, cwd=tmp_path, start_new_session=True)  # fmt: skip
        procs.append(p)
        return p

    def logs() -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(tmp_path.glob("*.log")))

    cli = [sys.executable, "-m", "gpupool_sdk.cli.main"]
    store = open_store(mtls_etcd.client_url, mtls, prefix=prefix)
    trainer: subprocess.Popen[str] | None = None
    try:
        # Agent and coordinator get the settings as flags; the trainer only from the environment.
        spawn("coordinator", [*cli, "coordinator", "--ttl", "6", "--loop-wait", "0.3", *flags])
        spawn("agent", [*cli, "agent", "--simulate", "tls-node:2xA100-40GB:pcie", "--ttl", "6", *flags])
        wait_for(lambda: store.get_prefix(store.keys.gpus_prefix())[0], 90, "the agent to publish its GPUs over TLS")
        script = tmp_path / "trainer.py"
        script.write_text(TRAINER)
        trainer = subprocess.Popen(
            [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**env, "GPUPOOL_ETCD_CACERT": pki.ca, "GPUPOOL_ETCD_CERT": pki.client_cert,
                 "GPUPOOL_ETCD_KEY": pki.client_key},
        )  # fmt: skip
        assert trainer.stdout is not None and trainer.stdin is not None
        line = trainer.stdout.readline()
        assert line, f"trainer exited without a lease: {trainer.stderr.read() if trainer.stderr else ''}\n{logs()}"
        report = json.loads(line)
        assert report["gpus"] == 1 and not report["grpc_loaded"]
        allocs = [a for a, _ in store.list_records(store.keys.allocations_prefix(), Allocation)]
        assert [a.job for a in allocs] == ["tls-job"]
        info = store.lease_info(report["lease"])
        assert info is not None and store.keys.job_spec("tls-job") in info.keys
        trainer.stdin.write("\n")
        trainer.stdin.flush()
        assert trainer.wait(60) == 0
        assert store.lease_info(report["lease"]) is None
        # gpupool run given the settings as flags only: the script it starts reaches etcd with them.
        probe = tmp_path / "probe.py"
        probe.write_text(RUN_PROBE)
        r = subprocess.run([*cli, "run", "--name", "tls-run", "--memory", "1GiB", *flags, "--", sys.executable, str(probe)],
                           env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)  # fmt: skip
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n{logs()}"
        assert json.loads(r.stdout.strip().splitlines()[-1]) == {"spec_seen": True}, r.stdout
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        stop_groups(procs, grace_s=15)
        with contextlib.suppress(Exception):
            store.delete_prefix(prefix + "/")
        store.close()


def test_gpupool_etcd_serves_tls_with_given_certificates(pki: Pki, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in SECURITY_ENV_VARS}
    p, port, _ = start_gpupool_etcd(
        ["--data-dir", str(tmp_path / "d"), "--cert-file", pki.server_cert, "--key-file", pki.server_key,
         "--trusted-ca-file", pki.ca],
        env,
    )  # fmt: skip
    try:
        assert p.stdout is not None
        assert f"GPUPOOL_ENDPOINTS=https://127.0.0.1:{port}" in p.stdout.readline()
        sec = EtcdSecurity(cacert=pki.ca, cert=pki.client_cert, key=pki.client_key)
        with open_store(f"https://127.0.0.1:{port}", sec) as store:
            store.put("/pool/etcd-cmd", b"ok")
            kv = store.get("/pool/etcd-cmd")
            assert kv is not None and kv.value == b"ok"
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
