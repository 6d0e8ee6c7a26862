"""The webhook's TLS material: a private CA and a serving certificate made with
`cryptography` (the only module that imports it), the certificate directory
(ca.crt, tls.crt, tls.key written atomically, the key 0600) and SSL contexts.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_FILE = "ca.crt"
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
SKEW_S = 60  # certificates start this long before now, for clocks a little behind


@dataclass(frozen=True)
class CertBundle:
    """PEM bytes, as stored in a kubernetes.io/tls Secret."""

    ca_crt: bytes
    tls_crt: bytes
    tls_key: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _sans(names: Sequence[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for name in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def make_bundle(names: Sequence[str], validity_s: float, now_s: float) -> CertBundle:
    """A new CA (valid twice as long as the serving cert) and a serving certificate
    for `names` (DNS names or IP addresses; the first is the common name)."""
    if not names:
        raise ValueError("a serving certificate needs at least one DNS name or IP address")
    start = datetime.datetime.fromtimestamp(now_s - SKEW_S, datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"vgpu-webhook-ca@{int(now_s)}")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(seconds=2 * validity_s + SKEW_S))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0][:64]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(seconds=validity_s + SKEW_S))
        .add_extension(x509.SubjectAlternativeName(_sans(names)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return CertBundle(
        ca_crt=ca_cert.public_bytes(pem),
        tls_crt=cert.public_bytes(pem),
        tls_key=key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


@dataclass(frozen=True)
class CertFacts:
    not_before_s: float
    not_after_s: float
    names: frozenset[str]


def cert_facts(tls_crt: bytes) -> CertFacts:
    """Validity and SAN names of a PEM certificate; ValueError when unreadable."""
    cert = x509.load_pem_x509_certificate(tls_crt)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = {str(v) for v in san.get_values_for_type(x509.DNSName)}
        names |= {str(v) for v in san.get_values_for_type(x509.IPAddress)}
    except x509.ExtensionNotFound:
        names = set()
    return CertFacts(
        cert.not_valid_before_utc.timestamp(),
        cert.not_valid_after_utc.timestamp(),
        frozenset(names),
    )


def check_bundle(bundle: CertBundle) -> None:
    """ValueError unless the key matches the certificate and the CA signed it."""
    cert = x509.load_pem_x509_certificate(bundle.tls_crt)
    ca = x509.load_pem_x509_certificate(bundle.ca_crt)
    key = serialization.load_pem_private_key(bundle.tls_key, password=None)
    if key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) != cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ):
        raise ValueError("tls.key does not match tls.crt")
    try:
        cert.verify_directly_issued_by(ca)
    except Exception as exc:  # InvalidSignature, ValueError, TypeError
        raise ValueError(f"tls.crt is not signed by ca.crt ({type(exc).__name__})") from None


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_cert_dir(directory: Path, bundle: CertBundle) -> None:
    """ca.crt, tls.crt and tls.key (0600), each replaced atomically; the key first,
    the certificate last, so a reader that watches tls.crt sees a matching pair."""
    directory.mkdir(parents=True, exist_ok=True)
    _write_atomic(directory / KEY_FILE, bundle.tls_key, 0o600)
    _write_atomic(directory / CA_FILE, bundle.ca_crt, 0o644)
    _write_atomic(directory / CERT_FILE, bundle.tls_crt, 0o644)


def read_cert_dir(directory: Path) -> CertBundle | None:
    """The bundle in the directory (a mounted Secret), or None when a file is missing."""
    try:
        return CertBundle(
            ca_crt=(directory / CA_FILE).read_bytes() if (directory / CA_FILE).exists() else b"",
            tls_crt=(directory / CERT_FILE).read_bytes(),
            tls_key=(directory / KEY_FILE).read_bytes(),
        )
    except FileNotFoundError:
        return None


def server_context(directory: Path) -> ssl.SSLContext:
    """A TLS 1.2+ server context from the directory's tls.crt and tls.key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(directory / CERT_FILE, directory / KEY_FILE)
    # No TLS 1.3 session tickets: every connection is closed after one answer, so
    # they are never used, and asyncio sends them late (a 40 ms delayed-ACK stall).
    context.num_tickets = 0
    return context
