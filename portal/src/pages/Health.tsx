// Operators: the fleet's health: per region what is healthy, allocated and out; the open
// incidents and the recent ones (within the circuit breaker's window); and the hardware out of
// the pool, each GPU or node with a Release (after a confirmation, with a reason for the audit
// log).
import { useEffect, useState } from "preact/hooks";
import { asProblem, gql, isProblem, problemText, PROBLEM_FIELDS, when, type Problem } from "../api";
import { AskDialog, Outcome, type Ask } from "../ui";

const QUERY = `query Health { fleetHealth {
  regions { region gpus byHealth byAllocation { allocated idle unavailable } racks { rack out { node gpuIndex health reason since } } }
  incidents { id node region state openedAt lastSignalAt signal xid action what gpuIndices signals heldBack }
} }`;
const NODE_ID = `query NodeId($name: String!) { nodes(first: 1, name: $name) { edges { node { id name } } } }`;
const ACTION_FIELDS = `__typename ... on HealthAction { nodeId gpuIndex health } ${PROBLEM_FIELDS}`;
const GPU_ACTION = `mutation GpuHealth($node: ID!, $index: Int!, $input: HealthActionInput!) {
  setGpuHealth(nodeId: $node, gpuIndex: $index, input: $input) { ${ACTION_FIELDS} }
}`;
const NODE_ACTION = `mutation NodeHealth($node: ID!, $input: HealthActionInput!) {
  setNodeHealth(id: $node, input: $input) { ${ACTION_FIELDS} }
}`;

interface Out {
  node: string;
  gpuIndex: number | null;
  health: string;
  reason: string | null;
  since: string | null;
}
interface Incident {
  id: string;
  node: string | null;
  region: string;
  state: string;
  openedAt: string;
  lastSignalAt: string;
  signal: string;
  xid: number | null;
  action: string;
  what: string;
  gpuIndices: number[];
  signals: number;
  heldBack: string | null;
}
interface FleetHealth {
  regions: {
    region: string;
    gpus: number;
    byHealth: Record<string, number>;
    byAllocation: { allocated: number; idle: number; unavailable: number };
    racks: { rack: string; out: Out[] }[];
  }[];
  incidents: Incident[];
}
type Result = { __typename: string; health: string } | Problem;

// An operator may release what the health loop holds (quarantined, draining, repairing), a
// suspect GPU, and what is out of service or unreachable (through validation); a validating
// one finishes by itself.
const RELEASABLE = new Set(["suspect", "quarantined", "draining", "repairing", "out_of_service", "unreachable"]);

const what = (o: { node: string; gpuIndex: number | null }) => (o.gpuIndex == null ? `node ${o.node}` : `GPU ${o.gpuIndex} of ${o.node}`);

export function Health() {
  const [h, setH] = useState<FleetHealth | null>(null);
  const [error, setError] = useState("");
  const [ask, setAsk] = useState<Ask | null>(null);
  const [outcome, setOutcome] = useState<{ ok: boolean; text: string } | null>(null);
  const [loadedAt, setLoadedAt] = useState(0);

  const load = () =>
    gql<{ fleetHealth: FleetHealth }>(QUERY)
      .then((d) => {
        setH(d.fleetHealth);
        setLoadedAt(Date.now());
        setError("");
      })
      .catch((e) => setError(problemText(asProblem(e))));
  useEffect(() => {
    load();
  }, []);

  const release = async (o: Out, reason: string | null) => {
    setOutcome(null);
    try {
      const found = await gql<{ nodes: { edges: { node: { id: string } }[] } }>(NODE_ID, { name: o.node });
      const id = found.nodes.edges[0]?.node.id;
      if (!id) return setOutcome({ ok: false, text: `No node ${o.node} any more.` });
      const input = { action: "release", reason };
      const d =
        o.gpuIndex == null
          ? (await gql<{ setNodeHealth: Result }>(NODE_ACTION, { node: id, input })).setNodeHealth
          : (await gql<{ setGpuHealth: Result }>(GPU_ACTION, { node: id, index: o.gpuIndex, input })).setGpuHealth;
      if (isProblem(d)) setOutcome({ ok: false, text: `${what(o)}: ${problemText(d)}` });
      else setOutcome({ ok: true, text: `Released ${what(o)}: it is ${d.health}${d.health === "validating" ? " (back in service once validated)" : ""}.` });
    } catch (e) {
      setOutcome({ ok: false, text: problemText(asProblem(e)) });
    }
    load();
  };

  if (!h) return error ? <p class="error" role="alert">{error}</p> : <p class="loading">Loading…</p>;
  const open = h.incidents.filter((i) => i.state === "open");
  const recent = h.incidents.filter((i) => i.state !== "open");
  const out = h.regions.flatMap((r) => r.racks.flatMap((k) => k.out.map((o) => ({ ...o, region: r.region, rack: k.rack }))));
  return (
    <>
      <h1>Health</h1>
      <p class="actions">
        <button type="button" onClick={load}>
          Refresh
        </button>
        <span class="muted" data-testid="health-loaded">
          As of {when(new Date(loadedAt).toISOString())}
        </span>
      </p>
      {error && (
        <p class="error" role="alert">
          {error}
        </p>
      )}
      <div class="grid">
        <section aria-labelledby="regions-h" class="wide">
          <h2 id="regions-h">By region</h2>
          <table data-testid="health-regions">
            <thead>
              <tr>
                <th scope="col">Region</th>
                <th scope="col">GPUs</th>
                <th scope="col">Allocated</th>
                <th scope="col">Idle</th>
                <th scope="col">Unavailable</th>
                <th scope="col">By health</th>
              </tr>
            </thead>
            <tbody>
              {h.regions.map((r) => (
                <tr>
                  <th scope="row">{r.region}</th>
                  <td>{r.gpus}</td>
                  <td>{r.byAllocation.allocated}</td>
                  <td>{r.byAllocation.idle}</td>
                  <td>{r.byAllocation.unavailable}</td>
                  <td>
                    {Object.entries(r.byHealth)
                      .sort()
                      .map(([k, n]) => `${k} ${n}`)
                      .join(", ")}
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        </section>
        <Incidents id="open" title="Open incidents" none="No open incident." items={open} />
        <Incidents id="recent" title="Recent incidents (closed, within the circuit breaker's window)" none="No recent incident." items={recent} />
        <section aria-labelledby="out-h" class="wide">
          <h2 id="out-h">Hardware out of the pool, or watched</h2>
          <Outcome id="health-outcome" outcome={outcome} />
          {out.length === 0 ? (
            <p data-testid="nothing-out">Every GPU is in service.</p>
          ) : (
            <table data-testid="out">
              <thead>
                <tr>
                  <th scope="col">Node</th>
                  <th scope="col">GPU</th>
                  <th scope="col">Health</th>
                  <th scope="col">Why</th>
                  <th scope="col">Since</th>
                  <th scope="col">Where</th>
                  <th scope="col">
                    <span class="visually-hidden">Actions</span>
                  </th>
                </tr>
              </thead>
              <tbody>
                {out.map((o) => (
                  <tr data-node={o.node} data-gpu={o.gpuIndex ?? "node"} data-health={o.health}>
                    <th scope="row">{o.node}</th>
                    <td>{o.gpuIndex ?? "whole node"}</td>
                    <td>
                      <span class={`state state-health-${o.health}`}>{o.health}</span>
                    </td>
                    <td>{o.reason ?? "—"}</td>
                    <td>{when(o.since)}</td>
                    <td>
                      {o.region} / {o.rack}
                    </td>
                    <td>
                      {RELEASABLE.has(o.health) && (
                        <button
                          type="button"
                          aria-haspopup="dialog"
                          aria-label={`Release ${what(o)}`}
                          onClick={() =>
                            setAsk({
                              title: `Release ${what(o)}?`,
                              action: "Release",
                              reason: true,
                              body: (
                                <p>
                                  It is {o.health}
                                  {o.reason ? ` (${o.reason})` : ""}.{" "}
                                  {o.health === "out_of_service" || o.health === "unreachable"
                                    ? "It goes through validation, then back into service."
                                    : "It goes back into service now: placement may use it at once. Release it only once you have checked it."}
                                </p>
                              ),
                              run: (reason) => release(o, reason),
                            })
                          }
                        >
                          Release
                        </button>
                      )}
                    </td>
                  </tr>
                ))}
              </tbody>
            </table>
          )}
        </section>
      </div>
      <AskDialog id="health-ask" ask={ask} onClose={() => setAsk(null)} />
    </>
  );
}

function Incidents({ id, title, none, items }: { id: string; title: string; none: string; items: Incident[] }) {
  return (
    <section aria-labelledby={`${id}-h`} class="wide">
      <h2 id={`${id}-h`}>
        {title} <small class="muted">{items.length}</small>
      </h2>
      {items.length === 0 ? (
        <p>{none}</p>
      ) : (
        <table data-testid={`incidents-${id}`}>
          <thead>
            <tr>
              <th scope="col">Opened</th>
              <th scope="col">Node</th>
              <th scope="col">GPUs</th>
              <th scope="col">Signal</th>
              <th scope="col">What</th>
              <th scope="col">Action</th>
              <th scope="col">Signals</th>
              <th scope="col">Last signal</th>
              <th scope="col">Circuit breaker</th>
            </tr>
          </thead>
          <tbody>
            {items.map((i) => (
              <tr data-incident={i.id} data-node={i.node ?? ""}>
                <td>{when(i.openedAt)}</td>
                <th scope="row">{i.node ?? i.region}</th>
                <td>{i.gpuIndices.length ? i.gpuIndices.join(", ") : "—"}</td>
                <td>{i.xid != null ? `Xid ${i.xid}` : i.signal}</td>
                <td>{i.what}</td>
                <td>{i.action}</td>
                <td>{i.signals}</td>
                <td>{when(i.lastSignalAt)}</td>
                <td>{i.heldBack ?? "—"}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </section>
  );
}
