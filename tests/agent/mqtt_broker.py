"""A real mosquitto for the MQTT tests: anonymous, or with password authentication and TLS
(certificates made here with `cryptography`: a CA, a server certificate for 127.0.0.1, client
certificates). A missing mosquitto fails the test that needs it, saying so."""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

MOSQUITTO = shutil.which("mosquitto") or next(
    (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if Path(p).is_file()), None)
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd")


def mosquitto() -> str:
    if MOSQUITTO is None:
        pytest.fail("mosquitto is not installed: `make test` installs it (apt-get install "
                    "mosquitto); the MQTT tests need a real broker")
    return MOSQUITTO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing of this broker


def make_pki(d: Path) -> Pki:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        path.chmod(0o600)

    def ca(cn: str, path: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name(cn))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                             crl_sign=True, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cert, key

    def leaf(cn: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
             usage: x509.ObjectIdentifier, cert_path: Path, key_path: Path,
             server: bool) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(issuer[0].subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=2))
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if server:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
        cert_path.write_bytes(b.sign(issuer[1], hashes.SHA256())
                              .public_bytes(serialization.Encoding.PEM))
        write_key(key, key_path)

    root = ca("kvagentd test CA", d / "ca.pem")
    ca("someone else's CA", d / "other-ca.pem")
    leaf("127.0.0.1", root, ExtendedKeyUsageOID.SERVER_AUTH, d / "server.pem", d / "server.key",
         True)
    leaf("kvagentd-box", root, ExtendedKeyUsageOID.CLIENT_AUTH, d / "client.pem",
         d / "client.key", False)
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem",
               d / "client.key", d / "other-ca.pem")


class Broker:
    """mosquitto on a free loopback port. `users`: name -> password (then anonymous clients are
    refused); `pki`: TLS on the listener; `require_certificate`: clients must present one."""

    def __init__(self, d: Path, *, users: dict[str, str] | None = None, pki: Pki | None = None,
                 require_certificate: bool = False, port: int | None = None) -> None:
        self.d, self.users, self.pki = d, users, pki
        self.require_certificate = require_certificate
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        d.mkdir(parents=True, exist_ok=True)

    def start(self) -> Broker:
        lines = ["per_listener_settings false", "persistence false",
                 f"listener {self.port} 127.0.0.1"]
        if os.geteuid() == 0:
            # NOTE: started as root, mosquitto drops to user `mosquitto`, which cannot read
            # the test's private temporary directory.
            lines.insert(0, "user root")
        if self.users is not None:
            if MOSQUITTO_PASSWD is None:
                pytest.fail("mosquitto_passwd is not installed (package mosquitto)")
            pw = self.d / "passwd"
            pw.write_text("")
            for user, password in self.users.items():
                subprocess.run([MOSQUITTO_PASSWD, "-b", str(pw), user, password], check=True,
                               capture_output=True, timeout=30)
            lines += ["allow_anonymous false", f"password_file {pw}"]
        else:
            lines += ["allow_anonymous true"]
        if self.pki is not None:
            lines += [f"cafile {self.pki.ca}", f"certfile {self.pki.server_cert}",
                      f"keyfile {self.pki.server_key}",
                      f"require_certificate {'true' if self.require_certificate else 'false'}"]
        conf = self.d / "mosquitto.conf"
        conf.write_text("\n".join(lines) + "\n")
        self.proc = subprocess.Popen([mosquitto(), "-c", str(conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    pytest.fail(f"mosquitto exited: {err}")
                time.sleep(0.05)
        self.stop()
        pytest.fail("mosquitto did not listen")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def publish(self, topic: str, payload: bytes, *, user: str | None = None,
                password: str | None = None) -> None:
        import paho.mqtt.client as mqtt

        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        if user is not None:
            c.username_pw_set(user, password)
        if self.pki is not None:
            c.tls_set(ca_certs=str(self.pki.ca), certfile=str(self.pki.client_cert),
                      keyfile=str(self.pki.client_key))
        c.connect("127.0.0.1", self.port)
        c.loop_start()
        try:
            c.publish(topic, payload, qos=1).wait_for_publish(5)
        finally:
            c.disconnect()
            c.loop_stop()


def wait_for(cond, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())
