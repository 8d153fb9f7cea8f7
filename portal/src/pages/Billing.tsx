import { useLocation } from "preact-iso";
import { useEffect, useState } from "preact/hooks";
import { asProblem, download, gql, money, when } from "../api";
import { FieldError } from "../ui";

const MONTHS = 12; // the history's length: one aliased `bill` each (the schema allows 15 aliases)
const PERIOD = /^\d{4}-(0[1-9]|1[0-2])$/;

const BILL = `query Bill($period: String!) { bill(period: $period) {
  period start end accruedUntil unpricedMilliGpuMs
  totals { currency amount }
  lines { sku gpuModel shape tier region plan gpuHours unitAmount currency priceVersion amount }
} }`;

interface Money {
  currency: string;
  amount: string;
}
interface Bill {
  period: string;
  start: string;
  end: string;
  accruedUntil: string;
  unpricedMilliGpuMs: string;
  totals: Money[];
  lines: {
    sku: string;
    gpuModel: string;
    shape: string;
    tier: string;
    region: string;
    plan: string;
    gpuHours: number;
    unitAmount: string | null;
    currency: string | null;
    priceVersion: number | null;
    amount: string;
  }[];
}
interface Summary {
  period: string;
  totals: Money[];
  lines: { gpuHours: number }[];
}

/** "YYYY-MM" of the month `back` months before this one (UTC, as bills are). */
function monthBack(back: number): string {
  const now = new Date();
  const d = new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth() - back, 1));
  return d.toISOString().slice(0, 7);
}

function monthName(period: string): string {
  const [y, m] = period.split("-").map(Number);
  return new Date(Date.UTC(y, m - 1, 1)).toLocaleString("en", { month: "long", year: "numeric", timeZone: "UTC" });
}

const total = (totals: Money[]) => (totals.length ? totals.map((t) => money(t.amount, t.currency)).join(" + ") : "—");

export function Billing({ period }: { period?: string }) {
  const { route } = useLocation();
  const current = monthBack(0);
  // The month in progress (what is being run up now); the history links to the others.
  const chosen = period ?? current;
  const [history, setHistory] = useState<Summary[] | null>(null);
  const [fetched, setBill] = useState<Bill | null>(null);
  // Only the chosen month's bill: for the render between a new month being chosen and the
  // effect below clearing the last one, the old bill is not shown under the new heading.
  const bill = fetched?.period === chosen ? fetched : null;
  const [error, setError] = useState("");
  const [billError, setBillError] = useState("");
  const [monthError, setMonthError] = useState("");
  const [exportError, setExportError] = useState("");
  const [exported, setExported] = useState("");
  const [busy, setBusy] = useState(false);

  useEffect(() => {
    // The last MONTHS months in one request: each `bill` aliased by its month.
    const periods = Array.from({ length: MONTHS }, (_, i) => monthBack(i));
    const fields = periods.map((p, i) => `m${i}: bill(period: "${p}") { period totals { currency amount } lines { gpuHours } }`).join("\n");
    gql<Record<string, Summary>>(`query BillHistory {\n${fields}\n}`)
      .then((d) => setHistory(periods.map((_, i) => d[`m${i}`])))
      .catch((e) => {
        const p = asProblem(e);
        setError(`${p.message} (${p.code})`);
      });
  }, []);

  useEffect(() => {
    setBill(null);
    setBillError("");
    setExported("");
    setExportError("");
    if (!PERIOD.test(chosen)) {
      setBillError(`${chosen} is not a month: YYYY-MM.`);
      return;
    }
    let live = true;
    gql<{ bill: Bill }>(BILL, { period: chosen })
      .then((d) => live && setBill(d.bill))
      .catch((e) => {
        const p = asProblem(e);
        if (live) setBillError(`${p.message} (${p.code})`);
      });
    return () => {
      live = false;
    };
  }, [chosen]);

  const exportAs = async (format: "csv" | "jsonl") => {
    setBusy(true);
    setExportError("");
    setExported("");
    try {
      const got = await download(`/v1/billing/exports?period=${chosen}&format=${format}`, `rackplane-usage-${chosen}.${format}`);
      setExported(`Downloaded ${got.name}${got.rows != null ? ` (${got.rows} rows)` : ""}.`);
    } catch (e) {
      const p = asProblem(e);
      setExportError(`${p.message} (${p.code})`);
    } finally {
      setBusy(false);
    }
  };

  return (
    <>
      <h1>Billing</h1>
      {error && (
        <p class="error" role="alert">
          {error}
        </p>
      )}
      <div class="grid">
        <section aria-labelledby="hist-h">
          <h2 id="hist-h">Past months</h2>
          {!history ? (
            !error && <p class="loading">Loading…</p>
          ) : (
            <table class="compact" data-testid="bill-history">
              <thead>
                <tr>
                  <th scope="col">Month</th>
                  <th scope="col">GPU-h</th>
                  <th scope="col">Total</th>
                </tr>
              </thead>
              <tbody>
                {history.map((b) => (
                  <tr data-period={b.period}>
                    <th scope="row">
                      <a href={`/portal/billing/${b.period}`} aria-current={b.period === chosen ? "page" : undefined}>
                        {monthName(b.period)}
                      </a>
                      {b.period === current && <span class="tag">so far</span>}
                    </th>
                    <td>{b.lines.reduce((n, l) => n + l.gpuHours, 0).toFixed(3)}</td>
                    <td>{total(b.totals)}</td>
                  </tr>
                ))}
              </tbody>
            </table>
          )}
          <form
            class="inline-form"
            noValidate
            onSubmit={(e) => {
              e.preventDefault();
              const value = ((e.currentTarget as HTMLFormElement).elements.namedItem("month") as HTMLInputElement).value;
              if (!PERIOD.test(value)) return setMonthError("Pick a month (YYYY-MM).");
              setMonthError("");
              route(`/portal/billing/${value}`);
            }}
          >
            <label for="month">An earlier month</label>
            <input id="month" name="month" type="month" max={current} aria-invalid={!!monthError} aria-describedby="month-error" />
            <button type="submit">Open</button>
            <FieldError id="month-error" message={monthError} />
          </form>
        </section>
        <section aria-labelledby="bill-h" class="wide" data-testid="bill" data-period={chosen}>
          <h2 id="bill-h">
            Bill for {PERIOD.test(chosen) ? monthName(chosen) : chosen}
            {chosen === current && <small> (so far)</small>}
          </h2>
          {billError && (
            <p class="error" role="alert">
              {billError}
            </p>
          )}
          {!bill ? (
            !billError && <p class="loading">Loading…</p>
          ) : (
            <BillView bill={bill} />
          )}
          <div class="actions">
            <button type="button" disabled={busy || !!billError} onClick={() => exportAs("csv")} aria-describedby="export-note">
              Download CSV
            </button>
            <button type="button" disabled={busy || !!billError} onClick={() => exportAs("jsonl")} aria-describedby="export-note">
              Download JSON lines
            </button>
          </div>
          <p id="export-note" class="muted">
            The month's usage for finance: one row per day, SKU, tier, region, plan and price version; amounts in minor units (they add up
            to the bill's totals).
          </p>
          <p role="status" class="muted" data-testid="export-status">
            {exported}
          </p>
          {exportError && (
            <p class="error" role="alert">
              {exportError}
            </p>
          )}
        </section>
      </div>
    </>
  );
}

function BillView({ bill }: { bill: Bill }) {
  const unpriced = Number(bill.unpricedMilliGpuMs) / 3.6e9;
  return (
    <>
      <p class="big" data-testid="bill-total">
        {bill.totals.length ? total(bill.totals) : money(0, "usd")}
      </p>
      <p class="muted">
        {when(bill.start)} to {when(bill.end)}; accrued until {when(bill.accruedUntil)}
      </p>
      {unpriced > 0 && <p class="warn">{unpriced.toFixed(3)} GPU-hours had no price and are not charged.</p>}
      {bill.lines.length ? (
        <table class="compact" data-testid="bill-lines">
          <thead>
            <tr>
              <th scope="col">SKU</th>
              <th scope="col">Tier</th>
              <th scope="col">Region</th>
              <th scope="col">Plan</th>
              <th scope="col">GPU-h</th>
              <th scope="col">Price per GPU-h</th>
              <th scope="col">Amount</th>
            </tr>
          </thead>
          <tbody>
            {bill.lines.map((l) => (
              <tr>
                <td>{l.sku}</td>
                <td>{l.tier}</td>
                <td>{l.region}</td>
                <td>{l.plan}</td>
                <td>{l.gpuHours.toFixed(3)}</td>
                <td>{l.currency && l.unitAmount != null ? `${money(l.unitAmount, l.currency)} (v${l.priceVersion})` : "unpriced"}</td>
                <td>{l.currency ? money(l.amount, l.currency) : "—"}</td>
              </tr>
            ))}
          </tbody>
        </table>
      ) : (
        <p>No usage this month.</p>
      )}
    </>
  );
}
