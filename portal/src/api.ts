// The portal speaks GraphQL (queries, mutations, subscriptions) and the session endpoints, and
// fetches one REST file: a month's billing export (`download`), as the session's key may.
import { createClient, type Client } from "graphql-ws";

export interface Session {
  id: string;
  tenant_id: string | null;
  operator: boolean;
  key_prefix: string;
  scopes: string[];
  expires_at: string;
  idle_timeout_seconds: number;
  csrf_token: string;
}

/** A refusal with REST's and GraphQL's shared code. */
export class ApiError extends Error {
  constructor(
    public code: string,
    message: string,
    public status = 0,
    public fields: { path: string[]; message: string }[] = [],
  ) {
    super(message);
  }
}

let csrf = "";
let onSignedOut: (why: string) => void = () => {};

export function whenSignedOut(fn: (why: string) => void) {
  onSignedOut = fn;
}

async function problem(r: Response): Promise<ApiError> {
  try {
    const body = await r.json();
    return new ApiError(body.code ?? "error", body.detail ?? r.statusText, r.status, body.errors ?? []);
  } catch {
    return new ApiError("error", `${r.status} ${r.statusText}`, r.status);
  }
}

export async function currentSession(): Promise<Session | null> {
  // The session cookie is HttpOnly; its companion `rp_signed_in` (no secret) says whether
  // asking is worth a request.
  if (!document.cookie.split("; ").includes("rp_signed_in=1")) return null;
  const r = await fetch("/v1/sessions/current", { credentials: "same-origin" });
  if (r.status === 401) return null;
  if (!r.ok) throw await problem(r);
  const s: Session = await r.json();
  csrf = s.csrf_token;
  return s;
}

export async function signIn(apiKey: string): Promise<Session> {
  const r = await fetch("/v1/sessions", {
    method: "POST",
    credentials: "same-origin",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ api_key: apiKey }),
  });
  if (!r.ok) throw await problem(r);
  const s: Session = await r.json();
  csrf = s.csrf_token;
  return s;
}

export async function signOut(): Promise<void> {
  const r = await fetch("/v1/sessions/current", {
    method: "DELETE",
    credentials: "same-origin",
    headers: { "X-CSRF-Token": csrf },
  });
  csrf = "";
  closeSocket();
  if (!r.ok && r.status !== 401) throw await problem(r);
}

interface GqlError {
  message: string;
  extensions?: { code?: string; status?: number };
}

/** Run a query or mutation; the first error (with its code) is thrown. */
export async function gql<T>(query: string, variables: Record<string, unknown> = {}): Promise<T> {
  const r = await fetch("/graphql", {
    method: "POST",
    credentials: "same-origin",
    headers: { "content-type": "application/json", "X-CSRF-Token": csrf },
    body: JSON.stringify({ query, variables }),
  });
  if (r.status === 401) {
    const e = await problem(r);
    onSignedOut(e.message);
    throw e;
  }
  if (!r.ok && !r.headers.get("content-type")?.includes("json")) throw await problem(r);
  const body = await r.json();
  if (!("data" in body) && body.code) throw new ApiError(body.code, body.detail, r.status);
  const errors: GqlError[] = body.errors ?? [];
  if (errors.length) {
    const e = errors[0];
    const code = e.extensions?.code ?? "error";
    if (["invalid_session", "session_ended", "session_expired", "missing_api_key", "revoked_api_key"].includes(code)) {
      onSignedOut(e.message);
    }
    throw new ApiError(code, e.message, e.extensions?.status ?? 0);
  }
  return body.data as T;
}

/** Fetch a file the session may read (a GET: no CSRF token needed) and hand it to the browser
 * as a download, named as the API names it. A refusal is thrown, for the page to show. */
export async function download(url: string, fallbackName: string): Promise<{ name: string; rows: string | null }> {
  const r = await fetch(url, { credentials: "same-origin" });
  if (r.status === 401) {
    const e = await problem(r);
    onSignedOut(e.message);
    throw e;
  }
  if (!r.ok) throw await problem(r);
  const name = /filename="([^"]+)"/.exec(r.headers.get("content-disposition") ?? "")?.[1] ?? fallbackName;
  const href = URL.createObjectURL(await r.blob());
  const a = document.createElement("a");
  a.href = href;
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(href), 60_000);
  return { name, rows: r.headers.get("x-row-count") };
}

/** A mutation's typed problem (every mutation answers its result or one of these). */
export interface Problem {
  __typename: string;
  code: string;
  message: string;
  fields?: { path: string[]; message: string }[];
}

export const PROBLEM_FIELDS = `... on Problem { code message } ... on ValidationProblem { fields { path message } }`;

export function isProblem(x: { __typename: string }): x is Problem {
  return x.__typename.endsWith("Problem") || ["QuotaExceeded", "IsolationRuleViolated", "BudgetExhausted"].includes(x.__typename);
}

/** A thrown ApiError as a Problem, for the same place in the page. */
export function asProblem(e: unknown): Problem {
  if (e instanceof ApiError) return { __typename: "Error", code: e.code, message: e.message, fields: e.fields };
  return { __typename: "Error", code: "error", message: String(e) };
}

/** The problem's messages about one input field (`["input", "scopes", "0"]`: "scopes"). */
export function fieldProblem(p: Problem | null, name: string): string | undefined {
  const hits = (p?.fields ?? []).filter((f) => f.path.slice(1).includes(name));
  return hits.length ? hits.map((f) => f.message).join("; ") : undefined;
}

/** What of a problem no field shows: its message when no field is named, and the messages
 * about the input as a whole (`["input"]`). */
export function formProblem(p: Problem | null, fieldNames: string[]): { text: string; also: string[] } | null {
  if (!p) return null;
  const fields = p.fields ?? [];
  const placed = fields.filter((f) => fieldNames.some((n) => f.path.slice(1).includes(n)));
  const rest = fields.filter((f) => !placed.includes(f)).map((f) => f.message);
  if (fields.length && !rest.length) return { text: "Correct the fields marked below.", also: [] };
  return { text: `${fields.length ? "The input was refused" : p.message} (${p.code})`, also: rest };
}

// --- subscriptions: one socket per page, signed in by the session cookie ---------------------
let socket: Client | null = null;

function client(): Client {
  if (!socket) {
    const proto = location.protocol === "https:" ? "wss" : "ws";
    socket = createClient({ url: `${proto}://${location.host}/graphql`, lazy: true, retryAttempts: 5 });
  }
  return socket;
}

function closeSocket() {
  socket?.dispose();
  socket = null;
}

export function subscribe<T>(
  query: string,
  variables: Record<string, unknown>,
  next: (data: T) => void,
  error: (e: ApiError) => void,
): () => void {
  return client().subscribe<T>(
    { query, variables },
    {
      next: (msg) => {
        if (msg.errors?.length) {
          const e = msg.errors[0] as GqlError;
          error(new ApiError(e.extensions?.code ?? "error", e.message));
        } else if (msg.data) next(msg.data as T);
      },
      error: (e) => {
        const first = Array.isArray(e) ? (e[0] as GqlError) : null;
        error(new ApiError(first?.extensions?.code ?? "socket_error", first?.message ?? "The live feed was interrupted."));
      },
      complete: () => {},
    },
  );
}

/** A workload as the dashboard lists it (the workload page asks for more of it). */
export interface WorkloadSummary {
  id: string;
  name: string | null;
  kind: string;
  state: string;
  tier: string;
  priority: string;
  replicas: number;
  gpuMilli: number;
  region: string | null;
  shape: Record<string, unknown>;
  createdAt: string;
}

// --- formatting ---------------------------------------------------------------------------------
export function gpuShare(milli: number): string {
  return milli % 1000 === 0 ? `${milli / 1000}` : (milli / 1000).toFixed(2);
}

// ISO 4217 currencies without minor units (as app/core/money.py); the rest have two.
const ZERO_DECIMAL = "bif clp djf gnf jpy kmf krw mga pyg rwf ugx vnd vuv xaf xof xpf".split(" ");

export function exponent(currency: string): number {
  return ZERO_DECIMAL.includes(currency.toLowerCase()) ? 0 : 2;
}

export function money(minor: string | number, currency: string): string {
  const digits = exponent(currency);
  const n = Number(minor) / 10 ** digits;
  return new Intl.NumberFormat("en", {
    style: "currency",
    currency: currency.toUpperCase(),
    minimumFractionDigits: digits,
    maximumFractionDigits: digits,
  }).format(n);
}

/** "250.5" in `currency` as minor units ("25050"), exact (no float); null: not an amount. */
export function toMinor(text: string, currency: string): string | null {
  const digits = exponent(currency);
  const m = /^(-?)(\d+)(?:\.(\d*))?$/.exec(text.trim().replace(/,/g, ""));
  if (!m || (m[3] ?? "").length > digits) return null;
  const minor = BigInt(m[2] + (m[3] ?? "").padEnd(digits, "0"));
  return (m[1] ? -minor : minor).toString();
}

/** Minor units as the text a person types back ("25050" -> "250.50"). */
export function fromMinor(minor: string, currency: string): string {
  const digits = exponent(currency);
  if (!digits) return minor;
  const neg = minor.startsWith("-");
  const s = (neg ? minor.slice(1) : minor).padStart(digits + 1, "0");
  return `${neg ? "-" : ""}${s.slice(0, -digits)}.${s.slice(-digits)}`;
}

export function when(iso: string | null | undefined): string {
  if (!iso) return "—";
  const d = new Date(iso);
  return d.toISOString().replace("T", " ").slice(0, 19) + " UTC";
}

export function shapeText(shape: Record<string, unknown>, replicas: number): string {
  const models = (shape.gpu_models as string[] | undefined)?.join("|") || "any GPU";
  let what: string;
  if (shape.mig_profile) what = `MIG ${shape.mig_profile}`;
  else if (shape.milli) what = `${gpuShare(Number(shape.milli))} GPU share`;
  else what = `${shape.gpus ?? 1}× GPU`;
  const per = `${what} · ${models}`;
  return replicas > 1 ? `${replicas} × (${per})` : per;
}

/** milli-GPU as GPUs, exact and short (1500 -> "1.5", 8000 -> "8"). */
export function gpusText(milli: number): string {
  const whole = Math.trunc(milli / 1000);
  const frac = String(Math.abs(milli % 1000)).padStart(3, "0").replace(/0+$/, "");
  return frac ? `${milli < 0 && whole === 0 ? "-" : ""}${whole}.${frac}` : String(whole);
}

/** "1.5" GPUs as milli-GPU (1500), exact; null: not a number of GPUs (at most 3 decimals). */
export function toMilli(text: string): number | null {
  const m = /^(\d+)(?:\.(\d{0,3}))?$/.exec(text.trim());
  if (!m) return null;
  return Number(m[1]) * 1000 + Number((m[2] ?? "").padEnd(3, "0"));
}

/** A problem in one line: its message and code. */
export function problemText(p: Problem): string {
  return `${p.message} (${p.code})`;
}
