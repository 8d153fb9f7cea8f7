import { useState } from "preact/hooks";
import { asProblem, fieldProblem, gql, isProblem, PROBLEM_FIELDS, when, type Problem, type Session } from "../api";
import { useOwnedList, useRowDelete } from "../owned";
import { Confirm, FieldError, FormProblem } from "../ui";

// The tenant's SSH public keys: the instances it launches take them by name. The API reads and
// refuses the pasted text (`ssh_key_is_private`, `ssh_key_too_weak`...); the page shows its words
// under the field and never keeps the text once sent.
const SSH_FIELDS = "id name keyType bits fingerprint comment createdAt";
const LIST = `query SshKeys($after: String) { sshKeys(first: 50, after: $after) {
  edges { cursor node { ${SSH_FIELDS} } }
  pageInfo { hasNextPage endCursor }
} }`;
const ADD = `mutation AddSshKey($input: SshKeyInput!) { addSshKey(input: $input) {
  __typename ... on SshKey { ${SSH_FIELDS} } ${PROBLEM_FIELDS}
} }`;
const DELETE = `mutation DeleteSshKey($id: ID!) { deleteSshKey(id: $id) {
  __typename ... on SshKey { id name } ${PROBLEM_FIELDS}
} }`;

interface SshKey {
  id: string;
  name: string;
  keyType: string;
  bits: number;
  fingerprint: string;
  comment: string | null;
  createdAt: string;
}

const FIELDS = ["name", "publicKey"];

export function SshKeys({ session }: { session: Session }) {
  const { items: keys, next, error, load } = useOwnedList<SshKey>(LIST, "sshKeys");
  const { rowProblem, remove: removeRow } = useRowDelete(DELETE, "deleteSshKey", () => load());
  const [problem, setProblem] = useState<Problem | null>(null);
  const [busy, setBusy] = useState(false);
  const [added, setAdded] = useState("");
  const [deleting, setDeleting] = useState<SshKey | null>(null);

  const add = async (form: HTMLFormElement) => {
    const field = (n: string) => form.elements.namedItem(n) as HTMLInputElement | HTMLTextAreaElement;
    const input = { name: field("name").value.trim(), publicKey: field("publicKey").value.trim() };
    setBusy(true);
    setProblem(null);
    setAdded("");
    try {
      const d = await gql<{ addSshKey: (SshKey & { __typename: string }) | Problem }>(ADD, { input });
      const r = d.addSshKey;
      if (isProblem(r)) {
        setProblem(r);
        // A private key pasted by mistake does not stay in the page either.
        if (r.code === "ssh_key_is_private") field("publicKey").value = "";
      } else {
        setAdded(`Added ${r.name}: ${r.fingerprint}`);
        form.reset();
        load();
      }
    } catch (e) {
      setProblem(asProblem(e));
    } finally {
      setBusy(false);
    }
  };

  const remove = (k: SshKey) => {
    setAdded("");
    removeRow(k.id, { id: k.id });
  };

  const bad = (n: string) => fieldProblem(problem, n);
  const canWrite = session.scopes.includes("write") || session.scopes.includes("admin");
  return (
    <>
      <h1>SSH keys</h1>
      {error && (
        <p class="error" role="alert">
          {error}
        </p>
      )}
      <div class="grid">
        <section aria-labelledby="ssh-keys-h" class="wide">
          <h2 id="ssh-keys-h">Your SSH keys</h2>
          <p class="muted">Public keys for logging in to the instances you launch.</p>
          {!keys ? (
            !error && <p class="loading">Loading…</p>
          ) : keys.length === 0 ? (
            <p data-testid="no-ssh-keys">No SSH keys yet.</p>
          ) : (
            <table data-testid="ssh-keys">
              <thead>
                <tr>
                  <th scope="col">Name</th>
                  <th scope="col">Type</th>
                  <th scope="col">Fingerprint</th>
                  <th scope="col">Comment</th>
                  <th scope="col">Added</th>
                  <th scope="col">
                    <span class="visually-hidden">Actions</span>
                  </th>
                </tr>
              </thead>
              <tbody>
                {keys.map((k) => (
                  <tr data-ssh-key={k.name}>
                    <th scope="row">{k.name}</th>
                    <td>
                      {k.keyType} ({k.bits} bits)
                    </td>
                    <td>
                      <code data-testid="ssh-key-fingerprint">{k.fingerprint}</code>
                    </td>
                    <td>{k.comment ?? ""}</td>
                    <td>{when(k.createdAt)}</td>
                    <td>
                      {canWrite && (
                        <button type="button" aria-haspopup="dialog" aria-label={`Delete ${k.name}`} onClick={() => setDeleting(k)}>
                          Delete
                        </button>
                      )}
                      {rowProblem?.key === k.id && (
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
              Show more keys
            </button>
          )}
        </section>
        <section aria-labelledby="ssh-new-h">
          <h2 id="ssh-new-h">Add a key</h2>
          {!canWrite && <p class="muted">Adding and deleting SSH keys needs the write scope; this session's key has {session.scopes.join(", ")}.</p>}
          <form
            class="form"
            noValidate
            aria-describedby="ssh-key-problem"
            onSubmit={(e) => {
              e.preventDefault();
              add(e.currentTarget as HTMLFormElement);
            }}
          >
            <FormProblem id="ssh-key-problem" problem={problem} fields={FIELDS} />
            <label for="ssh-key-name">Name</label>
            <input id="ssh-key-name" name="name" maxLength={63} aria-invalid={!!bad("name")} aria-describedby="ssh-key-name-error" />
            <FieldError id="ssh-key-name-error" message={bad("name")} />
            <label for="ssh-key-public">Public key (the .pub file: ssh-ed25519, ECDSA, or RSA of 3072 bits or more)</label>
            <textarea
              id="ssh-key-public"
              class="pubkey"
              name="publicKey"
              rows={4}
              spellcheck={false}
              autoComplete="off"
              placeholder="ssh-ed25519 AAAA… you@laptop"
              aria-invalid={!!bad("publicKey")}
              aria-describedby="ssh-key-public-error"
            />
            <FieldError id="ssh-key-public-error" message={bad("publicKey")} />
            <div class="actions">
              <button type="submit" class="primary" disabled={busy}>
                Add key
              </button>
            </div>
            <p role="status" class="muted" data-testid="ssh-key-added">
              {added}
            </p>
          </form>
        </section>
      </div>
      <Confirm
        id="ssh-delete"
        open={!!deleting}
        title={`Delete ${deleting?.name ?? "this key"}?`}
        action="Delete it"
        onCancel={() => setDeleting(null)}
        onConfirm={() => {
          const k = deleting;
          setDeleting(null);
          if (k) remove(k);
        }}
      >
        <p>
          <code>{deleting?.fingerprint}</code> can no longer be given to the instances you launch.
        </p>
      </Confirm>
    </>
  );
}
