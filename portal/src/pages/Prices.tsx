// Operators: the price book (every version of every price, by GPU model, shape, plan, tier and
// region) and a form to add a version. The amount is typed in the currency's units and sent in
// minor units, exactly (no float); a version applies from its date on, earlier ones stay.
import { useEffect, useRef, useState } from "preact/hooks";
import { asProblem, fieldProblem, fromMinor, gql, isProblem, money, problemText, PROBLEM_FIELDS, toMinor, when, type Problem } from "../api";
import { AskDialog, FieldError, FormProblem, type Ask } from "../ui";

const PRICE_FIELDS = "id gpuModel shape tier region plan currency unitAmount version effectiveFrom createdAt";
const QUERY = `query Prices { prices { ${PRICE_FIELDS} } }`;
const CREATE = `mutation CreatePrice($input: PriceInput!) { createPrice(input: $input) {
  __typename ... on Price { ${PRICE_FIELDS} } ${PROBLEM_FIELDS}
} }`;

interface Price {
  id: string;
  gpuModel: string;
  shape: string;
  tier: string;
  region: string;
  plan: string;
  currency: string;
  unitAmount: string;
  version: number;
  effectiveFrom: string;
  createdAt: string;
}

// The vocabularies the API takes (app/billing/schemas.py), offered as suggestions: the API
// still says what is wrong with anything else.
const GPU_MODELS = ["A100-80GB", "H100-80GB", "H200-141GB", "B200", "GB200"];
const SHAPES = ["whole", "fractional", "vm", "mig", "mig-1g", "mig-1g.2m", "mig-2g", "mig-3g", "mig-4g", "mig-7g"];
const TIERS = ["*", "timeslice", "mps", "mig-shared", "mig-dedicated", "dedicated", "vm", "confidential-vm"];
const PLANS = ["on_demand", "reserved", "preemptible"];
const FIELDS = ["gpuModel", "shape", "tier", "region", "plan", "currency", "unitAmount", "effectiveFrom"];

interface Draft {
  gpuModel: string;
  shape: string;
  plan: string;
  tier: string;
  region: string;
  currency: string;
  amount: string;
  effectiveFrom: string; // datetime-local, the operator's local time
}
const EMPTY: Draft = { gpuModel: "H100-80GB", shape: "whole", plan: "on_demand", tier: "*", region: "*", currency: "usd", amount: "", effectiveFrom: "" };

const keyOf = (p: Price) => [p.gpuModel, p.shape, p.plan, p.tier, p.region].join("|");

/** Per price key, the version in effect now: the latest effective date not in the future,
 * then the highest version (as the bill resolves a price for one key). */
function inEffect(prices: Price[], now: number): Set<string> {
  const best = new Map<string, Price>();
  for (const p of prices) {
    if (Date.parse(p.effectiveFrom) > now) continue;
    const b = best.get(keyOf(p));
    if (!b || Date.parse(p.effectiveFrom) > Date.parse(b.effectiveFrom) || (p.effectiveFrom === b.effectiveFrom && p.version > b.version)) best.set(keyOf(p), p);
  }
  return new Set([...best.values()].map((p) => p.id));
}

export function Prices() {
  const [prices, setPrices] = useState<Price[] | null>(null);
  const [error, setError] = useState("");
  const [model, setModel] = useState("");
  const [draft, setDraft] = useState<Draft>(EMPTY);
  const [problem, setProblem] = useState<Problem | null>(null);
  const [added, setAdded] = useState<Price | null>(null);
  const [busy, setBusy] = useState(false);
  const [ask, setAsk] = useState<Ask | null>(null);
  const amountField = useRef<HTMLInputElement>(null);

  const load = () =>
    gql<{ prices: Price[] }>(QUERY)
      .then((d) => {
        setPrices(d.prices);
        setError("");
      })
      .catch((e) => setError(problemText(asProblem(e))));
  useEffect(() => {
    load();
  }, []);

  const local = (path: string, message: string): Problem => ({ __typename: "Local", code: "validation_error", message: "", fields: [{ path: ["input", path], message }] });

  const create = async (input: Record<string, unknown>) => {
    setBusy(true);
    setProblem(null);
    setAdded(null);
    try {
      const d = await gql<{ createPrice: (Price & { __typename: string }) | Problem }>(CREATE, { input });
      const r = d.createPrice;
      if (isProblem(r)) setProblem(r);
      else {
        setAdded(r);
        setDraft((x) => ({ ...x, amount: "", effectiveFrom: "" }));
        load();
      }
    } catch (e) {
      setProblem(asProblem(e));
    } finally {
      setBusy(false);
    }
  };

  const submit = () => {
    setAdded(null);
    const currency = draft.currency.trim().toLowerCase();
    const minor = toMinor(draft.amount, currency || "usd");
    if (!draft.amount.trim() || minor === null) return setProblem(local("unitAmount", `Enter an amount in ${currency.toUpperCase() || "the currency"}, such as 3.25.`));
    if (!draft.effectiveFrom) return setProblem(local("effectiveFrom", "Enter a date and time."));
    const from = new Date(draft.effectiveFrom); // the field's local time, sent in UTC
    if (Number.isNaN(from.getTime())) return setProblem(local("effectiveFrom", "Enter a date and time."));
    setProblem(null);
    const input = {
      gpuModel: draft.gpuModel.trim(),
      shape: draft.shape.trim(),
      plan: draft.plan,
      tier: draft.tier.trim() || "*",
      region: draft.region.trim() || "*",
      currency,
      unitAmount: minor, // BigInt: its decimal text, exact
      effectiveFrom: from.toISOString(),
    };
    const same = (prices ?? []).filter(
      (p) => p.gpuModel === input.gpuModel && p.shape === input.shape && p.plan === input.plan && p.tier === input.tier && p.region === input.region,
    );
    const version = same.reduce((n, p) => Math.max(n, p.version), 0) + 1;
    const what = `${input.gpuModel} · ${input.shape} · ${input.plan} · tier ${input.tier} · region ${input.region}`;
    setAsk({
      title: "Add a price version?",
      action: "Add version",
      body: (
        <>
          <p>
            <strong>{what}</strong>: {money(minor, currency)} per GPU-hour ({minor} minor units), effective from {when(input.effectiveFrom)}.
          </p>
          <p>
            It becomes version {version}
            {same.length ? ` (the latest now is ${same.reduce((a, p) => (p.version > a.version ? p : a)).version})` : ", the first of this price"}. Earlier versions stay;
            usage from that date on is billed at it, unless a more specific price applies.
          </p>
        </>
      ),
      run: () => create(input),
    });
  };

  const bad = (n: string) => fieldProblem(problem, n);
  const now = Date.now();
  const current = prices ? inEffect(prices, now) : new Set<string>();
  const models = prices ? [...new Set(prices.map((p) => p.gpuModel))].sort() : [];
  const shown = (prices ?? [])
    .filter((p) => !model || p.gpuModel === model)
    .sort((a, b) => keyOf(a).localeCompare(keyOf(b)) || b.version - a.version);
  const field = (name: keyof Draft, label: string, api: string, extra: Record<string, unknown> = {}) => (
    <>
      <label for={`p-${name}`}>{label}</label>
      <input
        id={`p-${name}`}
        value={draft[name]}
        aria-invalid={!!bad(api)}
        aria-describedby={`p-${name}-error`}
        onInput={(e) => setDraft((d) => ({ ...d, [name]: (e.currentTarget as HTMLInputElement).value }))}
        {...extra}
      />
      <FieldError id={`p-${name}-error`} message={bad(api)} />
    </>
  );
  return (
    <>
      <h1>Prices</h1>
      <div class="grid">
        <section aria-labelledby="book-h" class="wide">
          <h2 id="book-h">Price book</h2>
          <p class="muted">
            Per GPU-hour of GPU-equivalents. Each price (GPU model, shape, plan, tier, region; * is any) keeps every version; the one in effect is the
            latest whose date has come.
          </p>
          {error && (
            <p class="error" role="alert">
              {error}
            </p>
          )}
          <p class="inline-form">
            <label for="p-filter">GPU model</label>
            <select id="p-filter" value={model} onChange={(e) => setModel((e.currentTarget as HTMLSelectElement).value)}>
              <option value="">any</option>
              {models.map((m) => (
                <option value={m}>{m}</option>
              ))}
            </select>
          </p>
          {!prices ? (
            !error && <p class="loading">Loading…</p>
          ) : shown.length === 0 ? (
            <p data-testid="no-prices">No prices yet: usage is not billed until one applies.</p>
          ) : (
            <table data-testid="prices">
              <thead>
                <tr>
                  <th scope="col">GPU model</th>
                  <th scope="col">Shape</th>
                  <th scope="col">Plan</th>
                  <th scope="col">Tier</th>
                  <th scope="col">Region</th>
                  <th scope="col">Version</th>
                  <th scope="col">Per GPU-hour</th>
                  <th scope="col">Effective from</th>
                  <th scope="col">Status</th>
                  <th scope="col">
                    <span class="visually-hidden">Actions</span>
                  </th>
                </tr>
              </thead>
              <tbody>
                {shown.map((p) => {
                  const st = current.has(p.id) ? "in effect" : Date.parse(p.effectiveFrom) > now ? "scheduled" : "superseded";
                  return (
                    <tr data-key={keyOf(p)} data-version={p.version} data-status={st} class={added?.id === p.id ? "fresh" : undefined}>
                      <th scope="row">{p.gpuModel}</th>
                      <td>{p.shape}</td>
                      <td>{p.plan}</td>
                      <td>{p.tier}</td>
                      <td>{p.region}</td>
                      <td>v{p.version}</td>
                      <td>{money(p.unitAmount, p.currency)}</td>
                      <td>{when(p.effectiveFrom)}</td>
                      <td>
                        <span class={`state state-price-${st.replace(" ", "-")}`}>{st}</span>
                      </td>
                      <td>
                        <button
                          type="button"
                          aria-label={`New version of ${p.gpuModel} ${p.shape} ${p.plan} (tier ${p.tier}, region ${p.region})`}
                          onClick={() => {
                            setDraft({
                              gpuModel: p.gpuModel,
                              shape: p.shape,
                              plan: p.plan,
                              tier: p.tier,
                              region: p.region,
                              currency: p.currency,
                              amount: fromMinor(p.unitAmount, p.currency),
                              effectiveFrom: "",
                            });
                            setProblem(null);
                            amountField.current?.focus();
                          }}
                        >
                          New version
                        </button>
                      </td>
                    </tr>
                  );
                })}
              </tbody>
            </table>
          )}
        </section>
        <section aria-labelledby="add-h">
          <h2 id="add-h">Add a version</h2>
          <form
            class="form"
            noValidate
            aria-describedby="price-problem"
            onSubmit={(e) => {
              e.preventDefault();
              submit();
            }}
          >
            <FormProblem id="price-problem" problem={problem} fields={FIELDS} />
            {field("gpuModel", "GPU model", "gpuModel", { list: "p-models" })}
            <datalist id="p-models">
              {GPU_MODELS.map((m) => (
                <option value={m} />
              ))}
            </datalist>
            {field("shape", "Shape (whole, fractional, vm, mig or a MIG profile)", "shape", { list: "p-shapes" })}
            <datalist id="p-shapes">
              {SHAPES.map((m) => (
                <option value={m} />
              ))}
            </datalist>
            <label for="p-plan">Plan</label>
            <select id="p-plan" value={draft.plan} onChange={(e) => setDraft((d) => ({ ...d, plan: (e.currentTarget as HTMLSelectElement).value }))} aria-describedby="p-plan-error">
              {PLANS.map((p) => (
                <option value={p}>{p}</option>
              ))}
            </select>
            <FieldError id="p-plan-error" message={bad("plan")} />
            {field("tier", "Tier (* for any)", "tier", { list: "p-tiers" })}
            <datalist id="p-tiers">
              {TIERS.map((m) => (
                <option value={m} />
              ))}
            </datalist>
            {field("region", "Region (* for any)", "region")}
            {field("currency", "Currency (ISO code)", "currency", { maxLength: 3 })}
            <label for="p-amount">Price per GPU-hour (in the currency, such as 3.25)</label>
            <input
              id="p-amount"
              ref={amountField}
              inputMode="decimal"
              value={draft.amount}
              aria-invalid={!!bad("unitAmount")}
              aria-describedby="p-amount-error"
              onInput={(e) => setDraft((d) => ({ ...d, amount: (e.currentTarget as HTMLInputElement).value }))}
            />
            <FieldError id="p-amount-error" message={bad("unitAmount")} />
            {field("effectiveFrom", "Effective from (your local time)", "effectiveFrom", { type: "datetime-local" })}
            <div class="actions">
              <button type="submit" class="primary" aria-haspopup="dialog" disabled={busy}>
                Add price version
              </button>
            </div>
            <p role="status" class="muted" data-testid="price-added">
              {added && `Added version ${added.version} of ${added.gpuModel} ${added.shape} ${added.plan}: ${money(added.unitAmount, added.currency)} per GPU-hour from ${when(added.effectiveFrom)}.`}
            </p>
          </form>
        </section>
      </div>
      <AskDialog id="price-ask" ask={ask} onClose={() => setAsk(null)} />
    </>
  );
}
