"""Every class of bad input is a 4xx problem naming what is wrong, on every route that takes
that kind of input, never a 500 (real PostgreSQL, which refuses NUL in text and integers past
its columns). Routes and fields are read from the OpenAPI document, so a new route or field is
covered without a new row."""

from __future__ import annotations

import json
import time

import pytest

from app.core.routing import ALIASES
from tests.fixtures.world import CORDONED_H100, auth

FAKE_ID = "00000000-0000-4000-8000-000000000000"


@pytest.fixture
def keys(world, client):
    t = world.tenant("acme")
    out = {"tenant": world.key(t), "operator": world.key(None)}
    # A node agent's credential, for the agent's routes.
    world.fleet(CORDONED_H100)
    op = auth(out["operator"])
    node = client.get("/v1/admin/nodes", headers=op).json()["items"][0]["id"]
    token = client.post(f"/v1/admin/nodes/{node}/join-tokens", headers=op).json()["token"]
    out["node"] = client.post("/v1/agent/join", json={"token": token}).json()["credential"]
    return out


def _doc(app) -> dict:
    return app.openapi()


def _resolve(doc: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].split("/")[-1]]
    return schema


def _types(doc: dict, prop: dict) -> set[str]:
    prop = _resolve(doc, prop)
    out = {prop["type"]} if "type" in prop else set()
    for alt in prop.get("anyOf", []):
        out |= _types(doc, alt)
    return out


def _json_operations(doc: dict):
    """(method, concrete path, body schema) of every operation with a JSON object body."""
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body is None:
                continue
            schema = _resolve(doc, body["schema"])
            if schema.get("type") != "object":
                continue
            concrete = path
            for p in op.get("parameters", []):
                if p["in"] == "path":
                    concrete = concrete.replace("{" + p["name"] + "}", FAKE_ID)
            yield method, concrete, schema


def _key_for(path: str, keys: dict) -> dict:
    if path.startswith("/v1/agent/"):
        return auth(keys["node"])
    return auth(keys["operator"] if path.startswith("/v1/admin") else keys["tenant"])


def _fields(problem: dict) -> set[str]:
    return {e["field"] for e in problem.get("errors", [])}


def test_nul_in_any_text_field_is_a_422_naming_the_field(client, app, keys):
    doc, checked = _doc(app), 0
    for method, path, schema in _json_operations(doc):
        for name, prop in schema.get("properties", {}).items():
            if "string" not in _types(doc, prop):
                continue
            r = client.request(method, path, json={name: "a\x00b"}, headers=_key_for(path, keys))
            assert r.status_code == 422, (method, path, name, r.status_code, r.text)
            assert f"body.{name}" in _fields(r.json()), (method, path, name, r.text)
            checked += 1
    assert checked >= 20
    # Unauthenticated signup too, and the dict keys of labels.
    r = client.post(
        "/v1/signup", json={"name": "a\x00", "slug": "nul-co", "contact_email": "a@b.io"}
    )
    assert r.status_code == 422 and "body.name" in _fields(r.json())
    r = client.post(
        "/v1/workloads",
        json={"kind": "instance", "gpus": 1, "labels": {"a\x00": "b"}},
        headers=auth(keys["tenant"]),
    )
    assert r.status_code == 422 and "body.labels" in _fields(r.json())


def test_integers_past_any_column_are_a_422_naming_the_field(client, app, keys):
    doc, checked = _doc(app), 0
    for method, path, schema in _json_operations(doc):
        for name, prop in schema.get("properties", {}).items():
            if not _types(doc, prop) & {"integer", "number"}:
                continue
            bounds = [_resolve(doc, prop)] + [_resolve(doc, a) for a in prop.get("anyOf", [])]
            top = max(b["maximum"] for b in bounds if "maximum" in b)
            for value in (int(top) + 1, 2**63, -(2**63) - 1):
                r = client.request(method, path, json={name: value}, headers=_key_for(path, keys))
                assert r.status_code == 422, (method, path, name, value, r.text)
                assert f"body.{name}" in _fields(r.json()) or any(
                    f.startswith(f"body.{name}") for f in _fields(r.json())
                ), (method, path, name, r.text)
            checked += 1
    assert checked >= 15


def test_every_request_integer_states_its_range_and_every_text_its_rule(app):
    """The OpenAPI document states the limits: integers with a minimum and a maximum, free
    text with a pattern (no NUL)."""
    doc = _doc(app)
    bad = []

    def walk(node, where, seen):
        if isinstance(node, dict):
            if "$ref" in node:
                name = node["$ref"].split("/")[-1]
                if name not in seen:
                    walk(doc["components"]["schemas"][name], name, seen | {name})
                return
            t = node.get("type")
            if (
                t in ("integer", "number")
                and not (
                    {"maximum", "exclusiveMaximum"} & set(node)
                    and {"minimum", "exclusiveMinimum"} & set(node)
                )
                and "enum" not in node
                and "const" not in node
            ):
                bad.append((where, "unbounded number"))
            if t == "string" and not {"pattern", "format", "enum", "const"} & set(node):
                bad.append((where, "free text without a pattern"))
            for key, value in node.items():
                if key == "properties":
                    for pk, pv in value.items():
                        walk(pv, f"{where}.{pk}", seen)
                elif key not in ("examples", "default"):
                    walk(value, where, seen)
        elif isinstance(node, list):
            for v in node:
                walk(v, where, seen)

    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body:
                walk(body["schema"], f"{method.upper()} {path}", set())
            for p in op.get("parameters", []):
                if p["in"] == "query":
                    walk(p["schema"], f"{method.upper()} {path} ?{p['name']}", set())
    assert not bad, bad


@pytest.mark.parametrize("period", ["9999-12", "0000-01", "2026-13", "2026-1", "", "\x00"])
def test_periods_outside_the_calendar_are_a_422(client, app, keys, period):
    doc, checked = _doc(app), 0
    # A merged route's old URL (app.core.routing.ALIASES) takes the same period, from operators.
    old_urls = {(m.lower(), new): old for m, old, new in ALIASES}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if not any(p["name"] == "period" for p in op.get("parameters", [])):
                continue
            urls = [(path, _key_for(path, keys))]
            if (method, path) in old_urls:
                urls.append((old_urls[(method, path)], auth(keys["operator"])))
            for url, headers in urls:
                r = client.request(method, url, params={"period": period}, headers=headers)
                assert r.status_code == 422, (url, period, r.text)
                assert r.headers["content-type"].startswith("application/problem+json")
                checked += 1
    assert checked >= 4


def test_nul_and_garbage_in_query_strings_are_4xx(client, app, keys):
    doc = _doc(app)
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if method != "get":
                continue
            concrete = path
            for p in op.get("parameters", []):
                if p["in"] == "path":
                    concrete = concrete.replace("{" + p["name"] + "}", FAKE_ID)
            for p in op.get("parameters", []):
                if p["in"] != "query":
                    continue
                for value in ("\x00", "é\\\x01", "9" * 400):
                    r = client.get(
                        concrete, params={p["name"]: value}, headers=_key_for(path, keys)
                    )
                    # NUL is refused everywhere; other odd text is a 4xx or an empty answer.
                    ok = r.status_code < 500 if value != "\x00" else 400 <= r.status_code < 500
                    assert ok, (path, p["name"], value, r.status_code, r.text)


def _import(client, op, text: str, fmt: str):
    ctype = "application/json" if fmt == "json" else "application/yaml"
    return client.post(
        "/v1/admin/fleet:import",
        content=text.encode(),
        headers={**auth(op), "Content-Type": ctype},
    )


def _bomb(levels: int) -> str:
    out = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    for i in range(1, levels):
        prev, cur = chr(96 + i), chr(97 + i)
        out += f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 10) + "]\n"
    return out


@pytest.mark.parametrize(
    "fmt, text, says",
    [
        ("json", "[" * 100_000 + "]" * 100_000, "nests deeper"),
        (
            "json",
            json.dumps(
                {"regions": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}
            ),
            "nests deeper",
        ),
        ("yaml", "[" * 5000 + "]" * 5000, "nests deeper"),
        ("yaml", _bomb(9), "expands to more than"),
    ],
)
def test_fleet_files_are_bounded_in_depth_and_expansion(client, keys, fmt, text, says):
    start = time.process_time()
    r = _import(client, keys["operator"], text, fmt)
    spent = time.process_time() - start
    assert r.status_code == 422, r.text
    assert says in r.text
    assert spent < 5, spent  # refused before any expansion (it burnt 11 s before)


def test_date_times_in_query_strings_are_rfc3339_text(client, app, keys):
    """A bare number is not a date-time (pydantic would read it as epoch seconds)."""
    doc, checked = _doc(app), 0
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            params = op.get("parameters", [])
            when = [
                p
                for p in params
                if _resolve(doc, p["schema"]).get("format") == "date-time"
                or any(a.get("format") == "date-time" for a in p["schema"].get("anyOf", []))
            ]
            for p in when:
                query = {q["name"]: "2026-11-01T00:00:00Z" for q in when}
                query[p["name"]] = "0.5"
                r = client.request(method, path, params=query, headers=_key_for(path, keys))
                assert r.status_code == 422, (path, p["name"], r.text)
                assert f"query.{p['name']}" in _fields(r.json())
                checked += 1
    assert checked >= 8


def test_a_fleet_file_takes_gpu_indices_as_numbers_not_booleans(client, world):
    op = world.key(None)
    doc = {
        "regions": [
            {
                "name": "r1",
                "racks": [
                    {
                        "name": "a",
                        "kind": "hgx",
                        "gpu_model": "H100-80GB",
                        "nodes": [{"name": "n1", "mig_gpus": [False]}],
                    }
                ],
            }
        ]
    }
    r = client.post("/v1/admin/fleet:import", params={"dry_run": True}, json=doc, headers=auth(op))
    assert r.status_code == 422 and "mig_gpus" in r.text
