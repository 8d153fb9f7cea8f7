import { useEffect, useState } from "preact/hooks";
import { ApiError, gql } from "../api";
import { ChartBox, PALETTE } from "../chart";

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
  return (
    <>
      <h1>Fleet</h1>
      <Utilisation />
    </>
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
