import { money, when } from "../api";

export interface DryRun {
  placeableNow: boolean;
  tier: string;
  region: string;
  placement: { replica: number; rack: string; node: string; gpuIndices: number[]; gpuModel: string; migProfile: string | null; migSlot: number | null; milli: number | null }[];
  preempts: string[];
  preemptsOthers: { priority: string; count: number }[];
  expectedStart: string | null;
  reason: string;
  price: Price | null;
}

/** What the placement shown would cost at list prices (REST's `price`). */
interface Price {
  currency: string | null;
  plan: string;
  perHour: number;
  maxCost: number;
  unpricedReplicas: number;
  budgetLeft: number | null;
  budgetHours: number | null;
}

export const DRY_RUN_FIELDS = `placeableNow tier region reason expectedStart preempts
  preemptsOthers { priority count }
  placement { replica rack node gpuIndices gpuModel migProfile migSlot milli }
  price { currency plan perHour maxCost unpricedReplicas budgetLeft budgetHours }`;

/** The API's answer as one of four outcomes (app/placement/queueing/ `what_if`):
 * - now: placeable now, nobody preempted;
 * - preempts: placeable once the workloads it preempts have stopped (after their grace);
 * - waits: not placeable now, but it would queue and start later: when running work ends
 *   (`expectedStart`), or when the tenant's own use falls under its limit or fair share;
 * - never: the fleet could never hold it ("does not fit the fleet: ...", "the region has no
 *   nodes"): submitted, it is refused (422 `does_not_fit_fleet`). Work that fits the fleet but
 *   not the nodes taking work now says "waits: ..." and why (nodes out, drifted, laid out). */
export type Verdict = "now" | "preempts" | "waits" | "never";

// The scheduler's reasons for "not now, no estimate" that still clear by themselves: the
// tenant's own running work ending (its hard limit) or other tenants' demand (fair share).
const QUOTA_WAITS = ["over its tenant's limit", "at its fair share while other tenants wait"];

export function verdictOf(d: DryRun): Verdict {
  if (d.placeableNow) return d.preempts.length || d.preemptsOthers.length ? "preempts" : "now";
  // "waits: ...": it fits the fleet, and waits for nodes that are out, drifted or being laid out.
  if (d.expectedStart || QUOTA_WAITS.includes(d.reason) || d.reason.startsWith("waits")) return "waits";
  return "never";
}

const plural = (n: number, one: string, many = `${one}s`) => `${n} ${n === 1 ? one : many}`;

export function DryRunView({ d }: { d: DryRun }) {
  const verdict = verdictOf(d);
  let headline: string;
  if (verdict === "now") headline = "It would start now";
  else if (verdict === "preempts") headline = `It would start after preempting others${d.expectedStart ? `, at ${when(d.expectedStart)}` : ""}`;
  else if (verdict === "waits") headline = d.expectedStart ? `It would queue, expected to start at ${when(d.expectedStart)}` : "It would queue, with no start time yet";
  else headline = "It would never start: it does not fit the fleet";
  return (
    <div class={`dryrun dryrun-${verdict}`} data-testid="dry-run" data-verdict={verdict} role="status">
      <p>
        <strong>{headline}</strong> ({d.tier}, {d.region}). Scheduler: {d.reason}.
        {verdict === "never" && " Submitted, it is refused: the fleet could never hold it."}
      </p>
      {verdict === "preempts" && (
        <div data-testid="dry-run-victims">
          <p>It would preempt (they checkpoint and stop within their grace period, then requeue):</p>
          <ul>
            {d.preempts.map((id) => (
              <li>
                your workload <a href={`/portal/workloads/${id}`}>{id.slice(0, 8)}</a>
              </li>
            ))}
            {d.preemptsOthers.map((o) => (
              <li>
                {plural(o.count, `${o.priority} workload`)} of other tenants
              </li>
            ))}
          </ul>
        </div>
      )}
      {d.price && (
        <p data-testid="dry-run-price">
          {d.price.currency
            ? `${money(d.price.perHour, d.price.currency)} an hour (${d.price.plan.replace("_", " ")} list price), at most ${money(d.price.maxCost, d.price.currency)} over its maximum run time`
            : "No price in the book covers it"}
          {d.price.unpricedReplicas > 0 && ` (${plural(d.price.unpricedReplicas, "replica")} unpriced)`}
          {d.price.budgetLeft != null &&
            d.price.currency &&
            `; your budget would have ${money(d.price.budgetLeft, d.price.currency)} left (it pays for ${d.price.budgetHours ?? "—"} hours of it now)`}
          .
        </p>
      )}
      {d.placement.length > 0 && (
        <table class="compact">
          <caption>Where it would land</caption>
          <thead>
            <tr>
              <th scope="col">Replica</th>
              <th scope="col">Rack</th>
              <th scope="col">Node</th>
              <th scope="col">GPUs</th>
            </tr>
          </thead>
          <tbody>
            {d.placement.map((p) => (
              <tr>
                <td>{p.replica}</td>
                <td>{p.rack}</td>
                <td>{p.node}</td>
                <td>
                  {p.gpuModel} #{p.gpuIndices.join(", #")}
                  {p.migProfile ? ` MIG ${p.migProfile} slot ${p.migSlot}` : ""}
                  {p.milli ? ` (${p.milli / 1000} GPU)` : ""}
                </td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </div>
  );
}
