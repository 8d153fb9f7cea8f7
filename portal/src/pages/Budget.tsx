import { useEffect, useState } from "preact/hooks";
import { asProblem, fieldProblem, fromMinor, gql, isProblem, money, PROBLEM_FIELDS, toMinor, when, type Problem } from "../api";
import { Confirm, FieldError, FormProblem } from "../ui";

const BUDGET_FIELDS = `currency spendLimit gpuHourLimit stopPreemptible period spent gpuHoursUsed exhausted evaluatedAt
  alerts { period metric thresholdPct used limit createdAt }`;
const QUERY = `query Budget { budget { ${BUDGET_FIELDS} } }`;
const SET = `mutation SetBudget($input: BudgetInput!) { setBudget(input: $input) {
  __typename ... on Budget { ${BUDGET_FIELDS} } ${PROBLEM_FIELDS}
} }`;
const REMOVE = `mutation RemoveBudget { removeBudget { __typename ... on Done { ok } ${PROBLEM_FIELDS} } }`;

interface Alert {
  period: string;
  metric: string;
  thresholdPct: number;
  used: string;
  limit: string;
  createdAt: string;
}
interface Budget {
  currency: string;
  spendLimit: string | null;
  gpuHourLimit: number | null;
  stopPreemptible: boolean;
  period: string | null;
  spent: string;
  gpuHoursUsed: number;
  exhausted: boolean;
  evaluatedAt: string | null;
  alerts: Alert[];
}

const FIELDS = ["currency", "spendLimit", "gpuHourLimit", "stopPreemptible"];
const MILLI_GPU_MS_PER_HOUR = 3_600_000 * 1000;

const pct = (used: number, limit: number) => (limit > 0 ? Math.min(100, (used / limit) * 100) : 100);

export function BudgetPage() {
  const [budget, setBudget] = useState<Budget | null | undefined>(undefined);
  const [error, setError] = useState("");
  const [problem, setProblem] = useState<Problem | null>(null);
  const [busy, setBusy] = useState(false);
  const [removing, setRemoving] = useState(false);
  const [saved, setSaved] = useState("");
  const [formKey, setFormKey] = useState(0); // a new form (its fields from the budget) after each change

  useEffect(() => {
    gql<{ budget: Budget | null }>(QUERY)
      .then((d) => setBudget(d.budget))
      .catch((e) => {
        const p = asProblem(e);
        setError(`${p.message} (${p.code})`);
      });
  }, []);

  const local = (path: string, message: string): Problem => ({
    __typename: "Local",
    code: "validation_error",
    message: "",
    fields: [{ path: ["input", path], message }],
  });

  const save = async (form: HTMLFormElement) => {
    const v = (n: string) => (form.elements.namedItem(n) as HTMLInputElement).value.trim();
    const currency = v("currency").toLowerCase();
    const input: Record<string, unknown> = {
      currency,
      stopPreemptible: (form.elements.namedItem("stopPreemptible") as HTMLInputElement).checked,
      spendLimit: null,
      gpuHourLimit: null,
    };
    if (v("spendLimit")) {
      const minor = toMinor(v("spendLimit"), currency || "usd");
      if (minor === null) return setProblem(local("spendLimit", "Enter an amount such as 250 or 250.50."));
      input.spendLimit = minor;
    }
    if (v("gpuHourLimit")) {
      if (!/^-?\d+$/.test(v("gpuHourLimit"))) return setProblem(local("gpuHourLimit", "Enter a whole number of GPU-hours."));
      input.gpuHourLimit = Number(v("gpuHourLimit"));
    }
    setBusy(true);
    setProblem(null);
    setSaved("");
    try {
      const d = await gql<{ setBudget: (Budget & { __typename: string }) | Problem }>(SET, { input });
      const r = d.setBudget;
      if (isProblem(r)) setProblem(r);
      else {
        setSaved(budget ? "Budget changed." : "Budget set.");
        setBudget(r);
        setFormKey((k) => k + 1);
      }
    } catch (e) {
      setProblem(asProblem(e));
    } finally {
      setBusy(false);
    }
  };

  const remove = async () => {
    setBusy(true);
    setProblem(null);
    setSaved("");
    try {
      const d = await gql<{ removeBudget: { __typename: string } | Problem }>(REMOVE);
      const r = d.removeBudget;
      if (isProblem(r)) setProblem(r);
      else {
        setBudget(null);
        setSaved("Budget removed: no limits apply.");
        setFormKey((k) => k + 1);
      }
    } catch (e) {
      setProblem(asProblem(e));
    } finally {
      setBusy(false);
    }
  };

  if (budget === undefined) return error ? <p class="error" role="alert">{error}</p> : <p class="loading">Loading…</p>;
  const bad = (n: string) => fieldProblem(problem, n);
  const currency = budget?.currency ?? "usd";
  return (
    <>
      <h1>Budget</h1>
      <p class="muted">
        A monthly limit on spend, GPU-hours or both. Alerts are recorded at 50, 80 and 100% of a limit; at a limit new submissions are
        refused until the month ends or the limit is raised.
      </p>
      <div class="grid">
        <section aria-labelledby="now-h">
          <h2 id="now-h">This month</h2>
          {budget ? <Status b={budget} /> : <p data-testid="no-budget">No budget set: nothing limits your spend.</p>}
        </section>
        <section aria-labelledby="set-h">
          <h2 id="set-h">{budget ? "Change the budget" : "Set a budget"}</h2>
          <form
            key={formKey}
            class="form"
            noValidate
            aria-describedby="budget-problem"
            onSubmit={(e) => {
              e.preventDefault();
              save(e.currentTarget as HTMLFormElement);
            }}
          >
            <FormProblem id="budget-problem" problem={problem} fields={FIELDS} />
            <label for="b-currency">Currency (ISO code)</label>
            <input
              id="b-currency"
              name="currency"
              maxLength={3}
              defaultValue={currency}
              aria-invalid={!!bad("currency")}
              aria-describedby="b-currency-error"
            />
            <FieldError id="b-currency-error" message={bad("currency")} />
            <label for="b-spend">Spend limit per month (in the currency; empty: none)</label>
            <input
              id="b-spend"
              name="spendLimit"
              inputMode="decimal"
              defaultValue={budget?.spendLimit != null ? fromMinor(budget.spendLimit, currency) : ""}
              aria-invalid={!!bad("spendLimit")}
              aria-describedby="b-spend-error"
            />
            <FieldError id="b-spend-error" message={bad("spendLimit")} />
            <label for="b-hours">GPU-hour limit per month (empty: none)</label>
            <input
              id="b-hours"
              name="gpuHourLimit"
              inputMode="numeric"
              defaultValue={budget?.gpuHourLimit != null ? String(budget.gpuHourLimit) : ""}
              aria-invalid={!!bad("gpuHourLimit")}
              aria-describedby="b-hours-error"
            />
            <FieldError id="b-hours-error" message={bad("gpuHourLimit")} />
            <label class="check">
              <input type="checkbox" name="stopPreemptible" defaultChecked={budget?.stopPreemptible ?? false} />
              At a limit, also stop my running preemptible workloads
            </label>
            <div class="actions">
              <button type="submit" class="primary" disabled={busy}>
                {budget ? "Save changes" : "Set budget"}
              </button>
              {budget && (
                <button type="button" aria-haspopup="dialog" disabled={busy} onClick={() => setRemoving(true)}>
                  Remove budget
                </button>
              )}
            </div>
            <p role="status" class="muted" data-testid="budget-saved">
              {saved}
            </p>
          </form>
        </section>
      </div>
      <Confirm
        id="remove"
        open={removing}
        title="Remove the budget?"
        action="Remove it"
        onCancel={() => setRemoving(false)}
        onConfirm={() => {
          setRemoving(false);
          remove();
        }}
      >
        <p>No limit will apply to spend or GPU-hours, and no more alerts are recorded. Submissions refused at a limit are accepted again.</p>
      </Confirm>
    </>
  );
}

function Status({ b }: { b: Budget }) {
  const hours = (milli: string) => (Number(milli) / MILLI_GPU_MS_PER_HOUR).toFixed(1);
  return (
    <>
      {b.exhausted && (
        <p class="warn" role="status">
          <strong>Exhausted: new submissions are refused this month.</strong>
        </p>
      )}
      <dl data-testid="budget-status">
        {b.spendLimit != null && (
          <>
            <dt id="spend-l">Spend</dt>
            <dd>
              {money(b.spent, b.currency)} of {money(b.spendLimit, b.currency)}{" "}
              <progress aria-labelledby="spend-l" max={100} value={pct(Number(b.spent), Number(b.spendLimit))} />
            </dd>
          </>
        )}
        {b.gpuHourLimit != null && (
          <>
            <dt id="hours-l">GPU-hours</dt>
            <dd>
              {b.gpuHoursUsed.toFixed(1)} of {b.gpuHourLimit}{" "}
              <progress aria-labelledby="hours-l" max={100} value={pct(b.gpuHoursUsed, b.gpuHourLimit)} />
            </dd>
          </>
        )}
        <dt>At a limit</dt>
        <dd>{b.stopPreemptible ? "submissions refused, preemptible work stopped" : "submissions refused"}</dd>
        <dt>Evaluated</dt>
        <dd>{when(b.evaluatedAt)}</dd>
      </dl>
      <h3 id="alerts-h">Alerts {b.period ? `(${b.period})` : ""}</h3>
      {b.alerts.length ? (
        <ul class="alerts" aria-labelledby="alerts-h" data-testid="budget-alerts">
          {b.alerts.map((a) => (
            <li data-metric={a.metric} data-pct={a.thresholdPct}>
              ⚠ {a.metric === "spend" ? "Spend" : "GPU-hours"} passed {a.thresholdPct}%:{" "}
              {a.metric === "spend"
                ? `${money(a.used, b.currency)} of ${money(a.limit, b.currency)}`
                : `${hours(a.used)} of ${hours(a.limit)} GPU-hours`}{" "}
              on {when(a.createdAt)}
            </li>
          ))}
        </ul>
      ) : (
        <p>No threshold crossed this month.</p>
      )}
    </>
  );
}
