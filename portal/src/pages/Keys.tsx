import { useEffect, useRef, useState } from "preact/hooks";
import { asProblem, fieldProblem, gql, isProblem, PROBLEM_FIELDS, when, type Problem, type Session } from "../api";
import { Confirm, FieldError, FormProblem } from "../ui";

const KEY_FIELDS = "id name prefix scopes createdAt lastUsedAt revokedAt expiresAt";
const LIST = `query Keys($after: String) { apiKeys(first: 50, after: $after) {
  edges { cursor node { ${KEY_FIELDS} } }
  pageInfo { hasNextPage endCursor }
} }`;
const CREATE = `mutation CreateKey($input: ApiKeyInput!) { createApiKey(input: $input) {
  __typename ... on NewApiKey { ${KEY_FIELDS} key } ${PROBLEM_FIELDS}
} }`;
const REVOKE = `mutation RevokeKey($id: ID!) { revokeApiKey(id: $id) {
  __typename ... on ApiKey { ${KEY_FIELDS} } ${PROBLEM_FIELDS}
} }`;

interface Key {
  id: string;
  name: string;
  prefix: string;
  scopes: string[];
  createdAt: string;
  lastUsedAt: string | null;
  revokedAt: string | null;
  expiresAt: string | null;
}
interface Page {
  apiKeys: { edges: { cursor: string; node: Key }[]; pageInfo: { hasNextPage: boolean; endCursor: string | null } };
}

const SCOPES: [string, string][] = [
  ["read", "read: see workloads, usage, bills and keys"],
  ["write", "write: submit and terminate workloads, set the budget (and read)"],
  ["admin", "admin: create and revoke keys (and write)"],
];
const FIELDS = ["name", "scopes", "expiresAt"];

function status(k: Key): string {
  if (k.revokedAt) return "revoked";
  if (k.expiresAt && Date.parse(k.expiresAt) <= Date.now()) return "expired";
  return "active";
}

export function Keys({ session }: { session: Session }) {
  const [keys, setKeys] = useState<Key[] | null>(null);
  const [next, setNext] = useState<string | null>(null);
  const [error, setError] = useState("");
  const [problem, setProblem] = useState<Problem | null>(null);
  const [busy, setBusy] = useState(false);
  // The secret of the key just made: here while it is shown, dropped when dismissed or when the
  // page is left (never anywhere else: not in the list, not in storage).
  const [secret, setSecret] = useState<{ name: string; key: string } | null>(null);
  const [copied, setCopied] = useState("");
  const [revoking, setRevoking] = useState<Key | null>(null);
  const [rowProblem, setRowProblem] = useState<{ id: string; text: string } | null>(null);
  const shown = useRef<HTMLHeadingElement>(null);

  const load = async (after: string | null = null) => {
    try {
      const d = await gql<Page>(LIST, { after });
      const got = d.apiKeys.edges.map((e) => e.node);
      setKeys((old) => (after && old ? [...old, ...got] : got));
      setNext(d.apiKeys.pageInfo.hasNextPage ? d.apiKeys.pageInfo.endCursor : null);
      setError("");
    } catch (e) {
      const p = asProblem(e);
      setError(`${p.message} (${p.code})`);
    }
  };
  useEffect(() => {
    load();
  }, []);
  useEffect(() => {
    if (secret) shown.current?.focus();
  }, [secret]);

  const create = async (form: HTMLFormElement) => {
    const v = (n: string) => (form.elements.namedItem(n) as HTMLInputElement).value.trim();
    const scopes = SCOPES.map(([s]) => s).filter((s) => (form.elements.namedItem(`scope-${s}`) as HTMLInputElement).checked);
    const input: Record<string, unknown> = { name: v("name"), scopes };
    if (v("expiresAt")) {
      const at = new Date(v("expiresAt")); // the field's local time, sent in UTC
      if (Number.isNaN(at.getTime())) {
        setProblem({ __typename: "Local", code: "validation_error", message: "", fields: [{ path: ["input", "expiresAt"], message: "Enter a date and time." }] });
        return;
      }
      input.expiresAt = at.toISOString();
    }
    setBusy(true);
    setProblem(null);
    setSecret(null);
    setCopied("");
    try {
      const d = await gql<{ createApiKey: (Key & { __typename: string; key: string }) | Problem }>(CREATE, { input });
      const r = d.createApiKey;
      if (isProblem(r)) setProblem(r);
      else {
        setSecret({ name: r.name, key: r.key });
        form.reset();
        load();
      }
    } catch (e) {
      setProblem(asProblem(e));
    } finally {
      setBusy(false);
    }
  };

  const revoke = async (k: Key) => {
    setRowProblem(null);
    try {
      const d = await gql<{ revokeApiKey: (Key & { __typename: string }) | Problem }>(REVOKE, { id: k.id });
      const r = d.revokeApiKey;
      if (isProblem(r)) setRowProblem({ id: k.id, text: `${r.message} (${r.code})` });
      else load();
    } catch (e) {
      const p = asProblem(e);
      setRowProblem({ id: k.id, text: `${p.message} (${p.code})` });
    }
  };

  const copy = async () => {
    if (!secret) return;
    try {
      await navigator.clipboard.writeText(secret.key);
      setCopied("Copied to the clipboard.");
    } catch {
      setCopied("The browser did not allow copying: select the key and copy it yourself.");
    }
  };

  const bad = (n: string) => fieldProblem(problem, n);
  const isAdmin = session.scopes.includes("admin");
  return (
    <>
      <h1>API keys</h1>
      {error && (
        <p class="error" role="alert">
          {error}
        </p>
      )}
      {secret && (
        <section class="secret" aria-labelledby="secret-h" data-testid="new-key">
          <h2 id="secret-h" tabIndex={-1} ref={shown}>
            Your new key “{secret.name}”
          </h2>
          <p class="warn" id="secret-warning">
            <strong>Copy it now: this is the only time it is shown.</strong> Only a hash of it is stored, so it cannot be shown
            again; if it is lost, revoke it and create another.
          </p>
          <p>
            <code class="key" data-testid="new-key-secret" aria-describedby="secret-warning">
              {secret.key}
            </code>
          </p>
          <div class="actions">
            <button type="button" class="primary" onClick={copy}>
              Copy the key
            </button>
            <button
              type="button"
              onClick={() => {
                setSecret(null);
                setCopied("");
              }}
            >
              I have saved it: hide it
            </button>
          </div>
          <p role="status" class="muted">
            {copied}
          </p>
        </section>
      )}
      <div class="grid">
        <section aria-labelledby="keys-h" class="wide">
          <h2 id="keys-h">Your keys</h2>
          {!keys ? (
            !error && <p class="loading">Loading…</p>
          ) : (
            <table data-testid="keys">
              <thead>
                <tr>
                  <th scope="col">Name</th>
                  <th scope="col">Key</th>
                  <th scope="col">Scopes</th>
                  <th scope="col">Status</th>
                  <th scope="col">Created</th>
                  <th scope="col">Last used</th>
                  <th scope="col">Expires</th>
                  <th scope="col">
                    <span class="visually-hidden">Actions</span>
                  </th>
                </tr>
              </thead>
              <tbody>
                {keys.map((k) => {
                  const st = status(k);
                  const mine = k.prefix === session.key_prefix;
                  return (
                    <tr data-key={k.prefix} data-status={st}>
                      <th scope="row">
                        {k.name}
                        {mine && <span class="tag">this session</span>}
                      </th>
                      <td>
                        <code>rp_{k.prefix}…</code>
                      </td>
                      <td>{k.scopes.join(", ")}</td>
                      <td>
                        <span class={`state state-key-${st}`}>{st}</span>
                      </td>
                      <td>{when(k.createdAt)}</td>
                      <td>{when(k.lastUsedAt)}</td>
                      <td>{k.expiresAt ? when(k.expiresAt) : "never"}</td>
                      <td>
                        {st !== "revoked" && (
                          <button type="button" aria-haspopup="dialog" aria-label={`Revoke ${k.name} (rp_${k.prefix}…)`} onClick={() => setRevoking(k)}>
                            Revoke
                          </button>
                        )}
                        {rowProblem?.id === k.id && (
                          <span class="error" role="alert">
                            {" "}
                            {rowProblem.text}
                          </span>
                        )}
                      </td>
                    </tr>
                  );
                })}
              </tbody>
            </table>
          )}
          {next && (
            <button type="button" onClick={() => load(next)}>
              Show more keys
            </button>
          )}
        </section>
        <section aria-labelledby="new-h">
          <h2 id="new-h">Create a key</h2>
          {!isAdmin && <p class="muted">Creating and revoking keys needs the admin scope; this session's key has {session.scopes.join(", ")}.</p>}
          <form
            class="form"
            noValidate
            aria-describedby="key-problem"
            onSubmit={(e) => {
              e.preventDefault();
              create(e.currentTarget as HTMLFormElement);
            }}
          >
            <FormProblem id="key-problem" problem={problem} fields={FIELDS} />
            <label for="key-name">Name</label>
            <input id="key-name" name="name" maxLength={200} aria-invalid={!!bad("name")} aria-describedby="key-name-error" />
            <FieldError id="key-name-error" message={bad("name")} />
            <fieldset aria-invalid={!!bad("scopes")} aria-describedby="key-scopes-error">
              <legend>Scopes</legend>
              {SCOPES.map(([s, text]) => (
                <label class="check">
                  <input type="checkbox" name={`scope-${s}`} defaultChecked={s !== "admin"} />
                  {text}
                </label>
              ))}
              <FieldError id="key-scopes-error" message={bad("scopes")} />
            </fieldset>
            <label for="key-expires">Expires (optional, your local time)</label>
            <input id="key-expires" name="expiresAt" type="datetime-local" aria-invalid={!!bad("expiresAt")} aria-describedby="key-expires-error" />
            <FieldError id="key-expires-error" message={bad("expiresAt")} />
            <div class="actions">
              <button type="submit" class="primary" disabled={busy}>
                Create key
              </button>
            </div>
          </form>
        </section>
      </div>
      <Confirm
        id="revoke"
        open={!!revoking}
        title={`Revoke ${revoking?.name ?? "this key"}?`}
        action="Revoke it"
        onCancel={() => setRevoking(null)}
        onConfirm={() => {
          const k = revoking;
          setRevoking(null);
          if (k) revoke(k);
        }}
      >
        <p>
          Requests with <code>rp_{revoking?.prefix}…</code> are refused from now on, and its browser sessions end.
          {revoking?.prefix === session.key_prefix && <strong> It is the key of this session: you will be signed out.</strong>} A revoked key
          cannot be restored.
        </p>
      </Confirm>
    </>
  );
}
