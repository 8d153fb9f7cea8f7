import { useLocation } from "preact-iso";
import { useEffect, useState } from "preact/hooks";
import { ApiError, gql, isProblem, PROBLEM_FIELDS, type Problem } from "../api";
import { DRY_RUN_FIELDS, DryRunView, type DryRun } from "./DryRunView";

type Shape = "gpus" | "mig" | "fraction";
const ISOLATION = ["", "dedicated-gpu", "dedicated-mig", "shared-mig", "shared-fractional", "shared-timeslice", "vm", "confidential-vm"];
const PRIORITIES = ["training", "production", "research", "preemptible"];

interface Capacity {
  region: string;
  gpuModel: string;
}

/** One of the tenant's SSH keys, as the launch form offers it (by name). */
interface SshKey {
  name: string;
  keyType: string;
  fingerprint: string;
}
const SSH_KEYS = `query SubmitSshKeys($after: String) { sshKeys(first: 500, after: $after) {
  edges { node { name keyType fingerprint } }
  pageInfo { hasNextPage endCursor }
} }`;

/** Every SSH key of the tenant, a page at a time. */
async function allSshKeys(): Promise<SshKey[]> {
  const out: SshKey[] = [];
  let after: string | null = null;
  do {
    const d: { sshKeys: { edges: { node: SshKey }[]; pageInfo: { hasNextPage: boolean; endCursor: string | null } } } = await gql(
      SSH_KEYS,
      { after },
    );
    out.push(...d.sshKeys.edges.map((e) => e.node));
    after = d.sshKeys.pageInfo.hasNextPage ? d.sshKeys.pageInfo.endCursor : null;
  } while (after);
  return out;
}

/** The form's values as a WorkloadInput (only what the chosen shape uses). */
function inputOf(form: HTMLFormElement, shape: Shape): Record<string, unknown> {
  const v = (n: string) => (form.elements.namedItem(n) as HTMLInputElement | null)?.value.trim() ?? "";
  const num = (n: string) => (v(n) === "" ? undefined : Number(v(n)));
  const kind = v("kind");
  const input: Record<string, unknown> = { kind, priority: v("priority") };
  if (v("name")) input.name = v("name");
  if (v("gpuModel")) input.gpuModels = [v("gpuModel")];
  if (v("region")) input.region = v("region");
  if (v("isolation")) input.isolation = v("isolation");
  if (shape === "gpus") input.gpus = num("gpus");
  if (shape === "mig") input.migProfile = v("migProfile");
  if (shape === "fraction") {
    input.milli = num("milli");
    input.gpuMemoryMib = num("gpuMemoryMib");
  }
  if (kind === "job") {
    input.replicas = num("replicas");
    if (v("topology")) input.topology = { level: v("topology"), mode: v("topologyMode") };
    // A job array: that many elements, each with its index; at most so many under way.
    // Elastic: on a host's loss it goes on with the replicas left, at least this many.
    if (v("elasticMin")) input.elastic = { minReplicas: num("elasticMin") };
    if (v("arrayCount")) input.array = { count: num("arrayCount"), ...(v("arrayMaxParallel") ? { maxParallel: num("arrayMaxParallel") } : {}) };
  }
  // What must succeed first: workload or array ids, one per line (or separated by spaces or commas).
  const after = v("dependsOn").split(/[\s,]+/).filter((t) => t !== "");
  if (after.length) input.dependsOn = after;
  if (v("runForS")) input.runForS = num("runForS");
  // Its restart policy: only what the form changed from the API's defaults.
  const onFailure = (form.elements.namedItem("restartOnFailure") as HTMLInputElement | null)?.checked;
  if (onFailure || v("maxRestarts")) {
    const policy: Record<string, unknown> = {};
    if (onFailure) policy.on = ["failure", "infrastructure", "preemption"];
    if (v("maxRestarts")) policy.maxRestarts = num("maxRestarts");
    input.restartPolicy = policy;
  }
  // What its node agents run: one argument per line, and NAME=value lines.
  const lines = (n: string) => v(n).split("\n").map((l) => l.trim()).filter((l) => l !== "");
  const command = lines("command");
  if (command.length) input.command = command;
  const env = lines("env");
  if (env.length) {
    input.env = Object.fromEntries(
      env.map((l) => (l.includes("=") ? [l.slice(0, l.indexOf("=")), l.slice(l.indexOf("=") + 1)] : [l, ""])),
    );
  }
  // Variables set from the tenant's secrets: VAR=secret-name lines (the value never passes here).
  const secretEnv = lines("secretEnv");
  if (secretEnv.length) {
    input.secretEnv = Object.fromEntries(
      secretEnv.map((l) => (l.includes("=") ? [l.slice(0, l.indexOf("=")).trim(), l.slice(l.indexOf("=") + 1).trim()] : [l, ""])),
    );
  }
  // How its node agent runs it: a VM is always the `vm` runtime (the API's default for one);
  // a job or an instance runs as a process or in a podman container.
  if (kind !== "vm" && v("runtime") && v("runtime") !== "process") input.runtime = v("runtime");
  if (v("image")) input.image = v("image");
  if (kind !== "vm" && v("workdir")) input.workdir = v("workdir");
  // The tenant's volumes each run mounts: NAME:PATH lines, `:ro` after for read-only.
  const mounts = kind === "vm" ? [] : lines("volumes");
  if (mounts.length) {
    input.volumes = mounts.map((l) => {
      const [name, mountPath, mode] = l.split(":").map((x) => x.trim());
      return { name, mountPath: mountPath ?? "", ...(mode === "ro" ? { readOnly: true } : {}) };
    });
  }
  // The SSH keys that may log in (instances and VMs): their names, as the tenant keeps them.
  if (kind !== "job") {
    const keys = [...form.querySelectorAll<HTMLInputElement>("input[name=sshKey]:checked")].map((i) => i.value);
    if (keys.length) input.sshKeys = keys;
  }
  return input;
}

export function Submit() {
  const { route } = useLocation();
  const [kind, setKind] = useState("job");
  const [runtime, setRuntime] = useState("process");
  const [sshKeys, setSshKeys] = useState<SshKey[] | null>(null);
  const [sshKeysError, setSshKeysError] = useState("");
  const [shape, setShape] = useState<Shape>("gpus");
  const [capacity, setCapacity] = useState<Capacity[]>([]);
  const [problem, setProblem] = useState<Problem | null>(null);
  const [preview, setPreview] = useState<DryRun | null>(null);
  const [busy, setBusy] = useState(false);
  useEffect(() => {
    gql<{ capacity: Capacity[] }>(`{ capacity { region gpuModel } }`).then((d) => setCapacity(d.capacity)).catch(() => {});
    allSshKeys()
      .then(setSshKeys)
      .catch((e: ApiError) => setSshKeysError(`${e.message} (${e.code})`));
  }, []);
  const models = [...new Set(capacity.map((c) => c.gpuModel))].sort();
  const regions = [...new Set(capacity.map((c) => c.region))].sort();
  const bad = (name: string) => problem?.fields?.find((f) => f.path[f.path.length - 1] === name)?.message;

  const run = async (form: HTMLFormElement, dry: boolean) => {
    setBusy(true);
    setProblem(null);
    setPreview(null);
    const input = inputOf(form, shape);
    try {
      if (dry) {
        const d = await gql<{ dryRun: DryRun }>(`query($input: WorkloadInput!) { dryRun(input: $input) { ${DRY_RUN_FIELDS} } }`, { input });
        setPreview(d.dryRun);
      } else {
        const d = await gql<{ submitWorkload: { __typename: string; id?: string } & Partial<Problem> }>(
          `mutation($input: WorkloadInput!) { submitWorkload(input: $input) { __typename ... on Workload { id } ${PROBLEM_FIELDS} } }`,
          { input },
        );
        const r = d.submitWorkload;
        if (isProblem(r as any)) setProblem(r as Problem);
        else route(`/portal/workloads/${r.id}`);
      }
    } catch (e) {
      const err = e as ApiError;
      setProblem({ __typename: "Error", code: err.code, message: err.message });
    } finally {
      setBusy(false);
    }
  };

  return (
    <>
      <h1>Submit a workload</h1>
      <form
        class="submit"
        aria-describedby="form-problem"
        noValidate
        onInput={() => setPreview(null)} // a preview stands only for the values it was made of
        onSubmit={(e) => {
          e.preventDefault();
          const submitter = (e as SubmitEvent).submitter as HTMLButtonElement | null;
          run(e.currentTarget as HTMLFormElement, submitter?.value === "dry");
        }}
      >
        <div id="form-problem" role="alert" class="error">
          {problem && (
            <>
              <p>
                {problem.message} ({problem.code})
              </p>
              {problem.fields?.length ? (
                <ul>
                  {problem.fields.map((f) => (
                    <li>
                      <code>{f.path.join(".")}</code>: {f.message}
                    </li>
                  ))}
                </ul>
              ) : null}
            </>
          )}
        </div>
        <label for="name">Name</label>
        <input id="name" name="name" maxLength={200} />
        <label for="kind">Kind</label>
        <select id="kind" name="kind" value={kind} onChange={(e) => setKind((e.target as HTMLSelectElement).value)}>
          <option value="job">Gang job (all replicas or none)</option>
          <option value="instance">Instance (container)</option>
          <option value="vm">VM</option>
        </select>
        <fieldset>
          <legend>Each replica gets</legend>
          {(
            [
              ["gpus", "Whole GPUs"],
              ["mig", "A MIG slice"],
              ["fraction", "A fractional share"],
            ] as [Shape, string][]
          ).map(([s, text]) => (
            <label class="inline">
              <input type="radio" name="shape" value={s} checked={shape === s} onChange={() => setShape(s)} /> {text}
            </label>
          ))}
        </fieldset>
        {shape === "gpus" && (
          <>
            <label for="gpus">GPUs per replica</label>
            <input id="gpus" name="gpus" type="number" min={1} max={72} defaultValue="8" aria-invalid={!!bad("gpus")} />
          </>
        )}
        {shape === "mig" && (
          <>
            <label for="migProfile">MIG profile</label>
            <input id="migProfile" name="migProfile" defaultValue="1g.10gb" aria-invalid={!!bad("migProfile")} />
          </>
        )}
        {shape === "fraction" && (
          <>
            <label for="milli">Share of a GPU (milli-GPU, 1–999)</label>
            <input id="milli" name="milli" type="number" min={1} max={999} defaultValue="500" aria-invalid={!!bad("milli")} />
            <label for="gpuMemoryMib">GPU memory (MiB)</label>
            <input id="gpuMemoryMib" name="gpuMemoryMib" type="number" min={1} defaultValue="20000" aria-invalid={!!bad("gpuMemoryMib")} />
          </>
        )}
        {kind === "job" && (
          <>
            <label for="replicas">Replicas</label>
            <input id="replicas" name="replicas" type="number" min={1} max={4096} defaultValue="2" aria-invalid={!!bad("replicas")} />
            <label for="topology">Keep the replicas within</label>
            <select id="topology" name="topology">
              <option value="">anywhere</option>
              <option value="nvlink_domain">one NVLink domain</option>
              <option value="rack">one rack</option>
              <option value="block">one network block</option>
            </select>
            <label for="topologyMode">That is</label>
            <select id="topologyMode" name="topologyMode">
              <option value="preferred">preferred</option>
              <option value="required">required</option>
            </select>
          </>
        )}
        {kind === "job" && (
          <fieldset data-testid="array-choice" aria-invalid={!!bad("count") || !!bad("maxParallel") || !!bad("array")}>
            <legend>Job array (optional)</legend>
            <label for="arrayCount">Elements (each gets RACKPLANE_ARRAY_INDEX)</label>
            <input id="arrayCount" name="arrayCount" type="number" min={1} max={1000} placeholder="1" />
            <label for="arrayMaxParallel">Elements under way at once</label>
            <input id="arrayMaxParallel" name="arrayMaxParallel" type="number" min={1} max={1000} placeholder="all" />
          </fieldset>
        )}
        {kind === "job" && (
          <fieldset data-testid="elastic-choice" aria-invalid={!!bad("elastic") || !!bad("minReplicas")}>
            <legend>Elastic (optional)</legend>
            <label for="elasticMin">Losing a host, go on with no fewer than</label>
            <input id="elasticMin" name="elasticMin" type="number" min={1} max={4096} placeholder="not elastic" />
          </fieldset>
        )}
        <label for="dependsOn">Start after these succeed (workload or array ids, one per line)</label>
        <textarea
          id="dependsOn"
          name="dependsOn"
          rows={1}
          spellcheck={false}
          aria-invalid={!!bad("dependsOn") || problem?.code === "unknown_dependency" || problem?.code === "dependency_failed"}
        />
        <label for="gpuModel">GPU model</label>
        <select id="gpuModel" name="gpuModel">
          <option value="">any</option>
          {models.map((m) => (
            <option value={m}>{m}</option>
          ))}
        </select>
        <label for="region">Region</label>
        <select id="region" name="region">
          <option value="">any</option>
          {regions.map((r) => (
            <option value={r}>{r}</option>
          ))}
        </select>
        <label for="isolation">Isolation</label>
        <select id="isolation" name="isolation">
          {ISOLATION.map((i) => (
            <option value={i}>{i || "from my policy"}</option>
          ))}
        </select>
        <label for="priority">Priority</label>
        <select id="priority" name="priority">
          {PRIORITIES.map((p) => (
            <option value={p}>{p}</option>
          ))}
        </select>
        <label for="command">Command (one argument per line; run by the node agent)</label>
        <textarea
          id="command"
          name="command"
          rows={3}
          spellcheck={false}
          placeholder={"python3\ntrain.py\n--steps\n100"}
          aria-invalid={!!bad("command")}
        />
        {kind !== "vm" && (
          <>
            <label for="workdir">Working directory (a process: relative to its own directory; a container: absolute)</label>
            <input id="workdir" name="workdir" maxLength={255} spellcheck={false} placeholder="src/app" aria-invalid={!!bad("workdir")} />
          </>
        )}
        {kind !== "vm" && (
          <>
            <label for="volumes">
              Your <a href="/portal/volumes">volumes</a> to mount (one volume:path per line, :ro after for read-only)
            </label>
            <textarea
              id="volumes"
              name="volumes"
              rows={1}
              spellcheck={false}
              placeholder="checkpoints:ckpt"
              aria-invalid={!!bad("volumes") || !!bad("mountPath") || problem?.code === "unknown_volume"}
            />
          </>
        )}
        <label for="env">Environment (one KEY=value per line)</label>
        <textarea id="env" name="env" rows={2} spellcheck={false} placeholder="LR=0.001" aria-invalid={!!bad("env")} />
        <label for="secretEnv">
          From your <a href="/portal/secrets">secrets</a> (one VAR=secret per line; values never shown)
        </label>
        <textarea
          id="secretEnv"
          name="secretEnv"
          rows={1}
          spellcheck={false}
          placeholder="HF_TOKEN=hf-token"
          aria-invalid={!!bad("secretEnv") || problem?.code === "unknown_secret"}
        />
        {kind !== "vm" && (
          <>
            <label for="runtime">Runtime</label>
            <select id="runtime" name="runtime" value={runtime} onChange={(e) => setRuntime((e.target as HTMLSelectElement).value)}>
              <option value="process">process (on the host)</option>
              <option value="podman">podman (a container of an image)</option>
            </select>
          </>
        )}
        <label for="image">{kind === "vm" ? "Disk image (a qcow2 file in the nodes' image directories)" : "Image"}</label>
        <input
          id="image"
          name="image"
          placeholder={kind === "vm" ? "debian-12-generic-amd64.qcow2" : "nvcr.io/nvidia/pytorch:24.10-py3"}
          aria-invalid={!!bad("image")}
        />
        {kind !== "job" && (
          <fieldset data-testid="ssh-keys-choice" aria-invalid={!!bad("sshKeys") || problem?.code === "unknown_ssh_key"} aria-describedby="ssh-keys-hint">
            <legend>SSH keys that may log in as root</legend>
            {sshKeysError ? (
              <p class="error">Your SSH keys could not be read: {sshKeysError}</p>
            ) : !sshKeys ? (
              <p class="loading">Loading…</p>
            ) : sshKeys.length === 0 ? (
              <p class="muted">
                You have no SSH keys yet: <a href="/portal/ssh-keys">add one</a> to log in to what you launch.
              </p>
            ) : (
              sshKeys.map((k) => (
                <label class="check">
                  <input type="checkbox" name="sshKey" value={k.name} /> {k.name} <span class="muted">{k.fingerprint}</span>
                </label>
              ))
            )}
            <p id="ssh-keys-hint" class="muted">
              {kind === "vm"
                ? "The VM boots with them; its page then says how to log in."
                : runtime === "podman"
                  ? "Its container runs an SSH server with them; its page then says how to log in."
                  : "An instance you log into runs in a container: choose the podman runtime and an image."}
            </p>
          </fieldset>
        )}
        <fieldset data-testid="restart-policy" aria-invalid={!!bad("maxRestarts") || !!bad("restartPolicy")}>
          <legend>Restarts</legend>
          <label class="check">
            <input type="checkbox" name="restartOnFailure" /> Restart after its own failure (a non-zero exit), from its last checkpoint
          </label>
          <label for="maxRestarts">At most this many restarts after failures and infrastructure faults, then it fails</label>
          <input id="maxRestarts" name="maxRestarts" type="number" min={0} max={1000} placeholder="10" aria-invalid={!!bad("maxRestarts")} />
          <p class="muted">A fault of the hardware or a preemption always restarts it; each restart after the first waits longer (10 s, doubling to 5 min).</p>
        </fieldset>
        <label for="runForS">Run for (seconds: a simulated node, or a replica without a command)</label>
        <input id="runForS" name="runForS" type="number" min={1} aria-invalid={!!bad("runForS")} />
        <div class="actions">
          <button type="submit" name="action" value="dry" disabled={busy}>
            Preview (dry run)
          </button>
          <button type="submit" name="action" value="submit" disabled={busy} class="primary">
            Submit
          </button>
        </div>
      </form>
      {preview && <DryRunView d={preview} />}
    </>
  );
}
