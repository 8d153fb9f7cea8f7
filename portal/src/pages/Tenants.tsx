// Operators: the tenants (by status), and a tenant's page: approve, suspend or reactivate it,
// its isolation policy and its quotas. Every change asks first, then says what it did; the API
// records each in the audit log.
import { useEffect, useState } from "preact/hooks";
import { asProblem, fieldProblem, gpusText, gql, isProblem, problemText, PROBLEM_FIELDS, toMilli, when, type Problem } from "../api";
import { AskDialog, FieldError, FormProblem, Outcome, type Ask } from "../ui";

const TENANT_FIELDS = "id slug name contactEmail status isolationPolicy stripeCustomerId createdAt";
const LIST = `query Tenants($after: String, $status: String) { tenants(first: 50, after: $after, status: $status) {
  edges { cursor node { ${TENANT_FIELDS} } }
  pageInfo { hasNextPage endCursor }
} }`;
const QUOTA_FIELDS = "gpuModel guaranteedMilli limitMilli weight usedMilli queuedMilli";
const ONE = `query Tenant($id: ID!) {
  tenant(id: $id) { ${TENANT_FIELDS} }
  tenantQuotas(tenantId: $id) { ${QUOTA_FIELDS} }
}`;
const STATUS_MUTATIONS = { approve: "approveTenant", suspend: "suspendTenant", reactivate: "reactivateTenant" } as const;
const statusMutation = (name: string) => `mutation Status($id: ID!) { ${name}(id: $id) {
  __typename ... on Tenant { ${TENANT_FIELDS} } ${PROBLEM_FIELDS}
} }`;
const UPDATE = `mutation UpdateTenant($id: ID!, $input: TenantUpdateInput!) { updateTenant(id: $id, input: $input) {
  __typename ... on Tenant { ${TENANT_FIELDS} } ${PROBLEM_FIELDS}
} }`;
const SET_QUOTAS = `mutation SetQuotas($id: ID!, $input: QuotaSetInput!) { setTenantQuotas(tenantId: $id, input: $input) {
  __typename ... on QuotaSetDone { quotas { ${QUOTA_FIELDS} } } ${PROBLEM_FIELDS}
} }`;

interface Tenant {
  id: string;
  slug: string;
  name: string;
  contactEmail: string;
  status: string;
  isolationPolicy: string[];
  stripeCustomerId: string | null;
  createdAt: string;
}
interface Quota {
  gpuModel: string;
  guaranteedMilli: number;
  limitMilli: number | null;
  weight: number;
  usedMilli: number;
  queuedMilli: number;
}

const STATUSES = ["pending", "active", "suspended"];
// The tiers a tenant may be placed in (app/tenants/models.py IsolationTier).
const TIERS: [string, string][] = [
  ["shared-timeslice", "shared-timeslice: time-sliced shares of a GPU (one tenant per GPU)"],
  ["shared-fractional", "shared-fractional: fractions of a GPU by MPS (one tenant per GPU)"],
  ["shared-mig", "shared-mig: MIG slices, hardware-isolated (a GPU may hold others' slices)"],
  ["dedicated-gpu", "dedicated-gpu: whole GPUs nobody shares"],
  ["vm", "vm: whole GPUs in a VM"],
  ["confidential-vm", "confidential-vm: whole GPUs in a confidential VM"],
];
// The catalog's GPU models (app/placement/catalog.py), for a new quota row.
const GPU_MODELS = ["A100-80GB", "H100-80GB", "H200-141GB", "B200", "GB200"];

export function Tenants() {
  const [status, setStatus] = useState("");
  const [tenants, setTenants] = useState<Tenant[] | null>(null);
  const [next, setNext] = useState<string | null>(null);
  const [error, setError] = useState("");

  const load = async (after: string | null = null) => {
    try {
      const d = await gql<{ tenants: { edges: { node: Tenant }[]; pageInfo: { hasNextPage: boolean; endCursor: string | null } } }>(LIST, {
        after,
        status: status || null,
      });
      const got = d.tenants.edges.map((e) => e.node);
      setTenants((old) => (after && old ? [...old, ...got] : got));
      setNext(d.tenants.pageInfo.hasNextPage ? d.tenants.pageInfo.endCursor : null);
      setError("");
    } catch (e) {
      setError(problemText(asProblem(e)));
    }
  };
  useEffect(() => {
    setTenants(null);
    load();
  }, [status]);

  return (
    <>
      <h1>Tenants</h1>
      <section aria-labelledby="tenants-h">
        <h2 id="tenants-h">{status ? `Tenants ${status}` : "All tenants"}</h2>
        <p class="inline-form">
          <label for="t-status">Status</label>
          <select id="t-status" value={status} onChange={(e) => setStatus((e.currentTarget as HTMLSelectElement).value)}>
            <option value="">any</option>
            {STATUSES.map((s) => (
              <option value={s}>{s}</option>
            ))}
          </select>
        </p>
        {error && (
          <p class="error" role="alert">
            {error}
          </p>
        )}
        {!tenants ? (
          !error && <p class="loading">Loading…</p>
        ) : tenants.length === 0 ? (
          <p data-testid="no-tenants">No {status || ""} tenants.</p>
        ) : (
          <table data-testid="tenants">
            <thead>
              <tr>
                <th scope="col">Name</th>
                <th scope="col">Slug</th>
                <th scope="col">Status</th>
                <th scope="col">Contact</th>
                <th scope="col">Isolation policy</th>
                <th scope="col">Created</th>
              </tr>
            </thead>
            <tbody>
              {tenants.map((t) => (
                <tr data-slug={t.slug} data-status={t.status}>
                  <th scope="row">
                    <a href={`/portal/tenants/${t.id}`}>{t.name}</a>
                  </th>
                  <td>{t.slug}</td>
                  <td>
                    <span class={`state state-tenant-${t.status}`}>{t.status}</span>
                  </td>
                  <td>{t.contactEmail}</td>
                  <td>{t.isolationPolicy.join(", ")}</td>
                  <td>{when(t.createdAt)}</td>
                </tr>
              ))}
            </tbody>
          </table>
        )}
        {next && (
          <button type="button" onClick={() => load(next)}>
            Show more tenants
          </button>
        )}
      </section>
    </>
  );
}

// --- one tenant --------------------------------------------------------------------------------

interface Row {
  gpuModel: string;
  guaranteed: string; // GPUs, as typed
  limit: string; // GPUs; empty: no limit
  weight: string;
  usedMilli: number;
  queuedMilli: number;
}

const toRow = (q: Quota): Row => ({
  gpuModel: q.gpuModel,
  guaranteed: gpusText(q.guaranteedMilli),
  limit: q.limitMilli == null ? "" : gpusText(q.limitMilli),
  weight: String(q.weight),
  usedMilli: q.usedMilli,
  queuedMilli: q.queuedMilli,
});

const STATUS_ACTIONS: Record<string, { verb: keyof typeof STATUS_MUTATIONS; label: string; says: string; done: string }> = {
  pending: {
    verb: "approve",
    label: "Approve",
    says: "Its keys may then use the API: submit workloads within its quotas and isolation policy.",
    done: "approved: it is active",
  },
  active: {
    verb: "suspend",
    label: "Suspend",
    says: "From its next request its keys may only read the tenant itself; everything else is refused (tenant_not_active). Its queued and running workloads carry on.",
    done: "suspended",
  },
  suspended: {
    verb: "reactivate",
    label: "Reactivate",
    says: "Its keys work again as they did before it was suspended.",
    done: "reactivated: it is active",
  },
};

export function TenantPage({ id }: { id: string }) {
  const [tenant, setTenant] = useState<Tenant | null>(null);
  const [rows, setRows] = useState<Row[]>([]);
  const [error, setError] = useState("");
  const [ask, setAsk] = useState<Ask | null>(null);
  const [statusOutcome, setStatusOutcome] = useState<{ ok: boolean; text: string } | null>(null);
  const [policy, setPolicy] = useState<string[]>([]);
  const [policyProblem, setPolicyProblem] = useState<Problem | null>(null);
  const [policySaved, setPolicySaved] = useState("");
  const [quotaProblem, setQuotaProblem] = useState<Problem | null>(null);
  const [quotaSaved, setQuotaSaved] = useState("");
  const [adding, setAdding] = useState("");
  const [busy, setBusy] = useState(false);

  useEffect(() => {
    gql<{ tenant: Tenant; tenantQuotas: Quota[] }>(ONE, { id })
      .then((d) => {
        setTenant(d.tenant);
        setPolicy(d.tenant.isolationPolicy);
        setRows(d.tenantQuotas.map(toRow));
      })
      .catch((e) => setError(problemText(asProblem(e))));
  }, [id]);

  if (!tenant) return error ? <p class="error" role="alert">{error}</p> : <p class="loading">Loading…</p>;
  const t = tenant;

  // --- status
  const act = STATUS_ACTIONS[t.status];
  const changeStatus = async () => {
    if (!act) return;
    setBusy(true);
    setStatusOutcome(null);
    const name = STATUS_MUTATIONS[act.verb];
    try {
      const d = await gql<Record<string, (Tenant & { __typename: string }) | Problem>>(statusMutation(name), { id: t.id });
      const r = d[name];
      if (isProblem(r)) setStatusOutcome({ ok: false, text: problemText(r) });
      else {
        setTenant(r);
        setStatusOutcome({ ok: true, text: `${r.name} ${act.done}.` });
      }
    } catch (e) {
      setStatusOutcome({ ok: false, text: problemText(asProblem(e)) });
    } finally {
      setBusy(false);
    }
  };

  // --- isolation policy
  const savePolicy = async (chosen: string[]) => {
    setBusy(true);
    setPolicyProblem(null);
    setPolicySaved("");
    try {
      const d = await gql<{ updateTenant: (Tenant & { __typename: string }) | Problem }>(UPDATE, { id: t.id, input: { isolationPolicy: chosen } });
      const r = d.updateTenant;
      if (isProblem(r)) setPolicyProblem(r);
      else {
        setTenant(r);
        setPolicy(r.isolationPolicy);
        setPolicySaved(`Isolation policy saved: ${r.isolationPolicy.join(", ")}.`);
      }
    } catch (e) {
      setPolicyProblem(asProblem(e));
    } finally {
      setBusy(false);
    }
  };
  const askPolicy = () => {
    const added = policy.filter((p) => !t.isolationPolicy.includes(p));
    const removed = t.isolationPolicy.filter((p) => !policy.includes(p));
    const chosen = TIERS.map(([k]) => k).filter((k) => policy.includes(k));
    setAsk({
      title: `Change ${t.name}'s isolation policy?`,
      action: "Save policy",
      body: (
        <>
          <p>
            {t.name} may be placed in: <strong>{chosen.join(", ") || "no tier"}</strong>.
          </p>
          <ul>
            {added.length > 0 && <li>Allowed from now on: {added.join(", ")}</li>}
            {removed.length > 0 && <li>No longer allowed: {removed.join(", ")}</li>}
            {!added.length && !removed.length && <li>Nothing changes.</li>}
          </ul>
          <p>Placements from now on follow it.</p>
        </>
      ),
      run: () => savePolicy(chosen),
    });
  };

  // --- quotas
  const setRow = (i: number, patch: Partial<Row>) => setRows((rs) => rs.map((r, j) => (j === i ? { ...r, ...patch } : r)));
  const cellProblem = (i: number, field: string) => {
    const hits = (quotaProblem?.fields ?? []).filter((f) => f.path[1] === "quotas" && f.path[2] === String(i) && (field ? f.path[3] === field : f.path.length === 3));
    return hits.length ? hits.map((f) => f.message).join("; ") : undefined;
  };
  const parseRows = (): { quotas: Record<string, unknown>[] } | Problem => {
    const fields: { path: string[]; message: string }[] = [];
    const quotas = rows.map((r, i) => {
      const at = (f: string) => ["input", "quotas", String(i), f];
      const g = toMilli(r.guaranteed || "0");
      if (g === null) fields.push({ path: at("guaranteedMilli"), message: "Enter a number of GPUs, such as 8 or 0.5." });
      const l = r.limit.trim() ? toMilli(r.limit) : null;
      if (r.limit.trim() && l === null) fields.push({ path: at("limitMilli"), message: "Enter a number of GPUs, or leave it empty for no limit." });
      const w = Number(r.weight);
      if (!r.weight.trim() || !Number.isFinite(w)) fields.push({ path: at("weight"), message: "Enter a number, such as 1." });
      return { gpuModel: r.gpuModel, guaranteedMilli: g ?? 0, limitMilli: l, weight: w };
    });
    if (fields.length) return { __typename: "Local", code: "validation_error", message: "", fields };
    return { quotas };
  };
  const saveQuotas = async (input: { quotas: Record<string, unknown>[] }) => {
    setBusy(true);
    setQuotaProblem(null);
    setQuotaSaved("");
    try {
      const d = await gql<{ setTenantQuotas: { __typename: string; quotas: Quota[] } | Problem }>(SET_QUOTAS, { id: t.id, input });
      const r = d.setTenantQuotas;
      if (isProblem(r)) setQuotaProblem(r);
      else {
        setRows(r.quotas.map(toRow));
        setQuotaSaved(`Quotas saved: ${r.quotas.length ? r.quotas.map((q) => q.gpuModel).join(", ") : "none"}.`);
      }
    } catch (e) {
      setQuotaProblem(asProblem(e));
    } finally {
      setBusy(false);
    }
  };
  const askQuotas = () => {
    setQuotaSaved("");
    const parsed = parseRows();
    if ("__typename" in parsed) return setQuotaProblem(parsed);
    setQuotaProblem(null);
    setAsk({
      title: `Replace ${t.name}'s quotas?`,
      action: "Save quotas",
      body: (
        <>
          {rows.length ? (
            <ul>
              {rows.map((r) => (
                <li>
                  {r.gpuModel}: {r.guaranteed || "0"} GPUs guaranteed, {r.limit.trim() ? `at most ${r.limit.trim()}` : "no limit"}, weight {r.weight}
                </li>
              ))}
            </ul>
          ) : (
            <p>No quota for any model.</p>
          )}
          <p>A model left out has no quota: nothing guaranteed and no limit. Placement applies them from its next cycle.</p>
        </>
      ),
      run: () => saveQuotas(parsed),
    });
  };
  // Per cell messages sit under their cells; a row's own message (paths ["input", "quotas", i])
  // under its row: both are "placed", the form's box shows the rest.
  const placed = ["guaranteedMilli", "limitMilli", "weight", "gpuModel", ...rows.map((_, i) => String(i))];
  const free = GPU_MODELS.filter((m) => !rows.some((r) => r.gpuModel === m));

  return (
    <>
      <p>
        <a href="/portal/tenants">← Tenants</a>
      </p>
      <h1>
        {t.name} <small>{t.slug}</small>
      </h1>
      <div class="grid">
        <section aria-labelledby="status-h" data-testid="tenant-status" data-status={t.status}>
          <h2 id="status-h">
            Status: <span class={`state state-tenant-${t.status}`}>{t.status}</span>
          </h2>
          <dl>
            <dt>Contact</dt>
            <dd>{t.contactEmail}</dd>
            <dt>Stripe customer</dt>
            <dd>{t.stripeCustomerId ?? "—"}</dd>
            <dt>Created</dt>
            <dd>{when(t.createdAt)}</dd>
            <dt>Id</dt>
            <dd>
              <code>{t.id}</code>
            </dd>
          </dl>
          {act && (
            <div class="actions">
              <button
                type="button"
                class={act.verb === "suspend" ? undefined : "primary"}
                aria-haspopup="dialog"
                disabled={busy}
                onClick={() => {
                  setStatusOutcome(null);
                  setAsk({ title: `${act.label} ${t.name}?`, action: act.label, body: <p>{act.says}</p>, run: changeStatus });
                }}
              >
                {act.label}
              </button>
            </div>
          )}
          <Outcome id="status-outcome" outcome={statusOutcome} />
        </section>
        <section aria-labelledby="policy-h">
          <h2 id="policy-h">Isolation policy</h2>
          <form
            class="form"
            noValidate
            aria-describedby="policy-problem"
            onSubmit={(e) => {
              e.preventDefault();
              askPolicy();
            }}
          >
            <FormProblem id="policy-problem" problem={policyProblem} fields={["isolationPolicy"]} />
            <fieldset aria-invalid={!!fieldProblem(policyProblem, "isolationPolicy")} aria-describedby="policy-error">
              <legend>Tiers {t.name} may be placed in</legend>
              {TIERS.map(([k, text]) => (
                <label class="check">
                  <input
                    type="checkbox"
                    name={k}
                    checked={policy.includes(k)}
                    onChange={(e) => {
                      const on = (e.currentTarget as HTMLInputElement).checked;
                      setPolicy((p) => (on ? [...p.filter((x) => x !== k), k] : p.filter((x) => x !== k)));
                    }}
                  />
                  {text}
                </label>
              ))}
              <FieldError id="policy-error" message={fieldProblem(policyProblem, "isolationPolicy")} />
            </fieldset>
            <div class="actions">
              <button type="submit" class="primary" aria-haspopup="dialog" disabled={busy}>
                Save isolation policy
              </button>
            </div>
            <p role="status" class="muted" data-testid="policy-saved">
              {policySaved}
            </p>
          </form>
        </section>
        <section aria-labelledby="quotas-h" class="wide">
          <h2 id="quotas-h">Quotas</h2>
          <p class="muted" id="quotas-help">
            In GPUs (0.5: half a GPU's worth). Guaranteed: what the tenant is entitled to; limit: the most it may hold at once (empty:
            none); weight: its share of what is left over.
          </p>
          <form
            class="form"
            noValidate
            aria-describedby="quota-problem quotas-help"
            onSubmit={(e) => {
              e.preventDefault();
              askQuotas();
            }}
          >
            <FormProblem id="quota-problem" problem={quotaProblem} fields={placed} />
            <table data-testid="quotas">
              <thead>
                <tr>
                  <th scope="col">GPU model</th>
                  <th scope="col">Guaranteed (GPUs)</th>
                  <th scope="col">Limit (GPUs)</th>
                  <th scope="col">Weight</th>
                  <th scope="col">Held now</th>
                  <th scope="col">Queued</th>
                  <th scope="col">
                    <span class="visually-hidden">Remove</span>
                  </th>
                </tr>
              </thead>
              <tbody>
                {rows.length === 0 && (
                  <tr>
                    <td colSpan={7}>No quotas: nothing guaranteed, no limit on any model.</td>
                  </tr>
                )}
                {rows.map((r, i) => {
                  const cell = (field: keyof Row, api: string, label: string, mode: "decimal" | "numeric" = "decimal") => {
                    const bad = cellProblem(i, api);
                    const eid = `q-${i}-${api}-error`;
                    return (
                      <td>
                        <input
                          size={7}
                          inputMode={mode}
                          aria-label={`${label} for ${r.gpuModel}`}
                          value={r[field] as string}
                          aria-invalid={!!bad}
                          aria-describedby={eid}
                          onInput={(e) => setRow(i, { [field]: (e.currentTarget as HTMLInputElement).value })}
                        />
                        <FieldError id={eid} message={bad} />
                      </td>
                    );
                  };
                  const rowBad = cellProblem(i, "");
                  return (
                    <tr data-model={r.gpuModel}>
                      <th scope="row">
                        {r.gpuModel}
                        <FieldError id={`q-${i}-error`} message={rowBad} />
                      </th>
                      {cell("guaranteed", "guaranteedMilli", "Guaranteed GPUs")}
                      {cell("limit", "limitMilli", "Limit in GPUs")}
                      {cell("weight", "weight", "Weight")}
                      <td>{gpusText(r.usedMilli)}</td>
                      <td>{gpusText(r.queuedMilli)}</td>
                      <td>
                        <button type="button" aria-label={`Remove the ${r.gpuModel} quota`} onClick={() => setRows((rs) => rs.filter((_, j) => j !== i))}>
                          Remove
                        </button>
                      </td>
                    </tr>
                  );
                })}
              </tbody>
            </table>
            {free.length > 0 && (
              <p class="inline-form">
                <label for="q-add">Add a quota for</label>
                <select id="q-add" value={adding} onChange={(e) => setAdding((e.currentTarget as HTMLSelectElement).value)}>
                  <option value="">a GPU model…</option>
                  {free.map((m) => (
                    <option value={m}>{m}</option>
                  ))}
                </select>
                <button
                  type="button"
                  disabled={!adding}
                  onClick={() => {
                    setRows((rs) => [...rs, { gpuModel: adding, guaranteed: "0", limit: "", weight: "1", usedMilli: 0, queuedMilli: 0 }]);
                    setAdding("");
                  }}
                >
                  Add row
                </button>
              </p>
            )}
            <div class="actions">
              <button type="submit" class="primary" aria-haspopup="dialog" disabled={busy}>
                Save quotas
              </button>
            </div>
            <p role="status" class="muted" data-testid="quotas-saved">
              {quotaSaved}
            </p>
          </form>
        </section>
      </div>
      <AskDialog id="tenant-ask" ask={ask} onClose={() => setAsk(null)} />
    </>
  );
}
