// Operators: the fleet's lifecycle. Bring-up: every node on its way into service (bring-up,
// after a repair or an RMA return, in an upgrade), its burn-in step and why it is stuck if it
// is. Upgrades: each rolling upgrade's progress and report, node by node, with Resume (a
// paused one) and Roll back (after asking).
import { useEffect, useState } from "preact/hooks";
import { asProblem, gql, isProblem, problemText, PROBLEM_FIELDS, when, type Problem } from "../api";
import { AskDialog, Outcome, type Ask } from "../ui";

const UPGRADE_FIELDS = `id stack scopeKind scope batch unitsAtOnce maxUnavailablePct maxFailures state stateReason createdAt finishedAt
  progress { pending draining applying done failed skipped rolledBack }
  report { nodes gpuHoursOutOfService workMoved failures }`;
const QUERY = `query Lifecycle {
  bringUp { stuck items { node region rack health state why since step stepsDone steps limitAt stuck } }
  upgrades { ${UPGRADE_FIELDS} }
}`;
const ONE = `query Upgrade($id: ID!) { upgrade(id: $id) { ${UPGRADE_FIELDS}
  nodes { node unit phase detail fromStack workMoved takenAt backAt } } }`;
const act = (name: string) => `mutation Act($id: ID!) { ${name}(id: $id) {
  __typename ... on Upgrade { ${UPGRADE_FIELDS} } ${PROBLEM_FIELDS}
} }`;

interface BringUpNode {
  node: string;
  region: string;
  rack: string;
  health: string;
  state: string;
  why: string;
  since: string | null;
  step: string | null;
  stepsDone: number;
  steps: number;
  limitAt: string | null;
  stuck: string | null;
}
interface Upgrade {
  id: string;
  stack: string;
  scopeKind: string;
  scope: string;
  batch: string;
  unitsAtOnce: number;
  maxUnavailablePct: number;
  maxFailures: number;
  state: string;
  stateReason: string | null;
  createdAt: string;
  finishedAt: string | null;
  progress: Record<string, number>;
  report: { nodes: number; gpuHoursOutOfService: number; workMoved: number; failures: number };
  nodes?: { node: string; unit: number; phase: string; detail: string | null; fromStack: string | null; workMoved: number; takenAt: string | null; backAt: string | null }[];
}

const PHASES: [string, string][] = [
  ["done", "done"],
  ["rolledBack", "rolled back"],
  ["draining", "draining"],
  ["applying", "applying"],
  ["pending", "pending"],
  ["failed", "failed"],
  ["skipped", "skipped"],
];

export function Lifecycle() {
  const [nodes, setNodes] = useState<BringUpNode[] | null>(null);
  const [stuck, setStuck] = useState(0);
  const [upgrades, setUpgrades] = useState<Upgrade[] | null>(null);
  const [open, setOpen] = useState<Upgrade | null>(null);
  const [error, setError] = useState("");
  const [ask, setAsk] = useState<Ask | null>(null);
  const [outcome, setOutcome] = useState<{ ok: boolean; text: string } | null>(null);

  const load = () =>
    gql<{ bringUp: { stuck: number; items: BringUpNode[] }; upgrades: Upgrade[] }>(QUERY)
      .then((d) => {
        setNodes(d.bringUp.items);
        setStuck(d.bringUp.stuck);
        setUpgrades(d.upgrades);
        setError("");
      })
      .catch((e) => setError(problemText(asProblem(e))));
  const show = (id: string) =>
    gql<{ upgrade: Upgrade }>(ONE, { id })
      .then((d) => setOpen(d.upgrade))
      .catch((e) => setError(problemText(asProblem(e))));
  useEffect(() => {
    load();
  }, []);

  const run = async (name: "resumeUpgrade" | "rollbackUpgrade", u: Upgrade) => {
    setOutcome(null);
    try {
      const d = await gql<Record<string, (Upgrade & { __typename: string }) | Problem>>(act(name), { id: u.id });
      const r = d[name];
      if (isProblem(r)) setOutcome({ ok: false, text: problemText(r) });
      else {
        setOutcome({ ok: true, text: `Upgrade to ${r.stack}: ${r.state.replace("_", " ")}.` });
        await load();
        await show(u.id);
      }
    } catch (e) {
      setOutcome({ ok: false, text: problemText(asProblem(e)) });
    }
  };

  return (
    <>
      <h1>Fleet lifecycle</h1>
      {error && (
        <p class="error" role="alert">
          {error}
        </p>
      )}
      <section aria-labelledby="bu-h">
        <h2 id="bu-h">
          Bring-up: {nodes ? nodes.length : "…"} node(s) on their way into service{stuck ? `, ${stuck} stuck` : ""}
        </h2>
        <p class="muted">
          New nodes, nodes back from a repair or an RMA, and nodes in an upgrade take no work until their burn-in passes (<code>rackplane fleet history NODE</code>{" "}
          tells each step).
        </p>
        <button type="button" onClick={load}>
          Refresh
        </button>
        {!nodes ? (
          !error && <p class="loading">Loading…</p>
        ) : nodes.length === 0 ? (
          <p data-testid="no-bring-up">Every node with an agent is in service.</p>
        ) : (
          <table data-testid="bring-up">
            <thead>
              <tr>
                <th scope="col">Node</th>
                <th scope="col">Where</th>
                <th scope="col">Why</th>
                <th scope="col">Burn-in</th>
                <th scope="col">Since</th>
                <th scope="col">Stuck?</th>
              </tr>
            </thead>
            <tbody>
              {nodes.map((n) => (
                <tr data-node={n.node} data-stuck={n.stuck ? "yes" : "no"}>
                  <th scope="row">{n.node}</th>
                  <td>
                    {n.region}/{n.rack}
                  </td>
                  <td>
                    {n.why} <span class="muted">({n.health}, {n.state})</span>
                  </td>
                  <td>{n.steps ? `${n.stepsDone}/${n.steps}${n.step ? `: ${n.step}` : ""}` : "—"}</td>
                  <td>{when(n.since)}</td>
                  <td class={n.stuck ? "error" : ""}>{n.stuck ?? "no"}</td>
                </tr>
              ))}
            </tbody>
          </table>
        )}
      </section>
      <section aria-labelledby="up-h">
        <h2 id="up-h">Rolling upgrades</h2>
        <p class="muted">
          Started with <code>rackplane fleet upgrade --stack NAME --pool P</code> or <code>POST /v1/admin/upgrades</code>.
        </p>
        {!upgrades ? null : upgrades.length === 0 ? (
          <p data-testid="no-upgrades">No upgrades yet.</p>
        ) : (
          <table data-testid="upgrades">
            <thead>
              <tr>
                <th scope="col">Stack</th>
                <th scope="col">Scope</th>
                <th scope="col">State</th>
                <th scope="col">Nodes</th>
                <th scope="col">GPU-hours out</th>
                <th scope="col">Work moved</th>
                <th scope="col">Started</th>
              </tr>
            </thead>
            <tbody>
              {upgrades.map((u) => (
                <tr data-id={u.id} data-state={u.state}>
                  <th scope="row">
                    <button type="button" class="link" onClick={() => show(u.id)}>
                      {u.stack}
                    </button>
                  </th>
                  <td>
                    {u.scopeKind} {u.scope}
                  </td>
                  <td>
                    {u.state.replace("_", " ")}
                    {u.stateReason ? ` (${u.stateReason})` : ""}
                  </td>
                  <td>
                    {PHASES.filter(([k]) => u.progress[k])
                      .map(([k, label]) => `${u.progress[k]} ${label}`)
                      .join(", ")}
                  </td>
                  <td>{u.report.gpuHoursOutOfService.toFixed(2)}</td>
                  <td>{u.report.workMoved}</td>
                  <td>{when(u.createdAt)}</td>
                </tr>
              ))}
            </tbody>
          </table>
        )}
        <Outcome id="upgrade-outcome" outcome={outcome} />
      </section>
      {open && (
        <section aria-labelledby="one-h" data-testid="upgrade" data-state={open.state}>
          <h2 id="one-h">
            Upgrade to {open.stack} on {open.scopeKind} {open.scope}: {open.state.replace("_", " ")}
          </h2>
          <p>
            {open.unitsAtOnce} unit(s) at once (batch {open.batch}), at most {open.maxUnavailablePct}% of the GPUs out; pauses at {open.maxFailures} failure(s).{" "}
            {open.report.failures} failure(s) so far.
          </p>
          <div class="actions">
            {open.state === "paused" && (
              <button
                type="button"
                aria-haspopup="dialog"
                onClick={() =>
                  setAsk({
                    title: `Resume the upgrade to ${open.stack}?`,
                    action: "Resume",
                    body: <p>Units start again, and its failed nodes are tried again.</p>,
                    run: () => run("resumeUpgrade", open),
                  })
                }
              >
                Resume
              </button>
            )}
            {["running", "paused", "done"].includes(open.state) && (
              <button
                type="button"
                class="danger"
                aria-haspopup="dialog"
                onClick={() =>
                  setAsk({
                    title: `Roll back the upgrade to ${open.stack}?`,
                    action: "Roll back",
                    body: <p>Every node it touched is drained and returns to the stack it ran before; nodes it has not reached are left alone.</p>,
                    run: () => run("rollbackUpgrade", open),
                  })
                }
              >
                Roll back
              </button>
            )}
          </div>
          <table data-testid="upgrade-nodes">
            <thead>
              <tr>
                <th scope="col">Node</th>
                <th scope="col">Unit</th>
                <th scope="col">Phase</th>
                <th scope="col">From</th>
                <th scope="col">Moved</th>
                <th scope="col">Out</th>
                <th scope="col">Back</th>
                <th scope="col">Detail</th>
              </tr>
            </thead>
            <tbody>
              {(open.nodes ?? []).map((n) => (
                <tr data-node={n.node} data-phase={n.phase}>
                  <th scope="row">{n.node}</th>
                  <td>{n.unit}</td>
                  <td>{n.phase.replace("_", " ")}</td>
                  <td>{n.fromStack ?? "—"}</td>
                  <td>{n.workMoved}</td>
                  <td>{when(n.takenAt)}</td>
                  <td>{when(n.backAt)}</td>
                  <td>{n.detail ?? ""}</td>
                </tr>
              ))}
            </tbody>
          </table>
        </section>
      )}
      <AskDialog id="lifecycle-ask" ask={ask} onClose={() => setAsk(null)} />
    </>
  );
}
