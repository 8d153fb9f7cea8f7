import { useState } from "preact/hooks";
import { ApiError, signIn, type Session } from "../api";

export function SignIn({ notice, onSignedIn }: { notice: string; onSignedIn: (s: Session) => void }) {
  const [error, setError] = useState("");
  const [busy, setBusy] = useState(false);
  return (
    <main class="signin" id="main">
      <h1>Rackplane</h1>
      <p>Sign in with an API key. The key is exchanged for a browser session and is not kept by this page.</p>
      {notice && (
        <p class="notice" role="status">
          {notice}
        </p>
      )}
      <form
        onSubmit={async (e) => {
          e.preventDefault();
          const input = (e.currentTarget as HTMLFormElement).elements.namedItem("key") as HTMLInputElement;
          const key = input.value.trim();
          input.value = ""; // the key leaves the page as soon as it is sent
          setBusy(true);
          setError("");
          try {
            onSignedIn(await signIn(key));
          } catch (err) {
            setError(err instanceof ApiError ? `${err.message} (${err.code})` : String(err));
          } finally {
            setBusy(false);
          }
        }}
      >
        <label for="key">API key</label>
        <input id="key" name="key" type="password" autocomplete="off" required placeholder="rp_…" aria-describedby="key-error" />
        <button type="submit" disabled={busy}>
          Sign in
        </button>
        <p id="key-error" class="error" role="alert">
          {error}
        </p>
      </form>
    </main>
  );
}
