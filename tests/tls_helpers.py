"""A small CA and its certificates, made with the `openssl` CLI (as docs/deploy.md tells operators),
and a cluster secret file: what the security tests give the daemons."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
LEAF_EXT = ("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
            "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Pki:
    """One CA and a certificate (127.0.0.1 / localhost) it signed for the daemons and clients."""

    ca: Path
    cert: Path
    key: Path

    def env(self) -> dict[str, str]:
        return {"MOONCAKED_TLS_CERT": str(self.cert), "MOONCAKED_TLS_KEY": str(self.key),
                "MOONCAKED_TLS_CA": str(self.ca)}


def make_pki(folder: Path, name: str = "node") -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", *EC, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", f"/CN={name}-ca",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=folder)
    _openssl("req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=folder)
    (folder / "leaf.ext").write_text(LEAF_EXT)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", "leaf.ext", cwd=folder)
    for key in ("ca.key", f"{name}.key"):
        os.chmod(folder / key, 0o600)
    return Pki(folder / "ca.crt", folder / f"{name}.crt", folder / f"{name}.key")


def make_token(path: Path, value: str = "0123456789abcdef0123456789abcdef") -> Path:
    path.write_text(value + "\n")
    os.chmod(path, 0o600)
    return path
