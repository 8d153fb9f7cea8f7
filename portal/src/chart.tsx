// Chart.js, registered with only what the portal draws (tree-shaken), behind one hook.
import {
  BarController,
  BarElement,
  CategoryScale,
  Chart,
  Legend,
  LinearScale,
  LineController,
  LineElement,
  PointElement,
  Tooltip,
  type ChartConfiguration,
} from "chart.js";
import { useEffect, useRef } from "preact/hooks";

Chart.register(BarController, BarElement, CategoryScale, LinearScale, LineController, LineElement, PointElement, Legend, Tooltip);
Chart.defaults.font.family = "system-ui, sans-serif";
Chart.defaults.animation = false;

// Okabe–Ito: told apart with any colour vision; series also differ by order and legend text.
export const PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#999999", "#000000"];

export function ChartBox({ config, label, testid }: { config: ChartConfiguration; label: string; testid?: string }) {
  const canvas = useRef<HTMLCanvasElement>(null);
  const chart = useRef<Chart | null>(null);
  useEffect(() => {
    if (!canvas.current) return;
    chart.current?.destroy();
    chart.current = new Chart(canvas.current, { ...config, options: { responsive: true, maintainAspectRatio: false, ...config.options } });
    return () => {
      chart.current?.destroy();
      chart.current = null;
    };
  }, [JSON.stringify(config.data), config.type]);
  const points = config.data.datasets.reduce((n, d) => n + d.data.filter((v) => Number(v) > 0).length, 0);
  return (
    <div class="chart" data-testid={testid} data-points={points} data-labels={(config.data.labels ?? []).join("|")}>
      <canvas ref={canvas} role="img" aria-label={label} />
    </div>
  );
}
