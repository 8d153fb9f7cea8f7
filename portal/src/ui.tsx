// Small pieces the account pages share: a field's error under it, a form's problem, and a
// confirmation dialog (as the workload page's Terminate asks).
import type { ComponentChildren } from "preact";
import { useEffect, useRef } from "preact/hooks";
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
