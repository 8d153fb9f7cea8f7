import { useState } from "preact/hooks";
import { asProblem, fieldProblem, gql, isProblem, PROBLEM_FIELDS, when, type Problem, type Session } from "../api";
import { useOwnedList, useRowDelete } from "../owned";
import { Confirm, FieldError, FormProblem } from "../ui";

// The tenant's volumes: named directories its runs mount (`volumes` when it submits), on each
// node's own disk or on the fleet's shared storage.
const VOLUME_FIELDS = "id name storage createdAt";
const LIST = `query Volumes($after: String) { volumes(first: 50, after: $after) {
  edges { cursor node { ${VOLUME_FIELDS} } }
  pageInfo { hasNextPage endCursor }
} }`;
const PUT = `mutation PutVolume($input: VolumeInput!) { putVolume(input: $input) {
  __typename ... on Volume { ${VOLUME_FIELDS} } ${PROBLEM_FIELDS}
} }`;
const DELETE = `mutation DeleteVolume($name: String!) { deleteVolume(name: $name) {
  __typename ... on Volume { name } ${PROBLEM_FIELDS}
} }`;

interface Volume {
  id: string;
  name: string;
  storage: string;
  createdAt: string;
}

const FIELDS = ["name", "storage"];
const STORAGE: Record<string, string> = {
  node: "each node's own disk: what a run writes stays on that node",
  shared: "the fleet's shared storage: every node that offers it sees the same files",
};

export function Volumes({ session }: { session: Session }) {
  const { items: volumes, next, error, load } = useOwnedList<Volume>(LIST, "volumes");
  const { rowProblem, remove: removeRow } = useRowDelete(DELETE, "deleteVolume", () => load());
  const [problem, setProblem] = useState<Problem | null>(null);
  const [busy, setBusy] = useState(false);
  const [made, setMade] = useState("");
  const [deleting, setDeleting] = useState<Volume | null>(null);

  const put = async (form: HTMLFormElement) => {
    const field = (n: string) => form.elements.namedItem(n) as HTMLInputElement | HTMLSelectElement;
    const input = { name: field("name").value.trim(), storage: field("storage").value };
    setBusy(true);
    setProblem(null);
    setMade("");
    try {
      const d = await gql<{ putVolume: (Volume & { __typename: string }) | Problem }>(PUT, { input });
      const r = d.putVolume;
      if (isProblem(r)) setProblem(r);
      else {
        setMade(`${r.name} is ready (${r.storage} storage)`);
        form.reset();
        load();
      }
    } catch (e) {
      setProblem(asProblem(e));
    } finally {
      setBusy(false);
    }
  };

  const bad = (n: string) => fieldProblem(problem, n);
  const canWrite = session.scopes.includes("write") || session.scopes.includes("admin");
  return (
    <>
      <h1>Volumes</h1>
      {error && (
        <p class="error" role="alert">
          {error}
        </p>
      )}
      <div class="grid">
        <section aria-labelledby="volumes-h" class="wide">
          <h2 id="volumes-h">Your volumes</h2>
          <p class="muted">
            Directories your runs mount by name (<code>volumes</code> when you submit: a path in a process run's own directory, or absolute in a
            container). No other tenant's run can reach them.
          </p>
          {!volumes ? (
            !error && <p class="loading">Loading…</p>
          ) : volumes.length === 0 ? (
            <p data-testid="no-volumes">No volumes yet.</p>
          ) : (
            <table data-testid="volumes">
              <thead>
                <tr>
                  <th scope="col">Volume</th>
                  <th scope="col">Storage</th>
                  <th scope="col">Made</th>
                  <th scope="col">
                    <span class="visually-hidden">Actions</span>
                  </th>
                </tr>
              </thead>
              <tbody>
                {volumes.map((v) => (
                  <tr data-volume={v.name}>
                    <th scope="row">{v.name}</th>
                    <td title={STORAGE[v.storage]}>{v.storage}</td>
                    <td>{when(v.createdAt)}</td>
                    <td>
                      {canWrite && (
                        <button type="button" aria-haspopup="dialog" aria-label={`Delete ${v.name}`} onClick={() => setDeleting(v)}>
                          Delete
                        </button>
                      )}
                      {rowProblem?.key === v.name && (
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
              Show more volumes
            </button>
          )}
        </section>
        <section aria-labelledby="volume-new-h">
          <h2 id="volume-new-h">Make a volume</h2>
          {!canWrite && <p class="muted">Making and deleting volumes needs the write scope; this session's key has {session.scopes.join(", ")}.</p>}
          <form
            class="form"
            noValidate
            aria-describedby="volume-problem"
            onSubmit={(e) => {
              e.preventDefault();
              put(e.currentTarget as HTMLFormElement);
            }}
          >
            <FormProblem id="volume-problem" problem={problem} fields={FIELDS} />
            <label for="volume-name">Volume (letters, digits, . _ -)</label>
            <input id="volume-name" name="name" maxLength={63} aria-invalid={!!bad("name")} aria-describedby="volume-name-error" />
            <FieldError id="volume-name-error" message={bad("name")} />
            <label for="volume-storage">Where its files live</label>
            <select id="volume-storage" name="storage">
              {Object.entries(STORAGE).map(([k, text]) => (
                <option value={k}>
                  {k}: {text}
                </option>
              ))}
            </select>
            <div class="actions">
              <button type="submit" class="primary" disabled={busy}>
                Make volume
              </button>
            </div>
            <p role="status" class="muted" data-testid="volume-made">
              {made}
            </p>
          </form>
        </section>
      </div>
      <Confirm
        id="volume-delete"
        open={!!deleting}
        title={`Delete ${deleting?.name ?? "this volume"}?`}
        action="Delete it"
        onCancel={() => setDeleting(null)}
        onConfirm={() => {
          const v = deleting;
          setDeleting(null);
          setMade("");
          if (v) removeRow(v.name, { name: v.name });
        }}
      >
        <p>Its name goes; a volume made again under it starts empty. One that a workload that has not ended mounts is not deleted.</p>
      </Confirm>
    </>
  );
}
