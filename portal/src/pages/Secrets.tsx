import { useState } from "preact/hooks";
import { asProblem, fieldProblem, gql, isProblem, PROBLEM_FIELDS, when, type Problem, type Session } from "../api";
import { useOwnedList, useRowDelete } from "../owned";
import { Confirm, FieldError, FormProblem } from "../ui";

// The tenant's secrets: values its workloads get as environment variables by name
// (`secretEnv`). A value goes in and never comes out: the page shows names, sizes and versions,
// and clears the value field once it is sent.
const SECRET_FIELDS = "id name size version createdAt updatedAt";
const LIST = `query Secrets($after: String) { secrets(first: 50, after: $after) {
  edges { cursor node { ${SECRET_FIELDS} } }
  pageInfo { hasNextPage endCursor }
} }`;
const PUT = `mutation PutSecret($input: SecretInput!) { putSecret(input: $input) {
  __typename ... on Secret { ${SECRET_FIELDS} } ${PROBLEM_FIELDS}
} }`;
const DELETE = `mutation DeleteSecret($name: String!) { deleteSecret(name: $name) {
  __typename ... on Secret { name } ${PROBLEM_FIELDS}
} }`;

interface Secret {
  id: string;
  name: string;
  size: number;
  version: number;
  createdAt: string;
  updatedAt: string;
}

const FIELDS = ["name", "value"];

export function Secrets({ session }: { session: Session }) {
  const { items: secrets, next, error, load } = useOwnedList<Secret>(LIST, "secrets");
  const { rowProblem, remove: removeRow } = useRowDelete(DELETE, "deleteSecret", () => load());
  const [problem, setProblem] = useState<Problem | null>(null);
  const [busy, setBusy] = useState(false);
  const [saved, setSaved] = useState("");
  const [deleting, setDeleting] = useState<Secret | null>(null);

  const put = async (form: HTMLFormElement) => {
    const field = (n: string) => form.elements.namedItem(n) as HTMLInputElement | HTMLTextAreaElement;
    const input = { name: field("name").value.trim(), value: field("value").value };
    field("value").value = ""; // the value does not stay in the page, whatever the answer
    setBusy(true);
    setProblem(null);
    setSaved("");
    try {
      const d = await gql<{ putSecret: (Secret & { __typename: string }) | Problem }>(PUT, { input });
      const r = d.putSecret;
      if (isProblem(r)) setProblem(r);
      else {
        setSaved(r.version === 1 ? `Saved ${r.name} (${r.size} bytes)` : `Replaced ${r.name}: version ${r.version}, ${r.size} bytes`);
        form.reset();
        load();
      }
    } catch (e) {
      setProblem(asProblem(e));
    } finally {
      setBusy(false);
    }
  };

  const remove = (s: Secret) => {
    setSaved("");
    removeRow(s.name, { name: s.name });
  };

  const bad = (n: string) => fieldProblem(problem, n);
  const canWrite = session.scopes.includes("write") || session.scopes.includes("admin");
  return (
    <>
      <h1>Secrets</h1>
      {error && (
        <p class="error" role="alert">
          {error}
        </p>
      )}
      <div class="grid">
        <section aria-labelledby="secrets-h" class="wide">
          <h2 id="secrets-h">Your secrets</h2>
          <p class="muted">
            Tokens and passwords your workloads get as environment variables, by name (<code>secretEnv</code> when you submit). A value is never
            shown again: replace it to change it.
          </p>
          {!secrets ? (
            !error && <p class="loading">Loading…</p>
          ) : secrets.length === 0 ? (
            <p data-testid="no-secrets">No secrets yet.</p>
          ) : (
            <table data-testid="secrets">
              <thead>
                <tr>
                  <th scope="col">Name</th>
                  <th scope="col">Size</th>
                  <th scope="col">Version</th>
                  <th scope="col">Updated</th>
                  <th scope="col">
                    <span class="visually-hidden">Actions</span>
                  </th>
                </tr>
              </thead>
              <tbody>
                {secrets.map((s) => (
                  <tr data-secret={s.name}>
                    <th scope="row">{s.name}</th>
                    <td>{s.size} bytes</td>
                    <td>{s.version}</td>
                    <td>{when(s.updatedAt)}</td>
                    <td>
                      {canWrite && (
                        <button type="button" aria-haspopup="dialog" aria-label={`Delete ${s.name}`} onClick={() => setDeleting(s)}>
                          Delete
                        </button>
                      )}
                      {rowProblem?.key === s.name && (
                        <span class="error" role="alert">
                          {" "}
                          {rowProblem.text}
                        </span>
                      )}
                    </td>
                  </tr>
                ))}
              </tbody>
            </table>
          )}
          {next && (
            <button type="button" onClick={() => load(next)}>
              Show more secrets
            </button>
          )}
        </section>
        <section aria-labelledby="secret-new-h">
          <h2 id="secret-new-h">Set a secret</h2>
          {!canWrite && <p class="muted">Setting and deleting secrets needs the write scope; this session's key has {session.scopes.join(", ")}.</p>}
          <form
            class="form"
            noValidate
            aria-describedby="secret-problem"
            onSubmit={(e) => {
              e.preventDefault();
              put(e.currentTarget as HTMLFormElement);
            }}
          >
            <FormProblem id="secret-problem" problem={problem} fields={FIELDS} />
            <label for="secret-name">Name (a new one, or one of yours to replace its value)</label>
            <input id="secret-name" name="name" maxLength={63} aria-invalid={!!bad("name")} aria-describedby="secret-name-error" />
            <FieldError id="secret-name-error" message={bad("name")} />
            <label for="secret-value">Value</label>
            <input
              id="secret-value"
              name="value"
              type="password"
              autoComplete="new-password"
              spellcheck={false}
              aria-invalid={!!bad("value")}
              aria-describedby="secret-value-error"
            />
            <FieldError id="secret-value-error" message={bad("value")} />
            <div class="actions">
              <button type="submit" class="primary" disabled={busy}>
                Save secret
              </button>
            </div>
            <p role="status" class="muted" data-testid="secret-saved">
              {saved}
            </p>
          </form>
        </section>
      </div>
      <Confirm
        id="secret-delete"
        open={!!deleting}
        title={`Delete ${deleting?.name ?? "this secret"}?`}
        action="Delete it"
        onCancel={() => setDeleting(null)}
        onConfirm={() => {
          const s = deleting;
          setDeleting(null);
          if (s) remove(s);
        }}
      >
        <p>Workloads that start later can no longer name it. One that has not ended and names it keeps it from being deleted.</p>
      </Confirm>
    </>
  );
}
