import { useEffect, useState } from "preact/hooks";
import { ApiError, gpuShare, gql, money, shapeText, when, type WorkloadSummary } from "../api";
import { ChartBox, PALETTE } from "../chart";

const QUERY = `query Dashboard($from: DateTime!, $to: DateTime!, $granularity: Granularity!) {
  viewer { name slug status }
  workloads(first: 200, active: true) {
    edges { node { id name kind state tier priority replicas gpuMilli region shape createdAt } }
    pageInfo { hasNextPage }
  }
  quotas { gpuModel guaranteedMilli limitMilli usedMilli queuedMilli }
  usage(from: $from, to: $to, granularity: $granularity, groupBy: [GPU_MODEL, SHAPE, TIER]) {
    rows { start group gpuHours }
    totalGpuHours
  }
  upcomingBill { period accruedUntil totals { currency amount } lines { sku tier region plan gpuHours unitAmount currency amount } }
  budget { currency spendLimit gpuHourLimit spent gpuHoursUsed exhausted alerts { metric thresholdPct createdAt } }
}`;

type Workload = WorkloadSummary;
interface Data {
  viewer: { name: string; slug: string; status: string };
  workloads: { edges: { node: Workload }[]; pageInfo: { hasNextPage: boolean } };
  quotas: { gpuModel: string; guaranteedMilli: number; limitMilli: number | null; usedMilli: number; queuedMilli: number }[];
  usage: { rows: { start: string; group: Record<string, string>; gpuHours: number }[]; totalGpuHours: number };
  upcomingBill: {
    period: string;
    accruedUntil: string;
    totals: { currency: string; amount: string }[];
    lines: { sku: string; tier: string; region: string; plan: string; gpuHours: number; unitAmount: string | null; currency: string | null; amount: string }[];
  };
  budget: null | {
    currency: string;
    spendLimit: string | null;
    gpuHourLimit: number | null;
    spent: string;
    gpuHoursUsed: number;
    exhausted: boolean;
    alerts: { metric: string; thresholdPct: number; createdAt: string }[];
  };
}

type Granularity = "HOUR" | "DAY";
const WINDOW: Record<Granularity, number> = { HOUR: 24 * 3600e3, DAY: 30 * 86400e3 };
const STEP: Record<Granularity, number> = { HOUR: 3600e3, DAY: 86400e3 };

export function Dashboard() {
  const [granularity, setGranularity] = useState<Granularity>("HOUR");
  const [data, setData] = useState<Data | null>(null);
  const [error, setError] = useState("");
  // The window the usage rows were asked for: until the other granularity's answer lands, its
  // rows are not drawn on this granularity's buckets.
  const [usageWindow, setUsageWindow] = useState<{ granularity: Granularity; from: number } | null>(null);
  useEffect(() => {
    let current = true; // a slower answer for the other granularity must not land after this one
    const load = async () => {
      const step = STEP[granularity];
      const to = new Date(Math.ceil(Date.now() / step) * step);
      const from = new Date(to.getTime() - WINDOW[granularity]);
      try {
        const d = await gql<Data>(QUERY, { from: from.toISOString(), to: to.toISOString(), granularity });
        if (!current) return;
        setData(d);
        setUsageWindow({ granularity, from: from.getTime() });
        setError("");
      } catch (e) {
        if (current) setError(e instanceof ApiError ? `${e.message} (${e.code})` : String(e));
      }
    };
    load();
    const t = setInterval(load, 10_000);
    return () => {
      current = false;
      clearInterval(t);
    };
  }, [granularity]);
  if (!data) return error ? <p class="error" role="alert">{error}</p> : <p class="loading">Loading…</p>;
  const workloads = data.workloads.edges.map((e) => e.node);
  return (
    <>
      <h1>
        {data.viewer.name} <small>({data.viewer.status})</small>
      </h1>
      {error && <p class="error" role="alert">{error}</p>}
      <div class="grid">
        <section aria-labelledby="wl-h" class="wide">
          <h2 id="wl-h">Running and queued workloads</h2>
          <WorkloadTable rows={workloads} />
          {data.workloads.pageInfo.hasNextPage && <p>Showing the oldest 200.</p>}
        </section>
        <section aria-labelledby="q-h">
          <h2 id="q-h">Quotas (GPUs)</h2>
          <Quotas quotas={data.quotas} />
        </section>
        <section aria-labelledby="b-h">
          <h2 id="b-h">This month so far</h2>
          <Bill bill={data.upcomingBill} budget={data.budget} />
        </section>
        <section aria-labelledby="u-h" class="wide">
          <h2 id="u-h">Usage by SKU and tier</h2>
          <fieldset class="toggle">
            <legend>Granularity</legend>
            {(["HOUR", "DAY"] as Granularity[]).map((g) => (
              <label>
                <input type="radio" name="granularity" value={g} checked={granularity === g} onChange={() => setGranularity(g)} />
                {g === "HOUR" ? "Hourly, last 24 h" : "Daily, last 30 days"}
              </label>
            ))}
          </fieldset>
          {usageWindow?.granularity === granularity ? (
            <>
              <Usage rows={data.usage.rows} granularity={granularity} from={usageWindow.from} />
              <p>
                Total: <span data-testid="usage-total">{data.usage.totalGpuHours.toFixed(4)}</span> GPU-hours
              </p>
            </>
          ) : (
            <p class="loading">Loading…</p>
          )}
        </section>
      </div>
    </>
  );
}

function WorkloadTable({ rows }: { rows: Workload[] }) {
  if (!rows.length) return <p>No running or queued work. <a href="/portal/submit">Submit a workload</a>.</p>;
  return (
    <table data-testid="workloads">
      <thead>
        <tr>
          <th scope="col">Workload</th>
          <th scope="col">State</th>
          <th scope="col">Kind</th>
          <th scope="col">Shape</th>
          <th scope="col">Tier</th>
          <th scope="col">Priority</th>
          <th scope="col">Region</th>
          <th scope="col">Submitted</th>
        </tr>
      </thead>
      <tbody>
        {rows.map((w) => (
          <tr>
            <td>
              <a href={`/portal/workloads/${w.id}`}>{w.name ?? w.id.slice(0, 8)}</a>
            </td>
            <td>
              <span class={`state state-${w.state}`}>{w.state}</span>
            </td>
            <td>{w.kind}</td>
            <td>{shapeText(w.shape, w.replicas)}</td>
            <td>{w.tier}</td>
            <td>{w.priority}</td>
            <td>{w.region ?? "—"}</td>
            <td>{when(w.createdAt)}</td>
          </tr>
        ))}
      </tbody>
    </table>
  );
}

function Quotas({ quotas }: { quotas: Data["quotas"] }) {
  if (!quotas.length) return <p>No quotas set: ask your operator.</p>;
  const g = (m: number | null) => (m == null ? null : m / 1000);
  return (
    <>
      <ChartBox
        label="Quota use per GPU model: used, queued, guaranteed and limit, in GPUs"
        testid="quota-chart"
        config={{
          type: "bar",
          data: {
            labels: quotas.map((q) => q.gpuModel),
            datasets: [
              { label: "Used", data: quotas.map((q) => g(q.usedMilli)!), backgroundColor: PALETTE[0] },
              { label: "Queued", data: quotas.map((q) => g(q.queuedMilli)!), backgroundColor: PALETTE[1] },
              { label: "Guaranteed", data: quotas.map((q) => g(q.guaranteedMilli)!), backgroundColor: PALETTE[2] },
              { label: "Limit", data: quotas.map((q) => g(q.limitMilli) ?? 0), backgroundColor: PALETTE[7] },
            ],
          },
          options: { indexAxis: "y", scales: { x: { beginAtZero: true, title: { display: true, text: "GPUs" } } } },
        }}
      />
      <table class="compact">
        <thead>
          <tr>
            <th scope="col">Model</th>
            <th scope="col">Used</th>
            <th scope="col">Queued</th>
            <th scope="col">Guaranteed</th>
            <th scope="col">Limit</th>
          </tr>
        </thead>
        <tbody>
          {quotas.map((q) => (
            <tr>
              <th scope="row">{q.gpuModel}</th>
              <td>{gpuShare(q.usedMilli)}</td>
              <td>{gpuShare(q.queuedMilli)}</td>
              <td>{gpuShare(q.guaranteedMilli)}</td>
              <td>{q.limitMilli == null ? "none" : gpuShare(q.limitMilli)}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </>
  );
}

function Bill({ bill, budget }: { bill: Data["upcomingBill"]; budget: Data["budget"] }) {
  const totals = bill.totals;
  return (
    <>
      <p class="big" data-testid="bill-total">
        {totals.length ? totals.map((t) => money(t.amount, t.currency)).join(" + ") : money(0, "usd")}
      </p>
      <p>
        {bill.period}, accrued until {when(bill.accruedUntil)}
      </p>
      {bill.lines.length > 0 && (
        <table class="compact" data-testid="upcoming-lines">
          <thead>
            <tr>
              <th scope="col">SKU</th>
              <th scope="col">Tier</th>
              <th scope="col">Region</th>
              <th scope="col">Plan</th>
              <th scope="col">GPU-h</th>
              <th scope="col">Amount</th>
            </tr>
          </thead>
          <tbody>
            {bill.lines.map((l) => (
              <tr>
                <td>{l.sku}</td>
                <td>{l.tier}</td>
                <td>{l.region}</td>
                <td>{l.plan.replace("_", " ")}</td>
                <td>{l.gpuHours.toFixed(3)}</td>
                <td>{l.currency ? money(l.amount, l.currency) : "unpriced"}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
      <h3>Budget</h3>
      {budget ? (
        <>
          <p>
            {budget.spendLimit != null && (
              <>
                Spent {money(budget.spent, budget.currency)} of {money(budget.spendLimit, budget.currency)}.{" "}
              </>
            )}
            {budget.gpuHourLimit != null && (
              <>
                {budget.gpuHoursUsed.toFixed(1)} of {budget.gpuHourLimit} GPU-hours.{" "}
              </>
            )}
            {budget.exhausted && <strong class="warn">Exhausted: new submissions are refused.</strong>}
          </p>
          {budget.alerts.length > 0 && (
            <ul class="alerts" aria-label="Budget alerts">
              {budget.alerts.map((a) => (
                <li>
                  ⚠ {a.metric === "spend" ? "Spend" : "GPU-hours"} passed {a.thresholdPct}% on {when(a.createdAt)}
                </li>
              ))}
            </ul>
          )}
        </>
      ) : (
        <p>No budget set.</p>
      )}
    </>
  );
}

function Usage({ rows, granularity, from }: { rows: Data["usage"]["rows"]; granularity: Granularity; from: number }) {
  // Every bucket of the window, empty ones too, so time reads left to right at a steady pace.
  const step = STEP[granularity];
  const buckets = Array.from({ length: WINDOW[granularity] / step }, (_, i) => from + i * step);
  const key = (r: Data["usage"]["rows"][0]) => `${r.group.gpu_model}/${r.group.shape} · ${r.group.tier}`;
  const series = [...new Set(rows.map(key))].sort();
  const label = (ms: number) => new Date(ms).toISOString().slice(granularity === "HOUR" ? 11 : 5, granularity === "HOUR" ? 16 : 10);
  const datasets = series.map((s, i) => ({
    label: s,
    data: buckets.map((b) => rows.filter((r) => Date.parse(r.start) === b && key(r) === s).reduce((n, r) => n + r.gpuHours, 0)),
    backgroundColor: PALETTE[i % PALETTE.length],
  }));
  if (!rows.length) return <p data-testid="usage-empty">No usage in this window yet.</p>;
  return (
    <ChartBox
      label={`GPU-hours per ${granularity === "HOUR" ? "hour" : "day"} by SKU and tier`}
      testid="usage-chart"
      config={{
        type: "bar",
        data: { labels: buckets.map(label), datasets },
        options: { scales: { x: { stacked: true }, y: { stacked: true, beginAtZero: true, title: { display: true, text: "GPU-hours" } } } },
      }}
    />
  );
}
