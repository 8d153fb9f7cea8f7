import { when } from "../api";

export interface DryRun {
  placeableNow: boolean;
  tier: string;
  region: string;
  placement: { replica: number; rack: string; node: string; gpuIndices: number[]; gpuModel: string; migProfile: string | null; migSlot: number | null; milli: number | null }[];
  preempts: string[];
  preemptsOthers: { priority: string; count: number }[];
  expectedStart: string | null;
  reason: string;
}

export const DRY_RUN_FIELDS = `placeableNow tier region reason expectedStart preempts
  preemptsOthers { priority count }
  placement { replica rack node gpuIndices gpuModel migProfile migSlot milli }`;

export function DryRunView({ d }: { d: DryRun }) {
  return (
    <div class="dryrun" data-testid="dry-run" role="status">
      <p>
        <strong>{d.placeableNow ? "It would start now" : d.expectedStart ? `It would start at ${when(d.expectedStart)}` : "It cannot start"}</strong>{" "}
        ({d.tier}, {d.region}). {d.reason}
      </p>
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
      {(d.preempts.length > 0 || d.preemptsOthers.length > 0) && (
        <p>
          It would preempt {d.preempts.length} of your workloads
          {d.preemptsOthers.map((o) => `, ${o.count} ${o.priority} workload(s) of other tenants`).join("")}.
        </p>
      )}
    </div>
  );
}
