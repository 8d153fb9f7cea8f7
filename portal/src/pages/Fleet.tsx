import { select } from "d3-selection";
import { zoom, zoomIdentity, type ZoomBehavior, type ZoomTransform } from "d3-zoom";
import { useEffect, useRef, useState } from "preact/hooks";
import { ApiError, asProblem, gql, isProblem, problemText, PROBLEM_FIELDS, type Problem } from "../api";
import { ChartBox, PALETTE } from "../chart";
import { COLOURS, layout, type FleetMapData, type Layout } from "../heatmap";
import { AskDialog, Outcome, type Ask } from "../ui";

const MAP = `query FleetMap { fleetMap {
  generatedAt regions models nodes nodeStates nodeModels gpuCounts gpus
  racks { name region kind block nodes }
  mig { gpu layout }
  legend { code name description }
} }`;

const NODE = `query Node($name: String!) { nodes(first: 1, name: $name) { edges { node {
  id name state health healthReason gpuModel rack region nvlinkDomain
  gpus { index model health healthReason perf holders { workloadId tenantId tier milli migProfile migSlot } }
} } } }`;

const AGGREGATE_BELOW = 3; // zoom (screen pixels per GPU) under which racks draw aggregated

interface Point {
  gpu: number; // -1: none (or zoomed out)
  rack: number; // -1: none
}

const NODE_STATES: Record<string, string> = { r: "ready", c: "cordoned", d: "draining", x: "down", t: "retired" };

const UTILISATION = `query Util($from: DateTime!, $to: DateTime!) {
  utilisation(from: $from, to: $to, granularity: HOUR) {
    utilisationPct
    rows { start gpuModel region allocatedGpuHours idleGpuHours capacityGpuHours }
  }
}`;

interface Util {
  utilisationPct: number;
  rows: { start: string; gpuModel: string; region: string; allocatedGpuHours: number; idleGpuHours: number; capacityGpuHours: number }[];
}

export function Fleet() {
  // The charts load once the map is drawn: the map's one request goes first, alone.
  const [drawn, setDrawn] = useState(false);
  return (
    <>
      <h1>Fleet</h1>
      <Heatmap onDrawn={() => setDrawn(true)} />
      {drawn && (
        <div class="grid">
          <IdleByCause />
          <Utilisation />
        </div>
      )}
    </>
  );
}

interface Detail {
  id: string;
  name: string;
  state: string;
  health: string;
  healthReason: string | null;
  gpuModel: string;
  rack: string;
  region: string;
  nvlinkDomain: string;
  gpus: { index: number; model: string; health: string; healthReason: string | null; perf: number; holders: { workloadId: string; tenantId: string; tier: string; milli: number; migProfile: string | null; migSlot: number | null }[] }[];
}

function Heatmap({ onDrawn }: { onDrawn: () => void }) {
  const box = useRef<HTMLDivElement>(null);
  const canvas = useRef<HTMLCanvasElement>(null);
  const [map, setMap] = useState<FleetMapData | null>(null);
  const [lay, setLay] = useState<Layout | null>(null);
  const [error, setError] = useState("");
  const [renderMs, setRenderMs] = useState<number | null>(null);
  const [hover, setHover] = useState<(Point & { x: number; y: number }) | null>(null);
  const [detail, setDetail] = useState<Detail | null>(null);
  const transform = useRef<ZoomTransform>(zoomIdentity);
  const behaviour = useRef<ZoomBehavior<HTMLCanvasElement, unknown> | null>(null);
  const started = useRef(performance.now());

  // After an action: the map again, drawn where the operator was looking (not refitted).
  const keepView = useRef(false);
  const loadMap = (keep: boolean) => {
    started.current = performance.now();
    gql<{ fleetMap: FleetMapData }>(MAP)
      .then((d) => {
        keepView.current = keep;
        setMap(d.fleetMap);
      })
      .catch((e: ApiError) => setError(`${e.message} (${e.code})`));
  };
  useEffect(() => loadMap(false), []);

  // The zoom behaviour outlives renders: what it draws is read from refs, never a stale closure.
  const drawn = useRef<{ map: FleetMapData | null; lay: Layout | null }>({ map: null, lay: null });
  drawn.current = { map, lay };
  const frameMs = useRef(0);
  const draw = () => {
    const c = canvas.current;
    const { map, lay } = drawn.current;
    if (!c || !map || !lay) return;
    const began = performance.now();
    const ctx = c.getContext("2d")!;
    const dpr = window.devicePixelRatio || 1;
    const t = transform.current;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(0, 0, c.width, c.height);
    ctx.setTransform(dpr * t.k, 0, 0, dpr * t.k, dpr * t.x, dpr * t.y);
    // Zoomed out: each rack as the shares of its states; zoomed in: every GPU where it sits.
    const aggregated = t.k < AGGREGATE_BELOW;
    ctx.imageSmoothingEnabled = aggregated;
    ctx.drawImage(aggregated ? lay.sorted : lay.exact, 0, 0);
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    labels(ctx, map, lay, t, { w: c.width / dpr, h: c.height / dpr });
    frameMs.current = performance.now() - began;
    box.current?.setAttribute("data-frame-ms", frameMs.current.toFixed(1));
    box.current?.setAttribute("data-zoom", t.k.toFixed(3));
  };

  // Lay out once the map arrives, then fit it to the view and draw: the render time is from
  // the request to the first frame with every GPU on it.
  useEffect(() => {
    if (!map || !box.current || !canvas.current) return;
    const c = canvas.current;
    const w = box.current.clientWidth;
    const h = 560;
    const dpr = window.devicePixelRatio || 1;
    c.width = Math.round(w * dpr);
    c.height = Math.round(h * dpr);
    c.style.width = `${w}px`;
    c.style.height = `${h}px`;
    const l = layout(map, w / h);
    setLay(l);
    const k = Math.min(w / l.width, h / l.height) * 0.98;
    const fit = zoomIdentity.translate((w - l.width * k) / 2, 16).scale(k);
    const b = zoom<HTMLCanvasElement, unknown>()
      .scaleExtent([k / 2, 64])
      .on("zoom", (e) => {
        transform.current = e.transform;
        requestAnimationFrame(draw);
      });
    behaviour.current = b;
    const view = keepView.current ? transform.current : fit;
    keepView.current = false;
    select(c).call(b).call(b.transform, view);
    transform.current = view;
  }, [map]);

  useEffect(() => {
    if (!lay) return;
    draw();
    requestAnimationFrame(() => {
      setRenderMs(Math.round(performance.now() - started.current));
      onDrawn();
    });
  }, [lay]);

  // What is under the pointer: zoomed out, a rack (its summary); zoomed in, a GPU.
  const pointAt = (clientX: number, clientY: number): Point => {
    const none = { gpu: -1, rack: -1 };
    if (!lay || !canvas.current) return none;
    const r = canvas.current.getBoundingClientRect();
    const t = transform.current;
    const x = Math.floor((clientX - r.left - t.x) / t.k);
    const y = Math.floor((clientY - r.top - t.y) / t.k);
    if (x < 0 || y < 0 || x >= lay.width || y >= lay.height) return none;
    const px = y * lay.width + x;
    return { gpu: t.k < AGGREGATE_BELOW ? -1 : lay.at[px], rack: lay.rackAt[px] };
  };

  const open = async (p: Point) => {
    const b = behaviour.current;
    if (!map || !lay || !b || !canvas.current) return;
    if (p.gpu < 0 && p.rack >= 0) {
      // Drill down: the rack, zoomed until its GPUs show one by one.
      const box = lay.rackBoxes[p.rack];
      const k = 24;
      const w = canvas.current.clientWidth;
      const h = canvas.current.clientHeight;
      const to = zoomIdentity.translate(w / 2 - k * (box.x + box.w / 2), h / 2 - k * (box.y + box.h / 2)).scale(k);
      select(canvas.current).call(b.transform, to);
      return;
    }
    if (p.gpu < 0) return;
    openNode(map.nodes[lay.cells[p.gpu].node]);
  };

  /** A node's detail by its name; false: no such node. */
  const openNode = async (name: string): Promise<boolean> => {
    try {
      const d = await gql<{ nodes: { edges: { node: Detail }[] } }>(NODE, { name });
      const node = d.nodes.edges[0]?.node ?? null;
      if (node) setDetail(node);
      return !!node;
    } catch (e) {
      setError(`${(e as ApiError).message}`);
      return true;
    }
  };
  const [lookFor, setLookFor] = useState("");
  const [lookError, setLookError] = useState("");

  const keys = (e: KeyboardEvent) => {
    const b = behaviour.current;
    if (!b || !canvas.current) return;
    const sel = select(canvas.current);
    const step = 60;
    const moves: Record<string, () => void> = {
      ArrowLeft: () => b.translateBy(sel, step / transform.current.k, 0),
      ArrowRight: () => b.translateBy(sel, -step / transform.current.k, 0),
      ArrowUp: () => b.translateBy(sel, 0, step / transform.current.k),
      ArrowDown: () => b.translateBy(sel, 0, -step / transform.current.k),
      "+": () => b.scaleBy(sel, 1.5),
      "=": () => b.scaleBy(sel, 1.5),
      "-": () => b.scaleBy(sel, 1 / 1.5),
    };
    if (moves[e.key]) {
      e.preventDefault();
      moves[e.key]();
    }
  };

  const cell = hover && map && lay && hover.gpu >= 0 ? lay.cells[hover.gpu] : null;
  const rack = hover && map && lay && !cell && hover.rack >= 0 ? hover.rack : null;
  const legendName = (code: string) => map?.legend.find((l) => l.code === code)?.name ?? code;
  return (
    <section aria-labelledby="map-h" class="wide heatmap">
      <h2 id="map-h">
        GPUs by state{" "}
        {map && (
          <small data-testid="map-summary">
            {map.gpus.length.toLocaleString("en")} GPUs · {map.nodes.length.toLocaleString("en")} nodes · {map.racks.length.toLocaleString("en")} racks
            {renderMs != null && ` · drawn in ${renderMs} ms`}
          </small>
        )}
      </h2>
      {error && <p class="error" role="alert">{error}</p>}
      <p class="muted" id="map-help">
        Drag to pan, wheel or +/− to zoom, arrow keys to move. Zoomed out, each rack shows the shares of its states: hover it for its counts, click
        to zoom into it. Zoomed in, hover a GPU for its state, click it for its node (or open a node by its name below).
      </p>
      <form
        class="inline-form"
        onSubmit={async (e) => {
          e.preventDefault();
          const name = lookFor.trim();
          if (!name) return setLookError("Enter a node's name.");
          const found = await openNode(name);
          setLookError(found ? "" : `No node named ${name}.`);
          // Asked for by name (the keyboard's way in): its detail takes the focus.
          if (found) requestAnimationFrame(() => document.getElementById("node-detail-h")?.focus());
        }}
      >
        <label for="node-name">Node name</label>
        <input id="node-name" value={lookFor} aria-invalid={!!lookError} aria-describedby="node-name-error" onInput={(e) => setLookFor((e.currentTarget as HTMLInputElement).value)} />
        <button type="submit">Open node</button>
        <span id="node-name-error" class="field-error" role="alert">
          {lookError}
        </span>
      </form>
      <div class="map" ref={box} data-testid="heatmap" data-render-ms={renderMs ?? undefined} data-gpus={map?.gpus.length}>
        <canvas
          ref={canvas}
          tabIndex={0}
          role="img"
          aria-label="Fleet heatmap: racks as columns of nodes, nodes as rows of GPUs, coloured by state"
          aria-describedby="map-help"
          onKeyDown={keys}
          onMouseMove={(e) => setHover({ x: e.offsetX, y: e.offsetY, ...pointAt(e.clientX, e.clientY) })}
          onMouseLeave={() => setHover(null)}
          onClick={(e) => open(pointAt(e.clientX, e.clientY))}
        />
        {rack != null && map && lay && hover && (
          <div class="tip" role="tooltip" data-testid="map-tip" data-kind="rack" style={{ left: `${hover.x + 14}px`, top: `${hover.y + 14}px` }}>
            <strong>{map.racks[rack].name}</strong> ({map.racks[rack].kind}, {map.regions[map.racks[rack].region]}) · click to zoom in
            {map.legend
              .filter((l) => lay.rackCounts[rack][l.code])
              .map((l) => (
                <>
                  <br />
                  {l.name}: {lay.rackCounts[rack][l.code]}
                </>
              ))}
          </div>
        )}
        {cell && map && lay && hover && (
          <div class="tip" role="tooltip" data-testid="map-tip" data-kind="gpu" style={{ left: `${hover.x + 14}px`, top: `${hover.y + 14}px` }}>
            <strong>{map.nodes[cell.node]}</strong> GPU {cell.index}
            <br />
            {map.regions[map.racks[cell.rack].region]} / {map.racks[cell.rack].name} ({map.racks[cell.rack].kind})
            <br />
            {map.models[map.nodeModels[cell.node]]} · {legendName(map.gpus[cell.gpu])} · node {NODE_STATES[map.nodeStates[cell.node]]}
            {lay.mig.has(cell.gpu) && (
              <>
                <br />
                MIG: {lay.mig.get(cell.gpu) || "no slice held"}
              </>
            )}
          </div>
        )}
      </div>
      {map && lay && (
        <ul class="legend" aria-label="Legend">
          {map.legend.map((l) => (
            <li title={l.description}>
              <span class="swatch" style={{ background: COLOURS[l.code] }} aria-hidden="true">
                {l.code}
              </span>
              {l.name} <span class="muted">{(lay.counts[l.code] ?? 0).toLocaleString("en")}</span>
            </li>
          ))}
        </ul>
      )}
      {detail && (
        <NodeDetail
          key={detail.name}
          detail={detail}
          onClose={() => setDetail(null)}
          onChanged={async () => {
            await openNode(detail.name);
            loadMap(true);
          }}
        />
      )}
    </section>
  );
}

const SET_STATE = `mutation NodeState($id: ID!, $input: NodeStateInput!) { setNodeState(id: $id, input: $input) {
  __typename ... on Node { name state } ${PROBLEM_FIELDS}
} }`;
const GPU_HEALTH = `mutation GpuHealth($node: ID!, $index: Int!, $input: HealthActionInput!) {
  setGpuHealth(nodeId: $node, gpuIndex: $index, input: $input) { __typename ... on HealthAction { gpuIndex health } ${PROBLEM_FIELDS} }
}`;

// An operator's node states: what each button does, and from which states (app/fleet/service.py
// NODE_TRANSITIONS; the API refuses the rest with invalid_state_transition).
const NODE_ACTIONS: { state: string; label: string; from: string[]; says: string }[] = [
  { state: "cordoned", label: "Cordon", from: ["ready", "draining", "down"], says: "Nothing new is placed on it; the work on it carries on." },
  {
    state: "draining",
    label: "Drain",
    from: ["ready", "cordoned"],
    says: "Nothing new is placed on it; its running work gets its grace period to checkpoint, then moves elsewhere.",
  },
  {
    state: "down",
    label: "Mark down",
    from: ["ready", "cordoned", "draining"],
    says: "The hardware is taken as gone: the work on it stops now (its usage too) and is requeued at once.",
  },
  { state: "ready", label: "Ready", from: ["cordoned", "draining", "down"], says: "It takes work again." },
];
// A GPU an operator may quarantine (the rest are out already), and one to release: what the
// health loop holds, or out of service (through validation); a validating one finishes alone.
const QUARANTINABLE = new Set(["healthy", "suspect"]);
const RELEASABLE = new Set(["suspect", "quarantined", "draining", "repairing", "out_of_service"]);

type Gpu = Detail["gpus"][0];

function holdersText(g: Gpu): string {
  return g.holders.length
    ? g.holders
        .map((h) => `${h.workloadId.slice(0, 8)} (${h.tier}${h.migProfile ? ` ${h.migProfile}@${h.migSlot}` : ""}${h.milli < 1000 && !h.migProfile ? ` ${h.milli / 1000} GPU` : ""})`)
        .join(", ")
    : "—";
}

/** A node's detail: where it is, its GPUs and who holds them; the operator's actions on it
 * (cordon, drain, mark down, ready) and on each GPU (quarantine, release), each asked first. */
function NodeDetail({ detail, onClose, onChanged }: { detail: Detail; onClose: () => void; onChanged: () => Promise<void> }) {
  const [ask, setAsk] = useState<Ask | null>(null);
  const [outcome, setOutcome] = useState<{ ok: boolean; text: string } | null>(null);
  const [busy, setBusy] = useState(false);
  const d = detail;
  const workloads = new Set(d.gpus.flatMap((g) => g.holders.map((h) => h.workloadId)));
  const held = workloads.size ? `${workloads.size} workload(s) hold GPUs on it now.` : "Nothing runs on it now.";

  const run = async (what: () => Promise<{ __typename: string } | Problem>, done: (r: any) => string) => {
    setBusy(true);
    setOutcome(null);
    try {
      const r = await what();
      if (isProblem(r)) setOutcome({ ok: false, text: problemText(r) });
      else {
        setOutcome({ ok: true, text: done(r) });
        await onChanged();
      }
    } catch (e) {
      setOutcome({ ok: false, text: problemText(asProblem(e)) });
    } finally {
      setBusy(false);
    }
  };
  const setState = (state: string, reason: string | null) =>
    run(
      async () => (await gql<{ setNodeState: { __typename: string } | Problem }>(SET_STATE, { id: d.id, input: { state, reason } })).setNodeState,
      (r) => `${r.name} is ${r.state}.`,
    );
  const gpuAction = (g: Gpu, action: "quarantine" | "release", reason: string | null) =>
    run(
      async () => (await gql<{ setGpuHealth: { __typename: string } | Problem }>(GPU_HEALTH, { node: d.id, index: g.index, input: { action, reason } })).setGpuHealth,
      (r) => `GPU ${g.index} of ${d.name} is ${r.health}.`,
    );

  return (
    <div class="detail" data-testid="node-detail" data-node={d.name} data-state={d.state} role="region" aria-label={`Node ${d.name}`}>
      <h3 id="node-detail-h" tabIndex={-1}>
        {d.name}{" "}
        <button type="button" onClick={onClose} aria-label="Close node details">
          ×
        </button>
      </h3>
      <p>
        {d.region} / {d.rack} · NVLink domain {d.nvlinkDomain} · {d.gpuModel} · <span data-testid="node-state">{d.state}</span> · {d.health}
        {d.healthReason ? ` (${d.healthReason})` : ""}
      </p>
      <div class="actions" role="group" aria-label={`Node ${d.name} actions`}>
        {NODE_ACTIONS.filter((a) => a.from.includes(d.state)).map((a) => (
          <button
            type="button"
            aria-haspopup="dialog"
            class={a.state === "down" ? "danger" : undefined}
            disabled={busy}
            onClick={() =>
              setAsk({
                title: `${a.label} ${d.name}?`,
                action: a.label,
                reason: true,
                body: (
                  <p>
                    {d.name} is {d.state}; it becomes {a.state}. {a.says} {a.state === "draining" || a.state === "down" ? held : ""}
                  </p>
                ),
                run: (reason) => setState(a.state, reason),
              })
            }
          >
            {a.label}
          </button>
        ))}
        {d.state === "retired" && <span class="muted">Retired for good: no actions.</span>}
      </div>
      <Outcome id="node-outcome" outcome={outcome} />
      <table class="compact">
        <thead>
          <tr>
            <th scope="col">GPU</th>
            <th scope="col">Health</th>
            <th scope="col">Speed</th>
            <th scope="col">Held by</th>
            <th scope="col">
              <span class="visually-hidden">Actions</span>
            </th>
          </tr>
        </thead>
        <tbody>
          {d.gpus.map((g) => (
            <tr data-gpu={g.index} data-health={g.health}>
              <td>{g.index}</td>
              <td>
                {g.health}
                {g.healthReason ? ` (${g.healthReason})` : ""}
              </td>
              <td>{(g.perf * 100).toFixed(0)}%</td>
              <td>{holdersText(g)}</td>
              <td>
                {QUARANTINABLE.has(g.health) && (
                  <button
                    type="button"
                    aria-haspopup="dialog"
                    aria-label={`Quarantine GPU ${g.index}`}
                    disabled={busy}
                    onClick={() =>
                      setAsk({
                        title: `Quarantine GPU ${g.index} of ${d.name}?`,
                        action: "Quarantine",
                        reason: true,
                        body: (
                          <p>
                            It leaves the pool now.{" "}
                            {g.holders.length
                              ? `The work on it (${holdersText(g)}) stops and is requeued ahead of its peers.`
                              : "Nothing runs on it."}{" "}
                            It stays out until it is released.
                          </p>
                        ),
                        run: (reason) => gpuAction(g, "quarantine", reason),
                      })
                    }
                  >
                    Quarantine
                  </button>
                )}
                {RELEASABLE.has(g.health) && (
                  <button
                    type="button"
                    aria-haspopup="dialog"
                    aria-label={`Release GPU ${g.index}`}
                    disabled={busy}
                    onClick={() =>
                      setAsk({
                        title: `Release GPU ${g.index} of ${d.name}?`,
                        action: "Release",
                        reason: true,
                        body: (
                          <p>
                            It is {g.health}.{" "}
                            {g.health === "out_of_service"
                              ? "It goes through validation, then back into service."
                              : "It goes back into service now: placement may use it at once."}
                          </p>
                        ),
                        run: (reason) => gpuAction(g, "release", reason),
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
      <AskDialog id="node-ask" ask={ask} onClose={() => setAsk(null)} />
    </div>
  );
}

function Utilisation() {
  const [u, setU] = useState<Util | null>(null);
  const [error, setError] = useState("");
  useEffect(() => {
    const to = new Date(Math.ceil(Date.now() / 3600e3) * 3600e3);
    const from = new Date(to.getTime() - 24 * 3600e3);
    gql<{ utilisation: Util }>(UTILISATION, { from: from.toISOString(), to: to.toISOString() })
      .then((d) => setU(d.utilisation))
      .catch((e: ApiError) => setError(`${e.message} (${e.code})`));
  }, []);
  if (!u) return error ? <p class="error" role="alert">{error}</p> : <p class="loading">Loading utilisation…</p>;
  const models = [...new Set(u.rows.map((r) => r.gpuModel))].sort();
  const sum = (m: string, f: (r: Util["rows"][0]) => number) => u.rows.filter((r) => r.gpuModel === m).reduce((n, r) => n + f(r), 0);
  const pct = models.map((m) => {
    const cap = sum(m, (r) => r.capacityGpuHours);
    return cap ? (100 * sum(m, (r) => r.allocatedGpuHours)) / cap : 0;
  });
  return (
    <section aria-labelledby="util-h">
      <h2 id="util-h">Utilisation per model, last 24 h ({u.utilisationPct.toFixed(1)}% overall)</h2>
      <ChartBox
        label="Share of GPU-hours allocated per GPU model over the last 24 hours"
        testid="util-chart"
        config={{
          type: "bar",
          data: { labels: models, datasets: [{ label: "Allocated %", data: pct, backgroundColor: PALETTE[0] }] },
          options: { indexAxis: "y", scales: { x: { min: 0, max: 100, title: { display: true, text: "% of GPU-hours allocated" } } } },
        }}
      />
    </section>
  );
}

/** Region names; zoomed in, rack names; closer still, each GPU's state letter (not colour alone). */
function labels(ctx: CanvasRenderingContext2D, map: FleetMapData, lay: Layout, t: ZoomTransform, size: { w: number; h: number }) {
  const font = (px: number, family = "system-ui, sans-serif") => (ctx.font = `${px}px ${family}`);
  ctx.fillStyle = "#1b1f24";
  font(12);
  const named = t.k >= 6; // rack names sit right above the racks: the region's goes higher
  for (const r of lay.regionY) ctx.fillText(map.regions[r.region], t.x, t.y + t.k * r.y - (named ? 18 : 3));
  if (!named) return;
  const view = { x0: -t.x / t.k, y0: -t.y / t.k, x1: (size.w - t.x) / t.k, y1: (size.h - t.y) / t.k };
  for (const b of lay.rackBoxes) {
    if (b.x > view.x1 || b.x + b.w < view.x0 || b.y > view.y1 || b.y + b.h < view.y0) continue;
    ctx.fillStyle = "#1b1f24";
    font(Math.min(12, t.k));
    ctx.fillText(map.racks[b.rack].name, t.x + t.k * b.x, t.y + t.k * b.y - 2);
    if (t.k < 14) continue;
    font(Math.floor(t.k * 0.6), "monospace");
    for (let k = 0; k < b.h; k++)
      for (let i = 0; i < b.w; i++) {
        const gpu = lay.at[(b.y + k) * lay.width + b.x + i];
        if (gpu < 0) continue;
        const code = map.gpus[gpu];
        ctx.fillStyle = DARK.has(code) ? "#fff" : "#1b1f24";
        ctx.fillText(code, t.x + t.k * (b.x + i + 0.25), t.y + t.k * (b.y + k + 0.75));
      }
  }
}

const DARK = new Set(["D", "C", "X", "T", "M"]); // cells whose letter is drawn in white

const IDLE = `query Idle($from: DateTime!, $to: DateTime!) {
  idleTime(from: $from, to: $to, granularity: HOUR) { rows { start cause gpuHours } totals { cause gpuHours } }
}`;

const CAUSES: [string, string, string][] = [
  ["stranded", "Stranded: work waits that could use it", PALETTE[5]],
  ["no_demand", "No demand", PALETTE[7]],
  ["unhealthy", "Unhealthy", PALETTE[1]],
  ["cordoned", "Cordoned or down", PALETTE[0]],
];

interface Idle {
  rows: { start: string; cause: string; gpuHours: number }[];
  totals: { cause: string; gpuHours: number }[];
}

function IdleByCause() {
  const [idle, setIdle] = useState<Idle | null>(null);
  const [from, setFrom] = useState(0);
  const [error, setError] = useState("");
  useEffect(() => {
    const to = Math.ceil(Date.now() / 3600e3) * 3600e3;
    const start = to - 24 * 3600e3;
    gql<{ idleTime: Idle }>(IDLE, { from: new Date(start).toISOString(), to: new Date(to).toISOString() })
      .then((d) => {
        setFrom(start);
        setIdle(d.idleTime);
      })
      .catch((e: ApiError) => setError(`${e.message} (${e.code})`));
  }, []);
  if (!idle) return error ? <p class="error" role="alert">{error}</p> : <p class="loading">Loading idle time…</p>;
  const hours = Array.from({ length: 24 }, (_, i) => from + i * 3600e3);
  const total = (c: string) => idle.totals.find((t) => t.cause === c)?.gpuHours ?? 0;
  return (
    <section aria-labelledby="idle-h">
      <h2 id="idle-h">Idle GPU-hours by cause, last 24 h</h2>
      <ChartBox
        label="Idle GPU-hours per hour by cause: stranded, no demand, unhealthy, cordoned"
        testid="idle-chart"
        config={{
          type: "bar",
          data: {
            labels: hours.map((h) => new Date(h).toISOString().slice(11, 16)),
            datasets: CAUSES.map(([cause, label, colour]) => ({
              label,
              backgroundColor: colour,
              data: hours.map((h) => idle.rows.filter((r) => r.cause === cause && Date.parse(r.start) === h).reduce((n, r) => n + r.gpuHours, 0)),
            })),
          },
          options: { scales: { x: { stacked: true }, y: { stacked: true, beginAtZero: true, title: { display: true, text: "GPU-hours" } } } },
        }}
      />
      <table class="compact" data-testid="idle-totals">
        <tbody>
          {CAUSES.map(([cause, label]) => (
            <tr>
              <th scope="row">{label}</th>
              <td data-cause={cause}>{total(cause).toFixed(2)}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </section>
  );
}
