"""Tenants' SSH keys: what is taken and what is refused (real keys, made here), REST and GraphQL
over the one service, tenant isolation, and a pasted private key that is refused and leaves
no trace: not stored, not in the answer, the audit log or the logs."""

from __future__ import annotations

import base64
import json
import shutil
import struct
import subprocess
from functools import cache

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from app.keys.ssh import parse_public_key
from tests.fixtures.graphql import gql
from tests.fixtures.world import auth

OPENSSH = serialization.Encoding.OpenSSH


@cache
def private(kind: str):
    """A private key of a kind, made once per run (RSA takes a moment)."""
    if kind == "ed25519":
        return ed25519.Ed25519PrivateKey.generate()
    if kind.startswith("ecdsa-"):
        curve = {"256": ec.SECP256R1, "384": ec.SECP384R1, "521": ec.SECP521R1}[kind[6:]]
        return ec.generate_private_key(curve())
    return rsa.generate_private_key(public_exponent=65537, key_size=int(kind[4:]))


def public(kind: str, comment: str | None = None) -> str:
    line = (
        private(kind)
        .public_key()
        .public_bytes(OPENSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )
    return f"{line} {comment}" if comment else line


def private_text(kind: str, fmt: str = "openssh") -> str:
    formats = {
        "openssh": serialization.PrivateFormat.OpenSSH,
        "pkcs8": serialization.PrivateFormat.PKCS8,
        "traditional": serialization.PrivateFormat.TraditionalOpenSSL,
    }
    return (
        private(kind)
        .private_bytes(serialization.Encoding.PEM, formats[fmt], serialization.NoEncryption())
        .decode()
    )


def wire(*parts: bytes) -> str:
    return base64.b64encode(b"".join(struct.pack(">I", len(p)) + p for p in parts)).decode()


@cache
def dsa_public() -> str | None:
    """A DSA public key from ssh-keygen, where this OpenSSH still makes one."""
    import tempfile
    from pathlib import Path

    if shutil.which("ssh-keygen") is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "dsa"
        made = subprocess.run(
            ["ssh-keygen", "-q", "-t", "dsa", "-N", "", "-f", str(path)],
            capture_output=True,
            timeout=60,
        )
        return path.with_suffix(".pub").read_text() if made.returncode == 0 else None


def keygen_fingerprint(line: str, tmp_path) -> str | None:
    """`ssh-keygen -l`'s fingerprint of a public key line (None without ssh-keygen)."""
    if shutil.which("ssh-keygen") is None:
        return None
    f = tmp_path / "k.pub"
    f.write_text(line + "\n")
    out = subprocess.run(["ssh-keygen", "-l", "-f", str(f)], capture_output=True, text=True)
    return out.stdout.split()[1]


# (label, the text pasted, the refusal's code or None and the bits taken)
ACCEPTED = [
    ("ed25519", lambda: public("ed25519", "me@laptop"), "ssh-ed25519", 256),
    ("ecdsa-256", lambda: public("ecdsa-256"), "ecdsa-sha2-nistp256", 256),
    ("ecdsa-384", lambda: public("ecdsa-384"), "ecdsa-sha2-nistp384", 384),
    ("ecdsa-521", lambda: public("ecdsa-521"), "ecdsa-sha2-nistp521", 521),
    ("rsa-3072", lambda: public("rsa-3072", "ci"), "ssh-rsa", 3072),
    ("with its .pub line break", lambda: public("ed25519") + "\n", "ssh-ed25519", 256),
]
REFUSED = [
    ("rsa-2048", lambda: public("rsa-2048"), "ssh_key_too_weak"),
    ("an openssh private key", lambda: private_text("ed25519"), "ssh_key_is_private"),
    ("a pkcs8 private key", lambda: private_text("ecdsa-256", "pkcs8"), "ssh_key_is_private"),
    (
        "an rsa pem private key",
        lambda: private_text("rsa-3072", "traditional"),
        "ssh_key_is_private",
    ),
    (
        "a private key after its public one",
        lambda: public("ed25519") + "\n" + private_text("ed25519"),
        "ssh_key_is_private",
    ),
    ("putty's private key", lambda: "PuTTY-User-Key-File-3: ssh-ed25519\n", "ssh_key_is_private"),
    (
        "a security key's type",
        lambda: (
            "sk-ssh-ed25519@openssh.com " + wire(b"sk-ssh-ed25519@openssh.com", b"k" * 32, b"ssh:")
        ),
        "ssh_key_type_unsupported",
    ),
    ("garbage", lambda: "hello there", "ssh_key_invalid"),
    (
        "a comment with control characters",
        lambda: public("ed25519", "me\x1b[2J"),
        "ssh_key_invalid",
    ),
    ("one word", lambda: "ssh-ed25519", "ssh_key_invalid"),
    ("not base64", lambda: "ssh-ed25519 AAAA$$$", "ssh_key_invalid"),
    ("two keys", lambda: public("ed25519") + "\n" + public("ecdsa-256"), "ssh_key_invalid"),
    (
        "a type the key does not have",
        lambda: "ssh-ed25519 " + public("ecdsa-256").split()[1],
        "ssh_key_invalid",
    ),
    (
        "a truncated key",
        lambda: "ssh-ed25519 " + wire(b"ssh-ed25519", b"short"),
        "ssh_key_invalid",
    ),
    (
        "a PEM public key",
        lambda: (
            private("ed25519")
            .public_key()
            .public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            .decode()
        ),
        "ssh_key_invalid",
    ),
]


@pytest.mark.parametrize(
    ("label", "text", "key_type", "bits"), ACCEPTED, ids=[a[0] for a in ACCEPTED]
)
def test_accepted_keys_are_stored_normalised_with_ssh_keygens_fingerprint(
    label, text, key_type, bits, tmp_path
):
    sent = text()
    got = parse_public_key(sent)
    assert (got.key_type, got.bits) == (key_type, bits)
    type_, b64, *comment = sent.split(None, 2)
    assert got.public_key == f"{type_} {b64}"
    assert got.comment == (comment[0].strip() if comment else None)
    want = keygen_fingerprint(got.public_key, tmp_path)
    assert got.fingerprint.startswith("SHA256:") and (want is None or got.fingerprint == want)


@pytest.mark.parametrize(("label", "text", "code"), REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_keys_say_why_with_a_code(label, text, code):
    from app.keys.ssh import SshKeyRefused

    sent = text()
    with pytest.raises(SshKeyRefused) as refused:
        parse_public_key(sent)
    assert refused.value.code == code and refused.value.status == 422
    # The refusal never quotes what was sent (a key type name at most).
    body = [ln for ln in sent.splitlines() if len(ln) > 20]
    assert not any(ln in refused.value.detail for ln in body)


def test_dsa_is_refused_as_unsupported():
    from app.keys.ssh import SshKeyRefused

    line = dsa_public()
    if line is None:
        pytest.skip("this ssh-keygen makes no DSA keys")
    with pytest.raises(SshKeyRefused) as refused:
        parse_public_key(line)
    assert refused.value.code == "ssh_key_type_unsupported" and "ssh-dss" in refused.value.detail


def _add(client, key, name, public_key, status=201):
    r = client.post(
        "/v1/ssh-keys", json={"name": name, "public_key": public_key}, headers=auth(key)
    )
    assert r.status_code == status, r.text
    return r.json()


def test_a_tenant_adds_lists_reads_and_deletes_its_keys_over_rest(client, world, session, tmp_path):
    from sqlalchemy import select

    from app.models.audit import AuditEntry

    key = world.key(world.tenant("acme"), scopes=("read", "write"))
    line = public("ed25519", "me@laptop")
    made = _add(client, key, "laptop", line + "\n")
    assert made["name"] == "laptop" and made["key_type"] == "ssh-ed25519" and made["bits"] == 256
    assert made["public_key"] == " ".join(line.split()[:2]) and made["comment"] == "me@laptop"
    want = keygen_fingerprint(line, tmp_path)
    assert want is None or made["fingerprint"] == want
    ci = _add(client, key, "ci.rsa-3072", public("rsa-3072"))
    assert ci["bits"] == 3072 and ci["comment"] is None

    page = client.get("/v1/ssh-keys", params={"limit": 1}, headers=auth(key)).json()
    assert [k["name"] for k in page["items"]] == ["laptop"] and page["next_cursor"]
    rest = client.get(
        "/v1/ssh-keys", params={"cursor": page["next_cursor"]}, headers=auth(key)
    ).json()
    assert [k["name"] for k in rest["items"]] == ["ci.rsa-3072"] and rest["next_cursor"] is None
    assert client.get(f"/v1/ssh-keys/{made['id']}", headers=auth(key)).json() == made

    r = client.delete(f"/v1/ssh-keys/{made['id']}", headers=auth(key))
    assert r.status_code == 204 and r.content == b""
    r = client.get(f"/v1/ssh-keys/{made['id']}", headers=auth(key))
    assert r.status_code == 404 and r.json()["code"] == "ssh_key_not_found"
    r = client.delete(f"/v1/ssh-keys/{made['id']}", headers=auth(key))
    assert r.status_code == 404 and r.json()["code"] == "ssh_key_not_found"
    # Its name and the key itself are free again.
    _add(client, key, "laptop", line)

    # The audit log: the add and the delete, each on the key.
    rows = session.execute(
        select(AuditEntry.action, AuditEntry.status, AuditEntry.target_type, AuditEntry.target_id)
        .where(AuditEntry.action.like("% /v1/ssh-keys%"))
        .order_by(AuditEntry.created_at)
    ).all()
    assert [tuple(r) for r in rows[:3]] == [
        ("POST /v1/ssh-keys", 201, "ssh_key", made["id"]),
        ("POST /v1/ssh-keys", 201, "ssh_key", ci["id"]),
        ("DELETE /v1/ssh-keys/{ssh_key_id}", 204, "ssh_key", made["id"]),
    ]


def test_refusals_over_rest_name_their_code_and_field(client, world):
    key = world.key(world.tenant("acme"), scopes=("read", "write"))
    line = public("ed25519")
    _add(client, key, "laptop", line)
    r = client.post(
        "/v1/ssh-keys",
        json={"name": "laptop", "public_key": public("ecdsa-256")},
        headers=auth(key),
    )
    assert r.status_code == 409 and r.json()["code"] == "ssh_key_name_taken", r.text
    r = client.post(
        "/v1/ssh-keys", json={"name": "again", "public_key": line + " other"}, headers=auth(key)
    )
    assert r.status_code == 409 and r.json()["code"] == "ssh_key_exists", r.text
    assert "laptop" in r.json()["detail"]
    r = client.post(
        "/v1/ssh-keys", json={"name": "old", "public_key": public("rsa-2048")}, headers=auth(key)
    )
    assert r.status_code == 422 and r.json()["code"] == "ssh_key_too_weak", r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["errors"][0]["field"] == "body.public_key"
    assert "3072" in r.json()["detail"]
    for name in ("", "a" * 64, "has space", "ünïcode", "semi;colon"):
        r = client.post("/v1/ssh-keys", json={"name": name, "public_key": line}, headers=auth(key))
        assert r.status_code == 422 and r.json()["code"] == "validation_error", name
        assert r.json()["errors"][0]["field"] == "body.name"
    # A read key reads, and may not add or delete.
    reader = world.key(world.tenant("globex"), scopes=("read",))
    assert client.get("/v1/ssh-keys", headers=auth(reader)).status_code == 200
    r = client.post("/v1/ssh-keys", json={"name": "x", "public_key": line}, headers=auth(reader))
    assert r.status_code == 403 and r.json()["code"] == "insufficient_scope"


def test_a_pasted_private_key_is_refused_and_leaves_no_trace(client, world, session, caplog):
    from sqlalchemy import func, select, text

    from app.models.keys import SshKey

    key = world.key(world.tenant("acme"), scopes=("read", "write"))
    secret = private_text("ed25519")
    armour = [ln for ln in secret.splitlines() if ln and not ln.startswith("-----")]
    caplog.set_level("DEBUG")
    r = client.post(
        "/v1/ssh-keys",
        json={"name": "oops", "public_key": secret},
        headers={**auth(key), "Idempotency-Key": "paste-1"},
    )
    assert r.status_code == 422 and r.json()["code"] == "ssh_key_is_private", r.text
    assert "not stored" in r.json()["detail"]
    body = gql(
        client,
        key,
        "mutation($i: SshKeyInput!) { addSshKey(input: $i) { __typename "
        "... on Problem { code message } ... on ValidationProblem { fields { path message } } } }",
        i={"name": "oops", "publicKey": secret},
    )
    problem = body["data"]["addSshKey"]
    assert problem["__typename"] == "ValidationProblem" and problem["code"] == "ssh_key_is_private"
    assert problem["fields"][0]["path"] == ["input", "publicKey"]
    # Nowhere: not stored, not in either answer, the audit log, the logs or any table's text.
    session.expire_all()
    assert session.scalar(select(func.count()).select_from(SshKey)) == 0
    assert not any(ln in r.text or ln in json.dumps(body) for ln in armour)
    logged = caplog.text + "".join(str(rec.msg) for rec in caplog.records)
    assert not any(ln in logged for ln in armour)
    dump = session.execute(
        text("SELECT coalesce(string_agg(a::text, ' '), '') FROM audit_log a")
    ).scalar_one()
    assert "ssh-keys" in dump and "addSshKey" in dump  # both refusals are recorded
    assert not any(ln in dump for ln in armour)
    idem = session.execute(
        text("SELECT coalesce(string_agg(i::text, ' '), '') FROM idempotency_records i")
    ).scalar_one()
    assert not any(ln in idem for ln in armour)


def test_graphql_adds_lists_and_deletes_with_rests_codes(client, world):
    acme = world.tenant("acme")
    key = world.key(acme, scopes=("read", "write"))
    add = (
        "mutation($i: SshKeyInput!) { addSshKey(input: $i) { __typename "
        "... on SshKey { id name keyType bits fingerprint publicKey comment } "
        "... on Problem { code message } ... on ValidationProblem { fields { path message } } } }"
    )
    made = gql(client, key, add, i={"name": "laptop", "publicKey": public("ecdsa-384", "me")})
    made = made["data"]["addSshKey"]
    assert made["__typename"] == "SshKey" and (made["keyType"], made["bits"]) == (
        "ecdsa-sha2-nistp384",
        384,
    )
    rest = client.get(f"/v1/ssh-keys/{made['id']}", headers=auth(key)).json()
    assert (rest["fingerprint"], rest["public_key"], rest["comment"]) == (
        made["fingerprint"],
        made["publicKey"],
        "me",
    )
    cases = [
        (
            {"name": "laptop", "publicKey": public("ed25519")},
            "ConflictProblem",
            "ssh_key_name_taken",
        ),
        ({"name": "x", "publicKey": public("ecdsa-384")}, "ConflictProblem", "ssh_key_exists"),
        ({"name": "x", "publicKey": public("rsa-2048")}, "ValidationProblem", "ssh_key_too_weak"),
        ({"name": "x", "publicKey": "nope"}, "ValidationProblem", "ssh_key_invalid"),
        (
            {"name": "bad name", "publicKey": public("ed25519")},
            "ValidationProblem",
            "validation_error",
        ),
    ]
    for i, typename, code in cases:
        got = gql(client, key, add, i=i)["data"]["addSshKey"]
        assert (got["__typename"], got["code"]) == (typename, code), (i, got)
    listed = gql(client, key, "{ sshKeys { edges { node { id name } } pageInfo { hasNextPage } } }")
    assert [e["node"]["name"] for e in listed["data"]["sshKeys"]["edges"]] == ["laptop"]

    delete = (
        "mutation($id: ID!) { deleteSshKey(id: $id) { __typename "
        "... on SshKey { id name } ... on Problem { code } } }"
    )
    reader = world.key(acme, scopes=("read",))
    refused = gql(client, reader, delete, id=made["id"])["data"]["deleteSshKey"]
    assert refused == {"__typename": "ForbiddenProblem", "code": "insufficient_scope"}
    gone = gql(client, key, delete, id=made["id"])["data"]["deleteSshKey"]
    assert gone == {"__typename": "SshKey", "id": made["id"], "name": "laptop"}
    again = gql(client, key, delete, id=made["id"])["data"]["deleteSshKey"]
    assert again == {"__typename": "NotFoundProblem", "code": "ssh_key_not_found"}
    assert client.get("/v1/ssh-keys", headers=auth(key)).json()["items"] == []


def test_another_tenants_keys_are_not_found_and_operators_see_a_tenants(client, world):
    a, b = world.tenant("acme"), world.tenant("globex")
    a_key, b_key, op = world.key(a), world.key(b), world.key(None)
    line = public("ed25519")
    mine = _add(client, a_key, "laptop", line)
    # The same key and name in another account are that account's own.
    theirs = _add(client, b_key, "laptop", line)
    assert theirs["fingerprint"] == mine["fingerprint"] and theirs["id"] != mine["id"]

    for method in ("GET", "DELETE"):
        r = client.request(method, f"/v1/ssh-keys/{mine['id']}", headers=auth(b_key))
        assert r.status_code == 404 and r.json()["code"] == "ssh_key_not_found", r.text
    body = gql(
        client,
        b_key,
        f'mutation {{ deleteSshKey(id: "{mine["id"]}") {{ ... on Problem {{ code }} }} }}',
    )
    assert body["data"]["deleteSshKey"] == {"code": "ssh_key_not_found"}
    listed = client.get("/v1/ssh-keys", headers=auth(b_key)).json()["items"]
    assert [k["id"] for k in listed] == [theirs["id"]]
    gql_listed = gql(client, b_key, "{ sshKeys { edges { node { id } } } }")
    assert mine["id"] not in json.dumps(gql_listed)
    # Operators: not through the tenant routes, but a tenant's list and any key's deletion.
    r = client.get("/v1/ssh-keys", headers=auth(op))
    assert r.status_code == 403 and r.json()["code"] == "tenant_key_required"
    r = client.get(f"/v1/admin/tenants/{a.id}/ssh-keys", headers=auth(op))
    assert [k["id"] for k in r.json()["items"]] == [mine["id"]]
    r = client.get(f"/v1/admin/tenants/{a.id}/ssh-keys", headers=auth(a_key))
    assert r.status_code == 403 and r.json()["code"] == "platform_scope_required"
    assert client.delete(f"/v1/admin/ssh-keys/{mine['id']}", headers=auth(op)).status_code == 204
    assert client.get(f"/v1/ssh-keys/{mine['id']}", headers=auth(a_key)).status_code == 404
    assert client.get(f"/v1/ssh-keys/{theirs['id']}", headers=auth(b_key)).status_code == 200


def test_an_add_that_loses_the_race_to_the_constraint_says_which(world):
    """Two transactions add the name at once: the second waits on the unique index until the
    first commits, then is refused with the check's own code, not a bare conflict."""
    import threading

    from app.core.db import get_sessionmaker
    from app.core.errors import Conflict
    from app.keys.ssh_keys import add_ssh_key

    acme = world.tenant("acme")
    first, second = get_sessionmaker()(), get_sessionmaker()()
    try:
        add_ssh_key(first, tenant_id=acme.id, name="laptop", public_key=public("ed25519"))
        outcome: list[object] = []

        def race():
            try:
                add_ssh_key(
                    second, tenant_id=acme.id, name="laptop", public_key=public("ecdsa-256")
                )
                outcome.append("added")
            except Conflict as e:
                outcome.append(e.code)

        racer = threading.Thread(target=race)
        racer.start()
        racer.join(timeout=1.0)
        assert racer.is_alive(), "the second add did not wait for the first's row"
        first.commit()
        racer.join(timeout=30)
        assert outcome == ["ssh_key_name_taken"]
    finally:
        second.rollback()
        first.close()
        second.close()
