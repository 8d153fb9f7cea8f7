// Small pieces the account pages share: a field's error under it, a form's problem, and a
// confirmation dialog (as the workload page's Terminate asks).
import type { ComponentChildren } from "preact";
import { useEffect, useRef, useState } from "preact/hooks";
import { formProblem, type Problem } from "./api";

/** A field's message from the API, under the field (its input points here with aria-describedby). */
export function FieldError({ id, message }: { id: string; message?: string }) {
  return (
    <span id={id} class="field-error" data-testid={id}>
      {message ?? ""}
    </span>
  );
}

/** What no field shows of a problem, at the top of its form (an alert: read out when it changes). */
export function FormProblem({ id, problem, fields }: { id: string; problem: Problem | null; fields: string[] }) {
  const p = formProblem(problem, fields);
  return (
    <div id={id} role="alert" class="error" data-testid={id}>
      {p && (
        <>
          <p>{p.text}</p>
          {p.also.length > 0 && (
            <ul>
              {p.also.map((m) => (
                <li>{m}</li>
              ))}
            </ul>
          )}
        </>
      )}
    </div>
  );
}

/** A modal question: focus goes to Cancel (the safe choice); Esc or Cancel closes it. */
export function Confirm({
  id,
  open,
  title,
  action,
  onCancel,
  onConfirm,
  children,
}: {
  id: string;
  open: boolean;
  title: string;
  action: string;
  onCancel: () => void;
  onConfirm: () => void;
  children: ComponentChildren;
}) {
  const dialog = useRef<HTMLDialogElement>(null);
  const keep = useRef<HTMLButtonElement>(null);
  useEffect(() => {
    const d = dialog.current;
    if (!d) return;
    if (open && !d.open) {
      d.showModal();
      keep.current?.focus();
    } else if (!open && d.open) d.close();
  }, [open]);
  return (
    <dialog ref={dialog} class="confirm" aria-labelledby={`${id}-h`} aria-describedby={`${id}-d`} onClose={onCancel}>
      <h2 id={`${id}-h`}>{title}</h2>
      <div id={`${id}-d`}>{children}</div>
      <div class="actions">
        <button type="button" ref={keep} onClick={onCancel}>
          Cancel
        </button>
        <button type="button" class="danger" onClick={onConfirm}>
          {action}
        </button>
      </div>
    </dialog>
  );
}

/** An action an operator's page asks about before it runs: what it is, what it will do, and
 * (where the API takes one) a reason, recorded with the change. */
export interface Ask {
  title: string;
  action: string;
  body: ComponentChildren;
  reason?: boolean;
  run: (reason: string | null) => void;
}

/** One confirmation dialog for a page's actions: `ask` open, null closed. Cancel (or Esc)
 * runs nothing. */
export function AskDialog({ id, ask, onClose }: { id: string; ask: Ask | null; onClose: () => void }) {
  const [reason, setReason] = useState("");
  // What the dialog shows while it closes: the last question, not an empty one.
  const shown = useRef<Ask | null>(null);
  if (ask) shown.current = ask;
  useEffect(() => {
    if (ask) setReason("");
  }, [ask]);
  const a = shown.current;
  return (
    <Confirm
      id={id}
      open={!!ask}
      title={a?.title ?? ""}
      action={a?.action ?? "Confirm"}
      onCancel={onClose}
      onConfirm={() => {
        const run = ask?.run;
        const why = reason.trim() || null;
        onClose();
        run?.(why);
      }}
    >
      {a?.body}
      {a?.reason && (
        <p class="form">
          <label for={`${id}-reason`}>Reason (optional; recorded with the change)</label>
          <input id={`${id}-reason`} maxLength={300} value={reason} onInput={(e) => setReason((e.currentTarget as HTMLInputElement).value)} />
        </p>
      )}
    </Confirm>
  );
}

/** What an action did, or why it was refused: read out when it changes. */
export function Outcome({ id, outcome }: { id: string; outcome: { ok: boolean; text: string } | null }) {
  return (
    <>
      <p role="status" class="muted" data-testid={id}>
        {outcome?.ok ? outcome.text : ""}
      </p>
      <div role="alert" class="error" data-testid={`${id}-problem`}>
        {outcome && !outcome.ok ? outcome.text : ""}
      </div>
    </>
  );
}
