import { useEffect, useLayoutEffect, useRef, useState } from "preact/hooks";
import { subscribe } from "../api";

// The newest output first (the server's tail), then each chunk as its agent ships it.
const LOGS = `subscription Logs($id: ID!, $replica: Int) { workloadLogs(workloadId: $id, replica: $replica) {
  id attempt replica data
} }`;

/** Lines kept in the page: older ones leave the DOM as new ones come. */
export const MAX_LINES = 2000;
const MAX_LINE_CHARS = 4000;

interface Chunk {
  id: string; // BigInt: a decimal string
  attempt: number;
  replica: number;
  data: string;
}

/** Output as lines: each run's (attempt, replica) text split at line breaks, its unfinished
 * last line held until the rest of it arrives (shown meanwhile). */
class Lines {
  done: string[] = [];
  open = new Map<string, string>();
  lastId = 0n;

  add(c: Chunk, prefix: string): boolean {
    const id = BigInt(c.id);
    if (id <= this.lastId) return false; // delivered again after a reconnect
    this.lastId = id;
    const run = `${c.attempt}/${c.replica}`;
    const parts = ((this.open.get(run) ?? "") + c.data).split("\n");
    const rest = parts.pop() ?? "";
    if (rest) this.open.set(run, rest);
    else this.open.delete(run);
    for (const p of parts) this.done.push(prefix + clip(p));
    if (this.done.length > MAX_LINES) this.done.splice(0, this.done.length - MAX_LINES);
    return true;
  }

  text(prefixes: Map<string, string>): string {
    const open = [...this.open].map(([run, t]) => (prefixes.get(run) ?? "") + clip(t));
    return [...this.done, ...open].slice(-MAX_LINES).join("\n");
  }
}

function clip(line: string): string {
  return line.length > MAX_LINE_CHARS ? line.slice(0, MAX_LINE_CHARS) + " …" : line;
}

export function LogPane({ id, replicas }: { id: string; replicas: number }) {
  const [replica, setReplica] = useState<number | null>(null);
  const [text, setText] = useState("");
  const [live, setLive] = useState(false);
  const [error, setError] = useState("");
  const box = useRef<HTMLPreElement>(null);
  const atBottom = useRef(true);

  useEffect(() => {
    const lines = new Lines();
    const prefixes = new Map<string, string>();
    setText("");
    setError("");
    setLive(false);
    // Many chunks can arrive at once: the text is rebuilt once per frame, not per chunk.
    let frame = 0;
    const render = () => {
      frame = 0;
      setText(lines.text(prefixes));
    };
    const stop = subscribe<{ workloadLogs: Chunk }>(
      LOGS,
      { id, replica },
      (d) => {
        setLive(true);
        const c = d.workloadLogs;
        // All replicas of a gang together: each line says whose it is.
        const prefix = replicas > 1 && replica === null ? `[${c.replica}] ` : "";
        prefixes.set(`${c.attempt}/${c.replica}`, prefix);
        if (lines.add(c, prefix) && !frame) frame = requestAnimationFrame(render);
      },
      (e) => setError(`Live output: ${e.message} (${e.code})`),
    );
    const t = setTimeout(() => setLive(true), 1500);
    return () => {
      stop();
      clearTimeout(t);
      if (frame) cancelAnimationFrame(frame);
    };
  }, [id, replica, replicas]);

  // Keep the newest line in view, unless the reader scrolled up to read older ones.
  useLayoutEffect(() => {
    const el = box.current;
    if (el && atBottom.current) el.scrollTop = el.scrollHeight;
  }, [text]);

  return (
    <section aria-labelledby="o-h" class="wide">
      <h2 id="o-h">
        Output <small data-testid="log-live">{live ? "● live" : "connecting…"}</small>
      </h2>
      {replicas > 1 && (
        <label class="inline">
          Replica{" "}
          <select
            data-testid="log-replica"
            value={replica === null ? "all" : String(replica)}
            onChange={(e) => {
              const v = (e.target as HTMLSelectElement).value;
              setReplica(v === "all" ? null : Number(v));
            }}
          >
            <option value="all">all</option>
            {Array.from({ length: replicas }, (_, i) => (
              <option value={String(i)}>{i}</option>
            ))}
          </select>
        </label>
      )}
      {error && (
        <p class="error" role="alert">
          {error}
        </p>
      )}
      <pre
        ref={box}
        class="logs"
        data-testid="log-pane"
        tabIndex={0}
        aria-label={`Output, the last ${MAX_LINES} lines`}
        onScroll={(e) => {
          const el = e.currentTarget as HTMLPreElement;
          atBottom.current = el.scrollHeight - el.scrollTop - el.clientHeight < 24;
        }}
      >
        {text || <span class="muted">No output yet.</span>}
      </pre>
    </section>
  );
}
