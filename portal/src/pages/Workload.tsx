import { useEffect, useRef, useState } from "preact/hooks";
import { ApiError, gql, isProblem, PROBLEM_FIELDS, shapeText, subscribe, when, type Problem, type WorkloadSummary } from "../api";
import { DRY_RUN_FIELDS, DryRunView, type DryRun } from "./DryRunView";
import { LogPane } from "./LogPane";

const QUERY = `query Workload($id: ID!) { workload(id: $id) {
  id name kind state tier priority replicas gpuMilli region shape topology labels
  createdAt startedAt finishedAt interruptions lostWorkGpuS preemptions lastCheckpointAt
  placement { replica region rack node gpuIndices migProfile migSlot }
  runtime workdir sshKeys secretEnv connect { host port user command ready readyAt }
  restartPolicy restarts notBefore pending { reason detail since }
  dependsOn array { id index count maxParallel } elastic { minReplicas currentReplicas } volumes { name storage mountPath readOnly }
} }`;

const ELEMENTS = `query Elements($array: ID!) { workloads(arrayId: $array, first: 200) {
  edges { node { id state array { index } } }
} }`;

const EVENTS = `subscription Timeline($id: ID!) { workloadEvents(after: "0", workloadId: $id) {
  seq kind fromState toState reason details at cursor
} }`;

interface W extends WorkloadSummary {
  topology: { level: string; mode: string } | null;
  labels: Record<string, string>;
  startedAt: string | null;
  finishedAt: string | null;
  interruptions: number;
  lostWorkGpuS: number;
  preemptions: number;
  lastCheckpointAt: string | null;
  placement: { replica: number; region: string | null; rack: string | null; node: string; gpuIndices: number[]; migProfile: string | null; migSlot: number | null }[];
  runtime: string;
  sshKeys: string[];
  secretEnv: Record<string, string>;
  workdir: string | null;
  connect: Connect | null;
  restartPolicy: RestartPolicy;
  restarts: Record<string, number>;
  notBefore: string | null;
  pending: { reason: string; detail: string; since: string } | null;
  dependsOn: string[];
  array: { id: string; index: number; count: number; maxParallel: number } | null;
  elastic: { minReplicas: number; currentReplicas: number } | null;
  volumes: { name: string; storage: string; mountPath: string; readOnly: boolean }[];
}
interface Element {
  id: string;
  state: string;
  array: { index: number };
}

/** A job array's elements (its first 200), each linking to its page. */
function ArrayElements({ w }: { w: W }) {
  const [items, setItems] = useState<Element[] | null>(null);
  const [error, setError] = useState("");
  useEffect(() => {
    if (!w.array) return;
    gql<{ workloads: { edges: { node: Element }[] } }>(ELEMENTS, { array: w.array.id })
      .then((d) => setItems(d.workloads.edges.map((e) => e.node).sort((a, b) => a.array.index - b.array.index)))
      .catch((e: ApiError) => setError(`${e.message} (${e.code})`));
  }, [w.array?.id, w.state]);
  if (!w.array) return null;
  return (
    <section aria-labelledby="array-h">
      <h2 id="array-h">
        Job array: element {w.array.index} of {w.array.count}
      </h2>
      <p class="muted">
        At most {w.array.maxParallel} under way at once; its id <code>{w.array.id}</code> stands for them all in <code>dependsOn</code>.
      </p>
      {error ? (
        <p class="error">{error}</p>
      ) : !items ? (
        <p class="loading">Loading…</p>
      ) : (
        <ul class="elements" data-testid="array-elements">
          {items.map((e) => (
            <li>
              {e.id === w.id ? <strong>{e.array.index}</strong> : <a href={`/portal/workloads/${e.id}`}>{e.array.index}</a>} {e.state}
            </li>
          ))}
        </ul>
      )}
    </section>
  );
}
/** What restarts it after its run ends early (REST's `restart_policy`). */
interface RestartPolicy {
  on: string[];
  max_restarts: number;
  counts: string[];
  backoff_s: number;
  backoff_max_s: number;
}

/** Its restarts by cause, against its policy's limit. */
function restartsText(w: W): string {
  const p = w.restartPolicy;
  const counted = p.counts.reduce((n, c) => n + (w.restarts[c] ?? 0), 0);
  const by = Object.entries(w.restarts)
    .filter(([, n]) => n > 0)
    .map(([c, n]) => `${c} ${n}`)
    .join(", ");
  return `${by || "none"}; ${counted} of ${p.max_restarts} counted (restarts after ${p.on.join(", ") || "nothing"})`;
}
/** Where an instance's SSH server is (null until its node's agent reports the port). */
interface Connect {
  host: string;
  port: number;
  user: string;
  command: string;
  ready: boolean;
  readyAt: string | null;
}
interface Ev {
  seq: number;
  kind: string;
  fromState: string | null;
  toState: string;
  reason: string;
  details: Record<string, unknown>;
  at: string;
}

const ENDED = ["succeeded", "failed", "terminated"];

/** How to log in to an instance or VM launched with SSH keys: the command (selectable, with a
 * copy button), and whether its SSH server answers yet. */
function ConnectPanel({ w }: { w: W }) {
  const [copied, setCopied] = useState("");
  const c = w.connect;
  if (!c) {
    return (
      <p data-testid="connect-pending">
        {ENDED.includes(w.state) ? "It has ended: there is nothing to log in to." : "Once its node has started it, the command to log in appears here."}
      </p>
    );
  }
  const copy = async () => {
    try {
      await navigator.clipboard.writeText(c.command);
      setCopied("Copied to the clipboard.");
    } catch {
      setCopied("The browser did not allow copying: select the command and copy it yourself.");
    }
  };
  return (
    <div data-testid="connect" data-ready={String(c.ready)}>
      <p>
        <code class="key" data-testid="connect-command">
          {c.command}
        </code>{" "}
        <span class={`state state-ssh-${c.ready ? "ready" : "booting"}`} data-testid="connect-state">
          {c.ready ? "ready" : "booting"}
        </span>
      </p>
      <p class="muted">
        {c.ready
          ? `Its SSH server has answered since ${when(c.readyAt)}.`
          : "Booting: its SSH server has not answered yet; the command works once it does."}
      </p>
      <div class="actions">
        <button type="button" onClick={copy}>
          Copy the command
        </button>
      </div>
      <p role="status" class="muted">
        {copied}
      </p>
    </div>
  );
}

/** The input that would submit the same workload again (for a dry run of a copy). */
function copyOf(w: W): Record<string, unknown> {
  const s = w.shape as Record<string, any>;
  const input: Record<string, unknown> = {
    kind: w.kind,
    gpuModels: s.gpu_models ?? [],
    replicas: w.replicas,
    priority: w.priority,
  };
  if (s.gpus) input.gpus = s.gpus;
  else if (s.mig_profile) input.migProfile = s.mig_profile;
  else {
    input.milli = s.milli;
    input.gpuMemoryMib = s.gpu_memory_mib;
  }
  if (w.region) input.region = w.region;
  if (w.topology) input.topology = { level: w.topology.level, mode: w.topology.mode };
  return input;
}

export function WorkloadPage({ id }: { id: string }) {
  const [w, setW] = useState<W | null>(null);
  const [events, setEvents] = useState<Ev[]>([]);
  const [error, setError] = useState("");
  const [live, setLive] = useState(false);
  const [preview, setPreview] = useState<DryRun | null>(null);
  const [busy, setBusy] = useState(false);
  // Terminate asks first, in a modal dialog (focus moves in, Esc or Cancel closes it).
  const confirm = useRef<HTMLDialogElement>(null);
  const keep = useRef<HTMLButtonElement>(null);

  const load = () =>
    gql<{ workload: W }>(QUERY, { id })
      .then((d) => setW(d.workload))
      .catch((e: ApiError) => setError(`${e.message} (${e.code})`));

  useEffect(() => {
    load();
    setEvents([]);
    const stop = subscribe<{ workloadEvents: Ev }>(
      EVENTS,
      { id },
      (d) => {
        setLive(true);
        setEvents((old) => (old.some((e) => e.seq === d.workloadEvents.seq) ? old : [...old, d.workloadEvents]));
        load(); // its state and placement as they are now
      },
      (e) => setError(`Live timeline: ${e.message} (${e.code})`),
    );
    const t = setTimeout(() => setLive(true), 1500);
    return () => {
      stop();
      clearTimeout(t);
    };
  }, [id]);

  if (!w) return error ? <p class="error" role="alert">{error}</p> : <p class="loading">Loading…</p>;

  const act = async (what: "terminate" | "dryrun") => {
    setBusy(true);
    setError("");
    try {
      if (what === "terminate") {
        const r = await gql<{ terminateWorkload: { __typename: string } & Partial<Problem> }>(
          `mutation($id: ID!) { terminateWorkload(id: $id) { __typename ... on Workload { state } ${PROBLEM_FIELDS} } }`,
          { id },
        );
        if (isProblem(r.terminateWorkload as any)) setError(`${r.terminateWorkload.message} (${r.terminateWorkload.code})`);
        else load();
      } else {
        const r = await gql<{ dryRun: DryRun }>(`query($input: WorkloadInput!) { dryRun(input: $input) { ${DRY_RUN_FIELDS} } }`, { input: copyOf(w) });
        setPreview(r.dryRun);
      }
    } catch (e) {
      setError(e instanceof ApiError ? `${e.message} (${e.code})` : String(e));
    } finally {
      setBusy(false);
    }
  };

  return (
    <>
      <h1>
        {w.name ?? "Workload"} <span class={`state state-${w.state}`} data-testid="workload-state">{w.state}</span>
      </h1>
      <p class="muted">{w.id}</p>
      {w.state === "queued" && w.pending && (
        <p data-testid="pending-reason" data-reason={w.pending.reason}>
          Waits: <strong>{w.pending.reason}</strong>, {w.pending.detail} (since {when(w.pending.since)}).
        </p>
      )}
      {error && <p class="error" role="alert">{error}</p>}
      <div class="actions">
        <button
          type="button"
          aria-haspopup="dialog"
          disabled={busy || ENDED.includes(w.state)}
          onClick={() => {
            confirm.current?.showModal();
            keep.current?.focus(); // the safe choice first
          }}
        >
          Terminate
        </button>
        <button type="button" disabled={busy} onClick={() => act("dryrun")}>
          Dry-run a copy
        </button>
      </div>
      <dialog ref={confirm} class="confirm" aria-labelledby="confirm-h" aria-describedby="confirm-d">
        <h2 id="confirm-h">Terminate {w.name ?? w.id.slice(0, 8)}?</h2>
        <p id="confirm-d">
          {w.replicas > 1 ? `Its ${w.replicas} replicas are` : "It is"} stopped now and its GPUs released. A terminated workload cannot be
          resumed.
        </p>
        <div class="actions">
          <button type="button" ref={keep} onClick={() => confirm.current?.close()}>
            Cancel
          </button>
          <button
            type="button"
            class="danger"
            onClick={() => {
              confirm.current?.close();
              act("terminate");
            }}
          >
            Terminate it
          </button>
        </div>
      </dialog>
      {preview && <DryRunView d={preview} />}
      <div class="grid">
        <section aria-labelledby="d-h">
          <h2 id="d-h">What it is</h2>
          <dl>
            <dt>Kind</dt>
            <dd>{w.kind}</dd>
            <dt>Shape</dt>
            <dd>{shapeText(w.shape, w.replicas)}</dd>
            {w.elastic && (
              <>
                <dt>Elastic</dt>
                <dd data-testid="elastic">
                  {w.elastic.currentReplicas} of {w.replicas} replicas now (goes on with at least {w.elastic.minReplicas})
                </dd>
              </>
            )}
            <dt>Tier</dt>
            <dd>{w.tier}</dd>
            <dt>Priority</dt>
            <dd>{w.priority}</dd>
            <dt>Region</dt>
            <dd>{w.region ?? "—"}</dd>
            <dt>Runtime</dt>
            <dd>{w.runtime}</dd>
            {w.workdir && (
              <>
                <dt>Starts in</dt>
                <dd>
                  <code data-testid="workdir">{w.workdir}</code>
                </dd>
              </>
            )}
            {w.topology && (
              <>
                <dt>Topology</dt>
                <dd>
                  {w.topology.level} ({w.topology.mode})
                </dd>
              </>
            )}
            {w.dependsOn.length > 0 && (
              <>
                <dt>Starts after</dt>
                <dd data-testid="depends-on">
                  {w.dependsOn.map((id, i) => (
                    <>
                      {i > 0 && ", "}
                      <code title={id}>{id.slice(0, 8)}</code>
                    </>
                  ))}{" "}
                  succeed
                </dd>
              </>
            )}
            <dt>Submitted</dt>
            <dd>{when(w.createdAt)}</dd>
            <dt>Started</dt>
            <dd>{when(w.startedAt)}</dd>
            <dt>Last checkpoint</dt>
            <dd>{when(w.lastCheckpointAt)}</dd>
            <dt>Preemptions / interruptions</dt>
            <dd>
              {w.preemptions} / {w.interruptions} (lost work {w.lostWorkGpuS.toFixed(0)} GPU-s)
            </dd>
            <dt>Restarts</dt>
            <dd data-testid="restarts">
              {restartsText(w)}
              {w.notBefore && w.state === "queued" && <> · backing off until {when(w.notBefore)}</>}
            </dd>
          </dl>
        </section>
        <section aria-labelledby="p-h">
          <h2 id="p-h">Where it runs</h2>
          {w.placement.length ? (
            <table class="compact" data-testid="placement">
              <thead>
                <tr>
                  <th scope="col">Replica</th>
                  <th scope="col">Rack</th>
                  <th scope="col">Node</th>
                  <th scope="col">GPUs</th>
                  <th scope="col">MIG slot</th>
                </tr>
              </thead>
              <tbody>
                {w.placement.map((p) => (
                  <tr>
                    <td>{p.replica}</td>
                    <td>{p.rack ?? "—"}</td>
                    <td>{p.node}</td>
                    <td>{p.gpuIndices.join(", ")}</td>
                    <td>{p.migProfile ? `${p.migProfile} @ ${p.migSlot}` : "—"}</td>
                  </tr>
                ))}
              </tbody>
            </table>
          ) : (
            <p>Not placed {ENDED.includes(w.state) ? "(ended)" : "yet"}.</p>
          )}
        </section>
        <ArrayElements w={w} />
        {w.volumes.length > 0 && (
          <section aria-labelledby="volumes-h">
            <h2 id="volumes-h">Volumes it mounts</h2>
            <ul data-testid="volumes">
              {w.volumes.map((v) => (
                <li>
                  <a href="/portal/volumes">{v.name}</a> ({v.storage}) at <code>{v.mountPath}</code>
                  {v.readOnly && ", read-only"}
                </li>
              ))}
            </ul>
          </section>
        )}
        {Object.keys(w.secretEnv).length > 0 && (
          <section aria-labelledby="secret-env-h">
            <h2 id="secret-env-h">From your secrets</h2>
            <ul data-testid="secret-env">
              {Object.entries(w.secretEnv)
                .sort(([a], [b]) => a.localeCompare(b))
                .map(([v, n]) => (
                  <li>
                    <code>{v}</code> from <a href="/portal/secrets">{n}</a>
                  </li>
                ))}
            </ul>
          </section>
        )}
        {(w.connect || w.sshKeys.length > 0) && (
          <section aria-labelledby="ssh-h">
            <h2 id="ssh-h">Log in</h2>
            <ConnectPanel w={w} />
            <p class="muted">
              {w.sshKeys.length === 1 ? "1 SSH key" : `${w.sshKeys.length} SSH keys`} may log in as {w.connect?.user ?? "root"}.
            </p>
          </section>
        )}
        <section aria-labelledby="t-h" class="wide">
          <h2 id="t-h">
            Timeline <small data-testid="live">{live ? "● live" : "connecting…"}</small>
          </h2>
          <ol class="timeline" data-testid="timeline" aria-live="polite">
            {events.map((e) => (
              <li class={`ev ev-${e.kind}`} data-state={e.toState}>
                <time dateTime={e.at}>{when(e.at)}</time>{" "}
                <strong>
                  {e.fromState ? `${e.fromState} → ` : ""}
                  {e.toState}
                </strong>{" "}
                <span>{e.reason}</span>
                {e.details?.resumes_from ? (
                  <span class="tag">
                    resumes from {String(e.details.resumes_from)}
                    {e.details.last_checkpoint_at ? ` (${when(String(e.details.last_checkpoint_at))})` : ""}
                  </span>
                ) : null}
              </li>
            ))}
          </ol>
        </section>
        <LogPane id={w.id} replicas={w.replicas} />
      </div>
    </>
  );
}
