import { useEffect, useState } from "preact/hooks";
import { asProblem, fieldProblem, gql, isProblem, PROBLEM_FIELDS, when, type Problem, type Session } from "../api";
import { useOwnedList, useRowDelete } from "../owned";
import { Confirm, FieldError, FormProblem } from "../ui";

// The tenant's inference endpoints: replicas of one shape serving HTTP behind the gateway at
// /e/{name}/, scaled between their bounds by the autoscaler; each one's replicas, and the
// autoscaler's latest decisions with what they were made from.
const ENDPOINT_FIELDS = `id name urlPath target minReplicas maxReplicas priority createdAt
  slo { p95Ms ttftMs } scaling { signal target }
  replicas { workloadId name state ready host port }`;
const LIST = `query Endpoints($after: String) { endpoints(first: 50, after: $after) {
  edges { cursor node { ${ENDPOINT_FIELDS} } }
  pageInfo { hasNextPage endCursor }
} }`;
const EVENTS = `query EndpointEvents($name: String!) { endpointEvents(name: $name, first: 20) {
  id at kind target mode reason inputs
} }`;
const CREATE = `mutation CreateEndpoint($input: EndpointInput!) { createEndpoint(input: $input) {
  __typename ... on Endpoint { ${ENDPOINT_FIELDS} } ${PROBLEM_FIELDS}
} }`;
const DELETE = `mutation DeleteEndpoint($name: String!) { deleteEndpoint(name: $name) {
  __typename ... on Endpoint { name } ${PROBLEM_FIELDS}
} }`;

interface Replica {
  workloadId: string;
  name: string | null;
  state: string;
  ready: boolean;
  host: string | null;
  port: number | null;
}

interface Endpoint {
  id: string;
  name: string;
  urlPath: string;
  target: number;
  minReplicas: number;
  maxReplicas: number;
  priority: string;
  createdAt: string;
  slo: { p95Ms: number | null; ttftMs: number | null };
  scaling: { signal: string; target: number };
  replicas: Replica[];
}

interface EndpointEvent {
  id: number;
  at: string;
  kind: string;
  target: number;
  mode: string;
  reason: string;
  inputs: Record<string, unknown>;
}

const FIELDS = ["name", "replica", "min_replicas", "max_replicas", "slo", "scaling"];

function Decisions({ name }: { name: string }) {
  const [events, setEvents] = useState<EndpointEvent[] | null>(null);
  const [error, setError] = useState("");
  useEffect(() => {
    gql<{ endpointEvents: EndpointEvent[] }>(EVENTS, { name })
      .then((d) => setEvents(d.endpointEvents))
      .catch((e) => setError(asProblem(e).message));
  }, [name]);
  if (error)
    return (
      <p class="error" role="alert">
        {error}
      </p>
    );
  if (!events) return <p class="loading">Loading…</p>;
  return (
    <table data-testid="endpoint-events">
      <caption>Latest decisions of {name}</caption>
      <thead>
        <tr>
          <th scope="col">When</th>
          <th scope="col">Decision</th>
          <th scope="col">Target</th>
          <th scope="col">Made from</th>
        </tr>
      </thead>
      <tbody>
        {events.map((e) => (
          <tr>
            <td>{when(e.at)}</td>
            <td>
              {e.kind} ({e.mode}): {e.reason}
            </td>
            <td>{e.target}</td>
            <td>
              <code>{JSON.stringify(e.inputs)}</code>
            </td>
          </tr>
        ))}
      </tbody>
    </table>
  );
}

export function Endpoints({ session }: { session: Session }) {
  const { items: endpoints, next, error, load } = useOwnedList<Endpoint>(LIST, "endpoints");
  const { rowProblem, remove: removeRow } = useRowDelete(DELETE, "deleteEndpoint", () => load());
  const [problem, setProblem] = useState<Problem | null>(null);
  const [busy, setBusy] = useState(false);
  const [made, setMade] = useState("");
  const [shown, setShown] = useState<string | null>(null);
  const [deleting, setDeleting] = useState<Endpoint | null>(null);

  const create = async (form: HTMLFormElement) => {
    const field = (n: string) => form.elements.namedItem(n) as HTMLInputElement | HTMLSelectElement;
    const num = (n: string) => Number(field(n).value);
    const command = field("command").value.split("\n").map((s) => s.trim()).filter(Boolean);
    const input = {
      name: field("name").value.trim(),
      replica: { gpus: num("gpus"), ...(command.length ? { command } : {}) },
      minReplicas: num("min"),
      maxReplicas: num("max"),
      slo: { p95Ms: num("p95") },
      scaling: { signal: field("signal").value, target: num("per") },
    };
    setBusy(true);
    setProblem(null);
    setMade("");
    try {
      const d = await gql<{ createEndpoint: (Endpoint & { __typename: string }) | Problem }>(CREATE, { input });
      const r = d.createEndpoint;
      if (isProblem(r)) setProblem(r);
      else {
        setMade(`${r.name} is at ${r.urlPath} on the gateway, ${r.target} replica(s) to start`);
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
      <h1>Endpoints</h1>
      {error && (
        <p class="error" role="alert">
          {error}
        </p>
      )}
      <div class="grid">
        <section aria-labelledby="endpoints-h" class="wide">
          <h2 id="endpoints-h">Your inference endpoints</h2>
          <p class="muted">
            Callers reach an endpoint through the gateway at <code>/e/&lt;name&gt;/</code> with a key that has the <code>invoke</code> scope. Its
            replicas are workloads of yours, billed per GPU-second while they run.
          </p>
          {!endpoints ? (
            !error && <p class="loading">Loading…</p>
          ) : endpoints.length === 0 ? (
            <p data-testid="no-endpoints">No endpoints yet.</p>
          ) : (
            <table data-testid="endpoints">
              <thead>
                <tr>
                  <th scope="col">Endpoint</th>
                  <th scope="col">Serving</th>
                  <th scope="col">Target (bounds)</th>
                  <th scope="col">Scales on</th>
                  <th scope="col">
                    <span class="visually-hidden">Actions</span>
                  </th>
                </tr>
              </thead>
              <tbody>
                {endpoints.map((e) => (
                  <tr data-endpoint={e.name}>
                    <th scope="row">
                      {e.name} <code>{e.urlPath}</code>
                    </th>
                    <td>
                      {e.replicas.filter((r) => r.ready).length} ready of {e.replicas.length}
                      <ul class="plain">
                        {e.replicas.map((r) => (
                          <li>
                            <a href={`/portal/workloads/${r.workloadId}`}>{r.name}</a> {r.state}
                            {r.ready ? " · ready" : ""}
                          </li>
                        ))}
                      </ul>
                    </td>
                    <td data-testid="endpoint-target">
                      {e.target} ({e.minReplicas}–{e.maxReplicas})
                    </td>
                    <td>
                      {e.scaling.signal} {e.scaling.target} each; p95 {e.slo.p95Ms ?? e.slo.ttftMs} ms{e.slo.ttftMs ? " to first token" : ""}
                    </td>
                    <td>
                      <button type="button" aria-expanded={shown === e.name} onClick={() => setShown(shown === e.name ? null : e.name)}>
                        Decisions
                      </button>
                      {canWrite && (
                        <button type="button" aria-haspopup="dialog" aria-label={`Delete ${e.name}`} onClick={() => setDeleting(e)}>
                          Delete
                        </button>
                      )}
                      {rowProblem?.key === e.name && (
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
              Show more endpoints
            </button>
          )}
          {shown && <Decisions name={shown} />}
        </section>
        <section aria-labelledby="endpoint-new-h">
          <h2 id="endpoint-new-h">Make an endpoint</h2>
          {!canWrite && <p class="muted">Making and deleting endpoints needs the write scope; this session's key has {session.scopes.join(", ")}.</p>}
          <form
            class="form"
            noValidate
            aria-describedby="endpoint-problem"
            onSubmit={(e) => {
              e.preventDefault();
              create(e.currentTarget as HTMLFormElement);
            }}
          >
            <FormProblem id="endpoint-problem" problem={problem} fields={FIELDS} />
            <label for="endpoint-name">Endpoint (letters, digits, . _ -)</label>
            <input id="endpoint-name" name="name" maxLength={63} aria-invalid={!!bad("name")} aria-describedby="endpoint-name-error" />
            <FieldError id="endpoint-name-error" message={bad("name")} />
            <label for="endpoint-gpus">Whole GPUs each copy serves on</label>
            <input id="endpoint-gpus" name="gpus" type="number" min={1} max={8} value={1} />
            <label for="endpoint-command">Server command, one argument per line (it listens on $PORT)</label>
            <textarea id="endpoint-command" name="command" rows={3} aria-invalid={!!bad("replica")} aria-describedby="endpoint-command-error" />
            <FieldError id="endpoint-command-error" message={bad("replica")} />
            <label for="endpoint-min">Copies kept when idle (0: scale to zero)</label>
            <input id="endpoint-min" name="min" type="number" min={0} max={64} value={0} />
            <label for="endpoint-max">Most copies</label>
            <input id="endpoint-max" name="max" type="number" min={1} max={64} value={2} aria-invalid={!!bad("max_replicas")} />
            <label for="endpoint-p95">Latency objective, p95 (ms)</label>
            <input id="endpoint-p95" name="p95" type="number" min={1} value={1000} />
            <label for="endpoint-signal">Scale on</label>
            <select id="endpoint-signal" name="signal">
              <option value="concurrency">requests in flight per copy</option>
              <option value="rps">requests a second per copy</option>
            </select>
            <label for="endpoint-per">Of it, per copy</label>
            <input id="endpoint-per" name="per" type="number" min={0.1} step={0.1} value={4} />
            <div class="actions">
              <button type="submit" class="primary" disabled={busy}>
                Make endpoint
              </button>
            </div>
            <p role="status" class="muted" data-testid="endpoint-made">
              {made}
            </p>
          </form>
        </section>
      </div>
      <Confirm
        id="endpoint-delete"
        open={!!deleting}
        title={`Delete ${deleting?.name ?? "this endpoint"}?`}
        action="Delete it"
        onCancel={() => setDeleting(null)}
        onConfirm={() => {
          const e = deleting;
          setDeleting(null);
          setMade("");
          if (e) removeRow(e.name, { name: e.name });
        }}
      >
        <p>Its replicas are terminated and callers get 404; what they ran stays on your bill.</p>
      </Confirm>
    </>
  );
}
