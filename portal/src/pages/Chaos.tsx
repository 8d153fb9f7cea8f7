// Operators: chaos experiments (by state), and an experiment's report: what was injected where,
// per fault how fast the health loop detected it, took the hardware out, requeued and ran the
// work again, and whether every invariant held. Stop undoes what it injected (after asking).
import { useEffect, useState } from "preact/hooks";
import { asProblem, gql, isProblem, problemText, PROBLEM_FIELDS, when, type Problem } from "../api";
import { AskDialog, Outcome, type Ask } from "../ui";

const SUMMARY_FIELDS = "id name state rounds nextAt abortReason gpusTouched startedAt stoppedAt";
const LIST = `query Experiments($after: String, $state: String) { chaosExperiments(first: 50, after: $after, state: $state) {
  edges { cursor node { ${SUMMARY_FIELDS} } }
  pageInfo { hasNextPage endCursor }
} }`;
const REPORT_FIELDS = `${SUMMARY_FIELDS} held
  injections { id kind code detail node gpuIndex injectedAt undoneAt }
  report { injection node gpuIndex incident action detectS quarantineS requeueS runningS workloads lostWorkGpuS }
  invariants { doubleAllocations usageAfterFault inconsistentWorkloads graceCutShort breakerExceeded crossTenantSharing }`;
const ONE = `query Experiment($id: ID!) { chaosExperiment(id: $id) { ${REPORT_FIELDS} } }`;
const STOP = `mutation Stop($id: ID!) { stopChaosExperiment(id: $id) {
  __typename ... on ChaosExperiment { ${REPORT_FIELDS} } ${PROBLEM_FIELDS}
} }`;

interface Summary {
  id: string;
  name: string;
  state: string;
  rounds: number;
  nextAt: string | null;
  abortReason: string | null;
  gpusTouched: number;
  startedAt: string;
  stoppedAt: string | null;
}
interface Experiment extends Summary {
  held: boolean;
  injections: { id: string; kind: string; code: number | null; detail: string | null; node: string; gpuIndex: number | null; injectedAt: string; undoneAt: string | null }[];
  report: {
    injection: string;
    node: string;
    gpuIndex: number | null;
    incident: string | null;
    action: string | null;
    detectS: number | null;
    quarantineS: number | null;
    requeueS: number | null;
    runningS: number | null;
    workloads: string[];
    lostWorkGpuS: number;
  }[];
  invariants: Record<string, number>;
}

const STATES = ["scheduled", "running", "stopped", "aborted"];
const LIVE = new Set(["scheduled", "running"]);
const INVARIANTS: [string, string][] = [
  ["doubleAllocations", "GPUs held by two live whole allocations at once"],
  ["usageAfterFault", "Usage of stopped work metered past its fault's instant"],
  ["inconsistentWorkloads", "Affected workloads holding allocations without GPUs, or the reverse"],
  ["graceCutShort", "Preempted workloads stopped before the end of their grace period"],
  ["breakerExceeded", "Automatic take-outs past the circuit breaker's region or rack limit"],
  ["crossTenantSharing", "GPUs time-sliced or MPS-shared by more than one tenant"],
];

const secs = (s: number | null) => (s == null ? "—" : `${s.toFixed(1)} s`);
const where = (x: { node: string; gpuIndex: number | null }) => (x.gpuIndex == null ? x.node : `${x.node} GPU ${x.gpuIndex}`);

export function Chaos() {
  const [state, setState] = useState("");
  const [items, setItems] = useState<Summary[] | null>(null);
  const [next, setNext] = useState<string | null>(null);
  const [error, setError] = useState("");

  const load = async (after: string | null = null) => {
    try {
      const d = await gql<{ chaosExperiments: { edges: { node: Summary }[]; pageInfo: { hasNextPage: boolean; endCursor: string | null } } }>(LIST, {
        after,
        state: state || null,
      });
      const got = d.chaosExperiments.edges.map((e) => e.node);
      setItems((old) => (after && old ? [...old, ...got] : got));
      setNext(d.chaosExperiments.pageInfo.hasNextPage ? d.chaosExperiments.pageInfo.endCursor : null);
      setError("");
    } catch (e) {
      setError(problemText(asProblem(e)));
    }
  };
  useEffect(() => {
    setItems(null);
    load();
  }, [state]);

  return (
    <>
      <h1>Chaos experiments</h1>
      <section aria-labelledby="exp-h">
        <h2 id="exp-h">{state ? `Experiments ${state}` : "All experiments"}</h2>
        <p class="muted">
          Experiments are started through the API (<code>POST /v1/admin/chaos/experiments</code>) or <code>rackplane chaos inject</code>; here they are
          followed, reported on and stopped.
        </p>
        <p class="inline-form">
          <label for="x-state">State</label>
          <select id="x-state" value={state} onChange={(e) => setState((e.currentTarget as HTMLSelectElement).value)}>
            <option value="">any</option>
            {STATES.map((s) => (
              <option value={s}>{s}</option>
            ))}
          </select>
          <button type="button" onClick={() => load()}>
            Refresh
          </button>
        </p>
        {error && (
          <p class="error" role="alert">
            {error}
          </p>
        )}
        {!items ? (
          !error && <p class="loading">Loading…</p>
        ) : items.length === 0 ? (
          <p data-testid="no-experiments">No {state || ""} experiments.</p>
        ) : (
          <table data-testid="experiments">
            <thead>
              <tr>
                <th scope="col">Name</th>
                <th scope="col">State</th>
                <th scope="col">Rounds</th>
                <th scope="col">GPUs touched</th>
                <th scope="col">Started</th>
                <th scope="col">Stopped</th>
                <th scope="col">Next round</th>
              </tr>
            </thead>
            <tbody>
              {items.map((x) => (
                <tr data-id={x.id} data-state={x.state}>
                  <th scope="row">
                    <a href={`/portal/chaos/${x.id}`}>{x.name}</a>
                  </th>
                  <td>
                    <span class={`state state-chaos-${x.state}`}>{x.state}</span>
                    {x.abortReason ? ` (${x.abortReason})` : ""}
                  </td>
                  <td>{x.rounds}</td>
                  <td>{x.gpusTouched}</td>
                  <td>{when(x.startedAt)}</td>
                  <td>{when(x.stoppedAt)}</td>
                  <td>{when(x.nextAt)}</td>
                </tr>
              ))}
            </tbody>
          </table>
        )}
        {next && (
          <button type="button" onClick={() => load(next)}>
            Show more experiments
          </button>
        )}
      </section>
    </>
  );
}

export function ChaosExperimentPage({ id }: { id: string }) {
  const [x, setX] = useState<Experiment | null>(null);
  const [error, setError] = useState("");
  const [ask, setAsk] = useState<Ask | null>(null);
  const [outcome, setOutcome] = useState<{ ok: boolean; text: string } | null>(null);
  const [busy, setBusy] = useState(false);

  const load = () =>
    gql<{ chaosExperiment: Experiment }>(ONE, { id })
      .then((d) => {
        setX(d.chaosExperiment);
        setError("");
      })
      .catch((e) => setError(problemText(asProblem(e))));
  useEffect(() => {
    load();
  }, [id]);

  const stop = async () => {
    setBusy(true);
    setOutcome(null);
    try {
      const d = await gql<{ stopChaosExperiment: (Experiment & { __typename: string }) | Problem }>(STOP, { id });
      const r = d.stopChaosExperiment;
      if (isProblem(r)) setOutcome({ ok: false, text: problemText(r) });
      else {
        setX(r);
        setOutcome({ ok: true, text: `Stopped: ${r.injections.filter((i) => i.undoneAt).length} of ${r.injections.length} injections undone.` });
      }
    } catch (e) {
      setOutcome({ ok: false, text: problemText(asProblem(e)) });
    } finally {
      setBusy(false);
    }
  };

  if (!x) return error ? <p class="error" role="alert">{error}</p> : <p class="loading">Loading…</p>;
  return (
    <>
      <p>
        <a href="/portal/chaos">← Chaos experiments</a>
      </p>
      <h1>
        {x.name} <small>chaos experiment</small>
      </h1>
      <div class="grid">
        <section aria-labelledby="xs-h" data-testid="experiment" data-state={x.state}>
          <h2 id="xs-h">
            State: <span class={`state state-chaos-${x.state}`}>{x.state}</span>
          </h2>
          <dl>
            <dt>Started</dt>
            <dd>{when(x.startedAt)}</dd>
            <dt>Stopped</dt>
            <dd>{when(x.stoppedAt)}</dd>
            {x.abortReason && (
              <>
                <dt>Aborted because</dt>
                <dd>{x.abortReason}</dd>
              </>
            )}
            <dt>Rounds</dt>
            <dd>
              {x.rounds}
              {x.nextAt ? `, next at ${when(x.nextAt)}` : ""}
            </dd>
            <dt>GPUs touched</dt>
            <dd>{x.gpusTouched}</dd>
          </dl>
          <div class="actions">
            <button type="button" onClick={load}>
              Refresh
            </button>
            {LIVE.has(x.state) && (
              <button
                type="button"
                class="danger"
                aria-haspopup="dialog"
                disabled={busy}
                onClick={() =>
                  setAsk({
                    title: `Stop ${x.name}?`,
                    action: "Stop experiment",
                    body: (
                      <p>
                        No more rounds run, and what it injected is undone ({x.injections.filter((i) => !i.undoneAt).length} injection(s) still in
                        place). Hardware the health loop already took out stays out until it is repaired or released.
                      </p>
                    ),
                    run: stop,
                  })
                }
              >
                Stop
              </button>
            )}
          </div>
          <Outcome id="chaos-outcome" outcome={outcome} />
        </section>
        <section aria-labelledby="inv-h">
          <h2 id="inv-h">
            Invariants:{" "}
            <span data-testid="held" class={x.held ? "ok" : "error"}>
              {x.held ? "all held" : "broken"}
            </span>
          </h2>
          <table class="compact" data-testid="invariants">
            <tbody>
              {INVARIANTS.map(([k, text]) => (
                <tr data-invariant={k}>
                  <th scope="row">{text}</th>
                  <td>{x.invariants[k] ?? 0}</td>
                </tr>
              ))}
            </tbody>
          </table>
        </section>
        <section aria-labelledby="rep-h" class="wide">
          <h2 id="rep-h">Per fault: what the health loop did, and how fast (from the injection)</h2>
          {x.report.length === 0 ? (
            <p>Nothing injected yet.</p>
          ) : (
            <table data-testid="report">
              <thead>
                <tr>
                  <th scope="col">Where</th>
                  <th scope="col">Action</th>
                  <th scope="col">Detected</th>
                  <th scope="col">Taken out</th>
                  <th scope="col">Work requeued</th>
                  <th scope="col">Work running again</th>
                  <th scope="col">Workloads</th>
                  <th scope="col">Lost work (GPU-s)</th>
                </tr>
              </thead>
              <tbody>
                {x.report.map((r) => (
                  <tr data-injection={r.injection}>
                    <th scope="row">{where(r)}</th>
                    <td>{r.action ?? (r.incident ? "—" : "not detected yet")}</td>
                    <td>{secs(r.detectS)}</td>
                    <td>{secs(r.quarantineS)}</td>
                    <td>{secs(r.requeueS)}</td>
                    <td>{secs(r.runningS)}</td>
                    <td>{r.workloads.length ? r.workloads.map((w) => w.slice(0, 8)).join(", ") : "none"}</td>
                    <td>{r.lostWorkGpuS.toFixed(1)}</td>
                  </tr>
                ))}
              </tbody>
            </table>
          )}
        </section>
        <section aria-labelledby="inj-h" class="wide">
          <h2 id="inj-h">Injections</h2>
          <table class="compact" data-testid="injections">
            <thead>
              <tr>
                <th scope="col">Where</th>
                <th scope="col">Fault</th>
                <th scope="col">Injected</th>
                <th scope="col">Undone</th>
              </tr>
            </thead>
            <tbody>
              {x.injections.map((i) => (
                <tr data-undone={i.undoneAt ? "yes" : "no"}>
                  <th scope="row">{where(i)}</th>
                  <td>
                    {i.kind}
                    {i.code != null ? ` ${i.code}` : ""}
                    {i.detail ? ` (${i.detail})` : ""}
                  </td>
                  <td>{when(i.injectedAt)}</td>
                  <td>{i.undoneAt ? when(i.undoneAt) : "still in place"}</td>
                </tr>
              ))}
            </tbody>
          </table>
        </section>
      </div>
      <AskDialog id="chaos-ask" ask={ask} onClose={() => setAsk(null)} />
    </>
  );
}
